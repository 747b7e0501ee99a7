#!/usr/bin/env bash
# Build .gpu_carry/: what the H200 probe of vLLM's NixlConnector (issue 20 deliver 3, "On the H200,
# attempted"; docs/benchmarks.md#vllm-nixl) carries to the device machine, within its 64 MiB per call:
#
#   .gpu_carry/wheels/        CPython 3.12 wheels the image lacks: nixl (pure) and nixl_cu13 REPACKED with only
#                             what NIXL's UCX backend loads, msgspec and pyzmq (both from .whl/), and the pinned
#                             pure/cp312 wheels of vLLM's import path that the image lacks (pydantic and its
#                             helpers, cbor2, cachetools, pybase64, partial_json_parser, fastapi, starlette)
#   .gpu_carry/vllm_src.tar.gz  vLLM 0.33.0's Python sources (.py only, no compiled module), pruned to the packages
#                             the connector path imports, with its dist-info (vLLM's platform check reads its version)
#   .gpu_carry/MANIFEST.json  what was kept and left out (the probe names a missing vLLM module "pruned" from it)
#
# Usage: bash scripts/gpu_carry.sh        (then: du -sh .gpu_carry; the probe: scripts/gpu_vllm_probe.sh)
# Inputs, all local: .whl/ (the wheels scripts/gpu_run.sh carries), the cached vLLM environment
# (scripts/vllm_env.sh; its package versions pin the downloaded wheels), and a wheel cache
# ($HYBRID_TRANSFER_CACHE/gpu-wheels, default ~/.cache/hybrid-transfer/gpu-wheels) that pip fills once per version.
set -euo pipefail
cd "$(dirname "$0")/.."

CARRY=.gpu_carry
PY=.venv/bin/python
VENV=$(bash scripts/vllm_env.sh)
VPY="$VENV/bin/python"
SITE=$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
CACHE=${HYBRID_TRANSFER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hybrid-transfer}/gpu-wheels
NIXL_CU13=$(ls .whl/nixl_cu13-*-cp312-*.whl)
for tool in readelf tar; do command -v "$tool" >/dev/null || { echo "gpu_carry: needs $tool" >&2; exit 1; }; done

# The folder travels only when named in the device call's carry; git must not see it.
grep -qxF '/.gpu_carry/' .git/info/exclude 2>/dev/null || echo '/.gpu_carry/' >> .git/info/exclude

tmp="$CARRY.tmp.$$"
rm -rf "$tmp"
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/wheels" "$CACHE"

# 1. The small wheels gpu_run.sh already carries.
cp .whl/nixl-*-py3-none-any.whl .whl/msgspec-*-cp312-*.whl .whl/pyzmq-*-cp312-*.whl "$tmp/wheels/"

# 2. Pinned wheels of vLLM's import path that the image lacks (KINDS.md's package list), at the versions of the
#    local vLLM environment, fetched once into the cache. The image's compiled structured-output packages
#    (xgrammar, llguidance, apache-tvm-ffi, openai-harmony) and openai (it needs httpx2/httpcore2/jiter) are not
#    carried: the probe stubs them and says so.
CARRIED="pydantic pydantic_core typing_inspection annotated_types typing_extensions cbor2 cachetools pybase64
partial_json_parser fastapi starlette"
for dist in $CARRIED; do
    version=$("$VPY" -c "import importlib.metadata as m; print(m.version('$dist'))")
    norm=$(echo "$dist" | tr '-' '_')
    if ! ls "$CACHE/${norm}-${version}-"*.whl >/dev/null 2>&1; then
        "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --abi cp312 --abi abi3 --abi none --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
            --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 \
            --platform any -d "$CACHE" "${dist}==${version}" 2>&1 \
            | { grep -v 'is ignored: it is neither a file nor a directory' || true; } >&2
    fi
    cp "$CACHE/${norm}-${version}-"*.whl "$tmp/wheels/"
done

# 3. nixl_cu13 without what the UCX backend never loads: NIXL finds its plugins in .nixl_cu13.mesonpy.libs/plugins
#    (next to libnixl.so) and loads each listed one, so only libplugin_UCX.so stays there; UCX loads its transport
#    modules from nixl_cu13.libs/ucx, of which cma (CPU), cuda (cuda_copy, cuda_ipc) and ucm_cuda stay (no IB, no
#    perftest). The shared libraries kept are the NEEDED closure of those, of the Python bindings and of libnixl.so
#    (it links gRPC and etcd); nixl_ep (3 x 31 MB), the headers and the example programs go. RECORD is rewritten.
"$PY" - "$NIXL_CU13" "$tmp/wheels" <<'EOF'
import base64, hashlib, os, re, subprocess, sys, tempfile, zipfile

src, out_dir = sys.argv[1], sys.argv[2]
zin = zipfile.ZipFile(src)
names = [n for n in zin.namelist() if not n.endswith("/")]
dist_info = next(n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info"))
lib_dirs = (".nixl_cu13.mesonpy.libs", "nixl_cu13.libs")
roots = {n for n in names if re.fullmatch(r"nixl_cu13/[^/]+\.so", n)}
roots |= {".nixl_cu13.mesonpy.libs/libnixl.so", ".nixl_cu13.mesonpy.libs/plugins/libplugin_UCX.so"}
roots |= {f"nixl_cu13.libs/ucx/{m}.so.0.0.0" for m in ("libuct_cma", "libuct_cuda", "libucm_cuda")}
missing = roots - set(names)
if missing:
    sys.exit(f"repack: {sorted(missing)} not in {src}")
by_base = {}
for n in names:
    if n.startswith(lib_dirs) and ".so" in n:
        by_base.setdefault(os.path.basename(n), n)  # mesonpy.libs first: the path libnixl's RUNPATH tries first

with tempfile.TemporaryDirectory() as td:
    def needed(member):
        path = zin.extract(member, td)
        text = subprocess.run(["readelf", "-d", path], capture_output=True, text=True, check=True).stdout
        return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", text)

    keep, todo = set(), sorted(roots)
    while todo:
        member = todo.pop()
        if member in keep:
            continue
        keep.add(member)
        todo += [by_base[lib] for lib in needed(member) if lib in by_base]  # else a system library

keep |= {n for n in names if n.startswith("nixl_cu13/") and not n.endswith(".so")}
keep |= {n for n in names if n.startswith("nixl_cu13.libs/ucx/") and n.endswith(".la")
         and n[:-3] + ".so.0.0.0" in keep}
keep |= {n for n in names if n.startswith(dist_info + "/") and not n.endswith("/RECORD")}
dst = os.path.join(out_dir, os.path.basename(src))
record = []
with zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
    for n in sorted(keep):
        data = zin.read(n)
        info = zin.getinfo(n)
        zi = zipfile.ZipInfo(n, date_time=info.date_time)
        zi.external_attr, zi.compress_type = info.external_attr, zipfile.ZIP_DEFLATED
        zout.writestr(zi, data, compresslevel=9)
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{n},sha256={digest},{len(data)}")
    record.append(f"{dist_info}/RECORD,,")
    zout.writestr(f"{dist_info}/RECORD", "\n".join(record) + "\n")
size_in = sum(zin.getinfo(n).file_size for n in names)
size_kept = sum(zin.getinfo(n).file_size for n in keep)
print(f"nixl_cu13 repacked: {len(keep)} of {len(names)} files, {size_kept / 2**20:.1f} of {size_in / 2**20:.1f} MiB "
      f"unpacked, wheel {os.path.getsize(src) / 2**20:.1f} -> {os.path.getsize(dst) / 2**20:.1f} MiB")
for n in sorted(k for k in keep if "/plugins/" in k or "/ucx/" in k):
    print("  kept", n)
EOF

# 4. vLLM's Python sources. A trace records every vLLM module two runs import in the local vLLM environment: a
#    small side-by-side (benchmarks/vllm_nixl_side_by_side.py, both connectors, both processes: what runs, lazy
#    imports included) and an import of the CUDA platform's modules (vLLM's compiled modules stubbed there, for
#    the trace only). Every .py file is kept except in the large families of models, kernels and server code,
#    where only the traced files (and, outside the model and third-party folders, their folders) are kept.
trace="$tmp/trace"
mkdir -p "$trace/site"
cat > "$trace/site/sitecustomize.py" <<'EOF'
import atexit, os, sys
def _dump():  # every module this process imported, for scripts/gpu_carry.sh's selection
    with open(os.path.join(os.environ["GPU_CARRY_TRACE"], f"{os.getpid()}.txt"), "w") as f:
        f.write("\n".join(m.__file__ for m in list(sys.modules.values()) if getattr(m, "__file__", None)) + "\n")
atexit.register(_dump)
EOF
GPU_CARRY_TRACE="$trace" PYTHONPATH="$trace/site:$PWD" VLLM_TARGET_DEVICE=cpu VLLM_SSM_CONV_STATE_LAYOUT=DS \
    HF_HUB_OFFLINE=1 timeout 600 "$VPY" benchmarks/vllm_nixl_side_by_side.py --tokens 64 --concurrency 1 --waves 1 \
    --warmup 1 --rounds 1 --connectors vllm-nixl,hybrid >"$trace/side_by_side.log" 2>&1 \
    || { tail -n 20 "$trace/side_by_side.log" >&2; echo "gpu_carry: the trace's side-by-side failed" >&2; exit 1; }
GPU_CARRY_TRACE="$trace" "$VPY" - "$SITE" "$tmp" <<'EOF'
import glob, importlib, importlib.abc, importlib.machinery, json, os, sys, types

site, out = sys.argv[1], sys.argv[2]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
vllm_root = os.path.join(site, "vllm")
compiled = sorted("vllm." + os.path.relpath(os.path.join(d, f), vllm_root).split(".")[0].replace(os.sep, ".")
                  for d, _, fs in os.walk(vllm_root) for f in fs if f.endswith(".so"))


class TraceStubs(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """vLLM's compiled modules as empty modules, for this trace only (the local ones are built for CUDA)."""

    def find_spec(self, name, path=None, target=None):
        return importlib.machinery.ModuleSpec(name, self) if name in compiled else None

    def create_module(self, spec):
        return types.ModuleType(spec.name)

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, TraceStubs())
modules = """vllm vllm.platforms.cuda vllm.v1.attention.backends.flash_attn vllm.v1.attention.backends.gdn_attn
vllm.distributed.kv_transfer.kv_connector.v1.nixl vllm.distributed.nixl_utils vllm.third_party.pynvml""".split()
failed = {}
for name in modules:
    try:
        importlib.import_module(name)
    except Exception as exc:  # a module the CPU host cannot import stays out of the trace, and is listed
        failed[name] = f"{type(exc).__name__}: {exc}"
files = {m.__file__ for m in list(sys.modules.values()) if getattr(m, "__file__", None)}
for path in glob.glob(os.path.join(os.environ["GPU_CARRY_TRACE"], "*.txt")):
    files |= set(open(path).read().split())
traced = {os.path.relpath(f, site) for f in files if f.startswith(vllm_root + os.sep) and f.endswith(".py")}

ONLY_TRACED = ("vllm/model_executor/", "vllm/models/", "vllm/third_party/", "vllm/vllm_flash_attn/",
               "vllm/entrypoints/", "vllm/tool_parsers/", "vllm/reasoning/", "vllm/parser/", "vllm/benchmarks/",
               "vllm/lora/", "vllm/renderers/", "vllm/multimodal/")
NO_FOLDERS = ("vllm/model_executor/models/", "vllm/models/", "vllm/third_party/")
traced_dirs = {os.path.dirname(p) for p in traced}
every_py = sorted(os.path.relpath(os.path.join(d, f), site) for d, _, fs in os.walk(vllm_root)
                  if "__pycache__" not in d for f in fs if f.endswith(".py"))
keep = [p for p in every_py if not p.startswith(ONLY_TRACED) or p in traced
        or (os.path.dirname(p) in traced_dirs and not p.startswith(NO_FOLDERS)) or p == "vllm/third_party/pynvml.py"]
dist_info = next(d for d in os.listdir(site) if d.startswith("vllm-") and d.endswith(".dist-info"))
meta = [f"{dist_info}/{f}" for f in ("METADATA", "entry_points.txt", "top_level.txt", "WHEEL")
        if os.path.exists(os.path.join(site, dist_info, f))]
manifest = {"vllm_version": importlib.import_module("vllm").__version__, "kept": keep,
            "pruned": [p for p in every_py if p not in set(keep)], "compiled": compiled, "traced": sorted(traced),
            "trace_failed": failed}
with open(os.path.join(out, "MANIFEST.json"), "w") as f:
    json.dump(manifest, f, indent=1)
with open(os.path.join(out, "vllm_files.txt"), "w") as f:
    f.write("\n".join(keep + meta) + "\n")
size = sum(os.path.getsize(os.path.join(site, p)) for p in keep)
print(f"vllm sources: {len(keep)} of {len(every_py)} .py files ({size / 2**20:.1f} MiB; {len(traced)} traced), "
      f"{len(compiled)} compiled modules left out; trace failures: {failed or 'none'}")
EOF
tar -czf "$tmp/vllm_src.tar.gz" -C "$SITE" -T "$tmp/vllm_files.txt"
rm -r "$tmp/vllm_files.txt" "$trace"

rm -rf "$CARRY"
mv "$tmp" "$CARRY"
trap - EXIT
ls -l "$CARRY" "$CARRY/wheels" | awk 'NF > 5 {printf "%10d  %s\n", $5, $NF}'
du -sb "$CARRY" | awk '{printf "gpu_carry: %s holds %.1f MiB\n", $2, $1 / 1048576}'
