"""Probe vLLM 0.33's NixlConnector on a host without vLLM's compiled modules or its torch (issue 20, deliver 3).

The H200 image has torch 2.11 and none of vLLM's compiled modules; vLLM 0.33.0 pins torch 2.14 and its CUDA
platform imports ``vllm._C_stable_libtorch`` at import time. With vLLM's Python sources on ``sys.path``
(``--vllm-src``, unpacked from ``.gpu_carry/vllm_src.tar.gz`` by scripts/gpu_vllm_probe.sh), this script:

  1. imports ``vllm``, resolves vLLM's platform, imports the NixlConnector's package
     (``vllm.distributed.kv_transfer.kv_connector.v1.nixl``) and the model class integrations/vllm_peer's
     config names (Qwen3-Next's). Each module that fails to import is replaced in
     ``sys.modules`` by a stub, one at a time, and the import is retried; each stub is logged with its kind:
       compiled   one of vLLM's compiled modules (not carried), a module that requires one, or one of their
                  custom ops (``torch.ops._C:<op>``)
       pruned     one of vLLM's .py modules that scripts/gpu_carry.sh left out (a gap in the carry)
       missing    a package the host lacks
       load       a module that is there but raised ImportError while loading
       attribute  a name a real module lacks (``cannot import name``, or an AttributeError on a module that is
                  not vLLM's): usually a torch API newer than the host's torch
     Any other exception stops the step; its traceback's last line and the innermost frame are printed.
  2. moves bytes between two agents of vLLM's own NIXL wrapper (``vllm.distributed.nixl_utils.NixlWrapper``)
     over UCX: GPU memory to GPU memory on a CUDA host, checked byte for byte (the carried nixl_cu13 wheel
     holds only what the UCX backend loads; the UCX transport modules loaded are listed).
  3. runs the side-by-side of benchmarks/vllm_nixl_side_by_side.py with both engines' caches on GPU 0
     (``--device cuda``: prefill here, decode in a spawned process, the same GPU; ``--connectors``, ``--waves``,
     ``--warmup``, ``--concurrency`` requests of ``--tokens``), under vLLM's CUDA platform and the stubs found
     above; it prints the table and the "same requests" line, and ``--side-by-side-json`` gets its figures. On a
     host without a GPU, or if ``hybrid_transfer.integrations.vllm_peer`` were CPU-only (the lines that fix it
     to the CPU are printed), ``--cpu-side-by-side`` runs it on this host's CPU memory instead (a child process
     with ``VLLM_TARGET_DEVICE=cpu``).

Every Python subprocess started after step 1 (that child, its decode process, vLLM's model inspection, which
vLLM runs in a subprocess of its own) gets the stubs found so far and ``--hide`` through a generated
``sitecustomize.py`` that leads its PYTHONPATH (and then runs the sitecustomize it shadows, if any).

Every step's outcome, every stub and every failure go to stdout and, with ``--json``, to a file.

  VLLM_SSM_CONV_STATE_LAYOUT=DS python benchmarks/vllm_gpu_probe.py --vllm-src /tmp/vsrc --json out/probe.json
      (the device machine; vLLM's NIXL moves a GDN conv state only in the DS layout)
  # locally, to test the probe itself: vLLM's environment, the carried sources, the CUDA platform forced and the
  # packages the image lacks hidden
  $(bash scripts/vllm_env.sh)/bin/python benchmarks/vllm_gpu_probe.py --vllm-src /tmp/vsrc \\
      --platform-class vllm.platforms.cuda.CudaPlatform --hide openai,xgrammar,llguidance,tvm_ffi,openai_harmony
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import inspect
import json
import logging
import os
import platform
import re
import subprocess
import sys
import sysconfig
import tempfile
import time
import traceback
import types
import typing
from pathlib import Path

log = logging.getLogger("vllm_gpu_probe")

REPO = Path(__file__).resolve().parents[1]
CONNECTOR_PACKAGE = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"
ARCHITECTURE = "Qwen3NextForCausalLM"  # what integrations/vllm_peer/model.py's config.json names
# Python subprocesses (vLLM's model inspection, the CPU side-by-side and its decode process) start with
# PYTHONPATH led by a folder whose sitecustomize.py installs the stubs found so far (STUBS_ENV) and --hide.
STUBS_ENV = "HT_PROBE_STUBS"  # JSON list of the stubs
HIDE_ENV = "HT_PROBE_HIDE"  # comma-separated hidden packages
SITE_ENV = "HT_PROBE_SITE"  # the folder of that sitecustomize.py (one per probe run, reused by its subprocesses)
MARKER = "# Written by benchmarks/vllm_gpu_probe.py"
SITECUSTOMIZE = MARKER + """: this process gets the probe's stubs, then the sitecustomize it shadows.
import importlib.util, os, sys
if os.environ.get({stubs!r}) or os.environ.get({hide!r}):
    _spec = importlib.util.spec_from_file_location("vllm_gpu_probe", {probe!r})
    _probe = importlib.util.module_from_spec(_spec)
    sys.modules["vllm_gpu_probe"] = _probe
    _spec.loader.exec_module(_probe)
    _probe.install_from_environment()
for _entry in sys.path:
    _other = os.path.join(_entry or ".", "sitecustomize.py")
    if os.path.exists(_other):
        _text = open(_other).read()
        if not _text.startswith({marker!r}):
            exec(compile(_text, _other, "exec"), {{"__name__": "sitecustomize", "__file__": _other}})
            break
"""
MAX_STUBS = 80
KINDS = ("compiled", "pruned", "missing", "load", "attribute")


# ---- stubs ----------------------------------------------------------------------------------------------


class Stub:
    """A stand-in for anything a stubbed module exports: attributes, calls, subscripts, bases, annotations.

    Calling it with one function or class returns that argument (it was used as a decorator); any other call
    returns a new stub. As a base class it drops out (``__mro_entries__``), so ``class C(Stub, BaseModel)``
    has no metaclass conflict; as a pydantic field type it accepts any value.
    """

    def __init__(self, name: str):
        object.__setattr__(self, "_stub_name", name)

    def __getattr__(self, attr: str):
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        value = Stub(f"{self._stub_name}.{attr}")
        object.__setattr__(self, attr, value)
        return value

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and not kwargs and (inspect.isfunction(args[0]) or inspect.isclass(args[0])):
            return args[0]
        return Stub(f"{self._stub_name}()")

    def __getitem__(self, item):
        return self

    def __iter__(self):
        return iter(())

    def __len__(self):
        return 0

    def __bool__(self):
        return False

    def __or__(self, other):
        return typing.Union[self, other]  # noqa: UP007 (a stub is no type: `|` would not work)

    def __ror__(self, other):
        return typing.Union[other, self]  # noqa: UP007

    def __mro_entries__(self, bases):
        return ()

    def __instancecheck__(self, obj):
        return False

    def __subclasscheck__(self, cls):
        return False

    def __repr__(self):
        return f"<stub {self._stub_name}>"

    def __get_pydantic_core_schema__(self, source, handler):
        from pydantic_core import core_schema

        return core_schema.any_schema()


class StubModule(types.ModuleType):
    """A stubbed module: a package (its submodules are stubs too) whose every public name is a ``Stub``."""

    __all__: list[str] = []

    def __getattr__(self, attr: str):
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        value = Stub(f"{self.__name__}.{attr}")
        setattr(self, attr, value)
        return value


class StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves ``StubModule`` for every stubbed name and its submodules; first on ``sys.meta_path``."""

    def __init__(self):
        self.names: set[str] = set()

    def covers(self, name: str) -> bool:
        return any(name == n or name.startswith(n + ".") for n in self.names)

    def find_spec(self, name, path=None, target=None):
        if not self.covers(name):
            return None
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec):
        module = StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


class HideFinder(importlib.abc.MetaPathFinder):
    """Makes packages unimportable (``--hide``): emulates, on a host that has them, a host that lacks them."""

    def __init__(self, names):
        self.names = set(names)

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.names:
            raise ModuleNotFoundError(f"No module named {name!r} (hidden by --hide)", name=name)
        return None


@dataclasses.dataclass
class StubRecord:
    name: str  # module, or module:attribute
    kind: str  # one of KINDS
    step: str
    error: str  # the error's last line that called for it


class Prober:
    """Imports under stubs, one at a time; records every stub and every failure."""

    def __init__(self, manifest: dict | None, max_stubs: int = MAX_STUBS):
        self.finder = StubFinder()
        sys.meta_path.insert(0, self.finder)
        self.stubs: list[StubRecord] = []
        self.failures: list[dict] = []
        self.max_stubs = max_stubs
        manifest = manifest or {}
        self.compiled = set(manifest.get("compiled", ()))
        self.pruned = {p[:-3].replace("/", ".").removesuffix(".__init__") for p in manifest.get("pruned", ())}

    # -- what a failure asks for
    def _kind(self, name: str, exc: BaseException) -> str:
        if name in self.compiled or name.split(".")[:2] == ["vllm", "_C"]:
            return "compiled"
        if name in self.pruned:
            return "pruned"
        if isinstance(exc, ModuleNotFoundError):
            return "missing"
        return "load"

    def stub_module(self, name: str, kind: str, step: str, error: str) -> None:
        for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
            del sys.modules[key]  # a half-imported real module must not shadow the stub
        self.finder.names.add(name)
        self.stubs.append(StubRecord(name, kind, step, error))
        os.environ[STUBS_ENV] = self.export()  # every Python subprocess started from now on gets it too
        log.warning("stub %-9s %s   (%s)", kind, name, error)

    def stub_attribute(self, module, attr: str, step: str, error: str) -> None:
        setattr(module, attr, Stub(f"{module.__name__}.{attr}"))
        # torch.ops.<namespace> is a module too: a missing op there is one of vLLM's compiled custom ops
        kind = "compiled" if module.__name__.startswith("torch.ops.") else "attribute"
        self.stubs.append(StubRecord(f"{module.__name__}:{attr}", kind, step, error))
        os.environ[STUBS_ENV] = self.export()
        log.warning("stub attribute %s.%s   (%s)", module.__name__, attr, error)

    def _handle(self, exc: BaseException, step: str) -> bool:
        """Install the stub ``exc`` (or an exception it was raised from) asks for; False if none (blocked)."""
        seen = set()
        while exc is not None and id(exc) not in seen:
            seen.add(id(exc))
            if self._handle_one(exc, step):
                return True
            exc = exc.__cause__ or exc.__context__
        return False

    def _handle_one(self, exc: BaseException, step: str) -> bool:
        error = last_line(exc)
        if isinstance(exc, ImportError):
            missing = re.match(r"cannot import name '(\w+)' from '([\w.]+)'", str(exc))
            if missing and "partially initialized" not in str(exc):
                attr, owner = missing.groups()
                module = sys.modules.get(owner)
                if module is None or isinstance(module, StubModule):
                    return False
                self.stub_attribute(module, attr, step, error)
                return True
            name = exc.name
            if not name:  # a module's own "requires ..." ImportError: the module that raised it is stubbed
                name = raising_module(exc)
                if not name or self.finder.covers(name):
                    return False
                compiled_inside = any(c.startswith(name + ".") for c in self.compiled)
                self.stub_module(name, "compiled" if compiled_inside else "load", step, error)
                return True
            if self.finder.covers(name):
                return False
            self.stub_module(name, self._kind(name, exc), step, error)
            return True
        if isinstance(exc, AttributeError) and isinstance(getattr(exc, "obj", None), types.ModuleType):
            module, attr = exc.obj, exc.name
            if attr and not module.__name__.startswith("vllm") and not isinstance(module, StubModule):
                self.stub_attribute(module, attr, step, error)
                return True
        return False

    def attempt(self, step: str, fn):
        """Run ``fn`` until it returns, stubbing what each failure asks for; (ok, value, seconds)."""
        t0 = time.perf_counter()
        while True:
            try:
                value = fn()
            except Exception as exc:  # every failure is recorded: this is a probe
                if len(self.stubs) < self.max_stubs and self._handle(exc, step):
                    continue
                self.failures.append({"step": step, "error": last_line(exc), "where": innermost_frame(exc),
                                      "vllm_frames": vllm_frames(exc),
                                      "traceback_tail": traceback.format_exception(exc)[-6:]})
                log.error("%s blocked: %s (at %s)", step, last_line(exc), innermost_frame(exc))
                return False, None, time.perf_counter() - t0
            return True, value, time.perf_counter() - t0

    def export(self) -> str:
        return json.dumps([dataclasses.asdict(s) for s in self.stubs])

    def install(self, records: list[dict]) -> None:
        """Re-install stubs found by a parent process (modules first; attributes on their real modules)."""
        for r in records:
            if ":" not in r["name"]:
                self.finder.names.add(r["name"])
                self.stubs.append(StubRecord(**r))
        for r in records:
            if ":" in r["name"]:
                owner, attr = r["name"].split(":")
                with contextlib.suppress(Exception):
                    self.stub_attribute(resolve_owner(owner), attr, r["step"], r["error"])


def resolve_owner(name: str):
    """The module, or module attribute, named ``name``: ``torch.ops._C`` is an op namespace on ``torch.ops``, not an
    importable module (a custom op stubbed in the parent must be stubbed on it in a subprocess too)."""
    try:
        return importlib.import_module(name)
    except ImportError:
        head, _, attr = name.rpartition(".")
        if not head:
            raise
        return getattr(resolve_owner(head), attr)


def last_line(exc: BaseException, limit: int = 400) -> str:
    """The exception's own line (a message that carries a remote traceback keeps only its first line)."""
    text = traceback.format_exception_only(exc)[-1].strip().splitlines()[0]
    return text if len(text) <= limit else text[:limit] + "..."


def raising_module(exc: BaseException) -> str | None:
    """The dotted name of the module whose top-level code raised ``exc`` (None: not module code, or stdlib)."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames or frames[-1].name != "<module>":
        return None
    path = os.path.abspath(frames[-1].filename)
    stdlib = sysconfig.get_paths()["stdlib"]
    roots = sorted((os.path.abspath(p) for p in sys.path if p and os.path.isdir(p)), key=len, reverse=True)
    for root in roots:
        if path.startswith(root + os.sep) and path.endswith(".py") and not root.startswith(stdlib):
            name = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
            return name.removesuffix(".__init__")
    return None


def vllm_frames(exc: BaseException, count: int = 4) -> list[str]:
    """The innermost ``count`` frames of the traceback that are vLLM's own code (where vLLM asked for it)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "/vllm/" in f.filename]
    return [f"vllm/{f.filename.split('/vllm/', 1)[1]}:{f.lineno} ({f.name})" for f in frames[-count:]]


def innermost_frame(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return "?"
    f = frames[-1]
    path = f.filename
    for marker in ("/vllm/", "/torch/", "/hybrid_transfer/"):
        if marker in path:
            path = marker.strip("/") + "/" + path.split(marker, 1)[1]
            break
    return f"{path}:{f.lineno} ({f.name})"


# ---- steps ----------------------------------------------------------------------------------------------


def environment() -> dict:
    out = {"python": platform.python_version(), "host": platform.node()}
    try:
        import torch

        out["torch"] = torch.__version__
        out["torch_cuda"] = torch.version.cuda
        out["cuda_available"] = torch.cuda.is_available()
        if out["cuda_available"]:
            out["gpu"] = torch.cuda.get_device_name(0)
    except Exception as exc:  # reported, not fatal: the probe says what the host has
        out["torch_error"] = last_line(exc)
    for dist in ("pydantic", "msgspec", "pyzmq", "nixl", "nixl-cu13", "transformers", "nvidia-ml-py"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


def resolve_platform(platform_class: str | None):
    """vLLM's current platform; with ``platform_class`` that class is imported and forced (local testing)."""
    import vllm.platforms as platforms

    if platform_class:
        module, _, name = platform_class.rpartition(".")
        platforms.current_platform = getattr(importlib.import_module(module), name)()
    current = platforms.current_platform
    return {"class": f"{type(current).__module__}.{type(current).__name__}",
            "device_type": getattr(current, "device_type", None)}


def cuda_detection() -> str:
    """What vLLM's CUDA platform check answers here (its own detection swallows the reason)."""
    import vllm.platforms as platforms

    try:
        return repr(platforms.cuda_platform_plugin())
    except Exception as exc:  # the reason is the answer
        return f"raised {last_line(exc)}"


def import_connector():
    package = importlib.import_module(CONNECTOR_PACKAGE)
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    cls = KVConnectorFactory.get_connector_class_by_name("NixlConnector")
    return {"module": package.__name__, "class": f"{cls.__module__}.{cls.__qualname__}",
            "file": inspect.getsourcefile(cls)}


def import_model_class(architecture: str = ARCHITECTURE) -> str:
    """Import the model class vLLM's planner resolves for vllm_peer's config (here, where failures can be stubbed:
    vLLM's own model inspection runs in a subprocess and reports only that it failed)."""
    from vllm.model_executor.models import registry

    module_name, class_name = registry._VLLM_MODELS[architecture]
    module = importlib.import_module(f"vllm.model_executor.models.{module_name}")
    return f"{module.__name__}.{getattr(module, class_name).__name__}"


def nixl_check(nbytes: int = 8 << 20) -> dict:
    """Two agents of vLLM's NIXL wrapper: a loopback READ of ``nbytes`` in GPU (else CPU) memory, checked."""
    import torch
    from vllm.distributed.nixl_utils import NixlWrapper, nixl_agent_config

    from hybrid_transfer.errors import BenchError, VerificationError

    if NixlWrapper is None:
        raise BenchError("vLLM found no NIXL (vllm.distributed.nixl_utils.NixlWrapper is None)", where="nixl")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    mem = "VRAM" if device == "cuda" else "DRAM"
    src = (torch.arange(nbytes, dtype=torch.int64, device=device) * 7 % 251).to(torch.uint8)
    dst = torch.zeros_like(src)
    config = nixl_agent_config(backends=["UCX"])
    a, b = NixlWrapper("probe-src", config), NixlWrapper("probe-dst", config)
    a.register_memory(a.get_reg_descs([src], mem))
    b.register_memory(b.get_reg_descs([dst], mem))
    b.add_remote_agent(a.get_agent_metadata())
    t0 = time.perf_counter()
    handle = b.initialize_xfer("READ", b.get_xfer_descs([dst], mem), a.get_xfer_descs([src], mem), "probe-src",
                               b"probe")
    state = b.transfer(handle)
    deadline = time.monotonic() + 30
    while state not in ("DONE", "ERR"):
        if time.monotonic() > deadline:
            raise BenchError("loopback READ not DONE in 30 s", where="nixl")
        state = b.check_xfer_state(handle)
    seconds = time.perf_counter() - t0
    if state != "DONE":
        raise BenchError(f"loopback READ ended {state}", where="nixl")
    bad = int((src != dst).sum())
    if bad:
        raise VerificationError(f"loopback READ: {bad} of {nbytes} bytes differ", tensor_index=0,
                                first_bad_offset=int((src != dst).nonzero()[0]), num_bad_bytes=bad, block_id=-1,
                                location=mem, expected_byte=-1, actual_byte=-1)
    b.release_xfer_handle(handle)
    loaded = sorted({Path(line.split()[-1]).name for line in Path("/proc/self/maps").read_text().splitlines()
                     if "/ucx/" in line or "libplugin_" in line})
    return {"memory": mem, "bytes": nbytes, "read_ms": round(seconds * 1e3, 3), "verified": True,
            "nixl_module": type(a).__module__, "ucx_modules_and_plugins_loaded": loaded}


def peer_device_support() -> dict:
    """Whether integrations/vllm_peer takes a device; if not, the lines that fix it to the CPU."""
    from hybrid_transfer.integrations.vllm_peer import side_by_side

    fields = {f.name for f in dataclasses.fields(side_by_side.PeerSpec)}
    if "device" in fields:
        return {"device_argument": True}
    pattern = re.compile(r"""["']cpu["']|CPUAttentionBackend|\.numpy\(\)|SC_AVPHYS_PAGES""")
    lines = []
    for path in sorted((REPO / "hybrid_transfer" / "integrations" / "vllm_peer").glob("*.py")):
        for i, text in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(text) and not text.lstrip().startswith("#"):
                lines.append(f"{path.relative_to(REPO)}:{i}: {text.strip()}")
    return {"device_argument": False, "cpu_fixed_at": lines}


DEFAULT_CONNECTORS = "vllm-nixl,hybrid,hybrid-post"


def run_side_by_side(args, device: str | None) -> dict:
    """The side-by-side of ``args`` (on ``device``, else vllm_peer's default, the CPU): prints its table and the
    "same requests" line; writes its figures to ``args.side_by_side_json`` if set.

    Raises:
        BenchError: the connectors did not move the same requests, block ids and bytes (after the JSON is written).
    """
    from hybrid_transfer.errors import BenchError
    from hybrid_transfer.integrations.vllm_peer import PeerSpec, plain_table, same_requests, to_json
    from hybrid_transfer.integrations.vllm_peer import run_side_by_side as run

    kwargs = {"preset": args.preset, "tokens": args.tokens, "concurrency": args.concurrency, "waves": args.waves,
              "warmup": args.warmup, "connectors": tuple(c for c in args.connectors.split(",") if c)}
    if device:
        kwargs["device"] = device
    spec = PeerSpec(**kwargs).validate()
    t0 = time.perf_counter()
    results = run(spec)
    seconds = time.perf_counter() - t0
    print(plain_table(spec, results), flush=True)
    problems = same_requests(results)
    print("same requests, block ids and bytes for every connector:", "yes" if not problems else "NO", flush=True)
    for line in problems:
        print("  " + line, flush=True)
    figures = {**to_json(spec, results), "problems": problems, "seconds": round(seconds, 1)}
    if getattr(args, "side_by_side_json", None):
        Path(args.side_by_side_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.side_by_side_json).write_text(json.dumps(figures, indent=1, default=str))
    if problems:
        raise BenchError(f"{len(problems)} difference(s) between the connectors: {problems[0]}", where="side-by-side")
    return figures


def cpu_side_by_side(args, seconds: float, report: dict) -> dict:
    """The side-by-side on this host's CPU memory, in a child process with the stubs found here.

    Raises:
        BenchError: the child failed or found no figures (its output and result are in ``report`` first).
    """
    from hybrid_transfer.errors import BenchError

    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_SSM_CONV_STATE_LAYOUT": "DS"}
    cmd = [sys.executable, __file__, "--vllm-src", args.vllm_src, "--child-side-by-side", "--preset", args.preset,
           "--tokens", str(args.tokens), "--concurrency", str(args.concurrency), "--waves", str(args.waves),
           "--warmup", str(args.warmup), "--connectors", args.connectors]
    if args.manifest:
        cmd += ["--manifest", args.manifest]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=seconds)
    except subprocess.TimeoutExpired as exc:
        tail = exc.stdout or b""
        report["cpu_side_by_side"] = {"output_tail": (tail.decode(errors="replace") if isinstance(tail, bytes)
                                                      else tail)[-3000:]}
        raise BenchError(f"not done within {seconds:.0f} s", where="cpu side-by-side") from exc
    result, shown = None, []
    for line in proc.stdout.splitlines():
        if line.startswith("CHILD_RESULT "):
            result = json.loads(line[len("CHILD_RESULT "):])
        else:
            shown.append(line)
    print("\n".join(shown[-40:]), flush=True)  # the child's table
    for stub in (result or {}).get("new_stubs", ()):
        print(f"  the child stubbed {stub['kind']} {stub['name']}: {stub['error']}")
    for failure in (result or {}).get("failures", ()):
        print(f"  the child failed: {failure['error']} at {failure['where']}")
    if proc.returncode != 0:
        print(proc.stderr[-2000:], flush=True)
    report["cpu_side_by_side"] = {"returncode": proc.returncode, "seconds": round(time.perf_counter() - t0, 1),
                                  "result": result, "stderr_tail": None if proc.returncode == 0 else proc.stderr[-3000:]}
    if proc.returncode != 0 or result is None or not result["ok"]:
        errors = [f["error"] for f in (result or {}).get("failures", ())] or [f"exit code {proc.returncode}"]
        raise BenchError("; ".join(errors), where="cpu side-by-side")
    return {k: result["figures"][k] for k in ("connectors", "same_requests")}


# ---- main -----------------------------------------------------------------------------------------------


def install_from_environment() -> Prober:
    """In a subprocess: the parent's --hide and stubs (called by the generated sitecustomize.py)."""
    if os.environ.get(HIDE_ENV):
        sys.meta_path.insert(0, HideFinder(n for n in os.environ[HIDE_ENV].split(",") if n))
    prober = Prober(None)  # first on sys.meta_path: a stub wins over --hide
    prober.install(json.loads(os.environ.get(STUBS_ENV) or "[]"))
    return prober


def _setup(args) -> Prober:
    """sys.path, --hide and the stub finder here; PYTHONPATH and sitecustomize.py for every subprocess."""
    paths = [os.path.abspath(args.vllm_src)] if args.vllm_src else []
    paths.append(str(REPO))
    for i, path in enumerate(paths):
        if path not in sys.path:
            sys.path.insert(i, path)
    if not os.path.isdir(os.environ.get(SITE_ENV, "")):  # else a subprocess of a probe: its PYTHONPATH is set
        site_dir = tempfile.mkdtemp(prefix="vllm_gpu_probe_site_")
        Path(site_dir, "sitecustomize.py").write_text(SITECUSTOMIZE.format(
            stubs=STUBS_ENV, hide=HIDE_ENV, probe=str(Path(__file__).resolve()), marker=MARKER))
        os.environ[SITE_ENV] = site_dir
        os.environ["PYTHONPATH"] = os.pathsep.join([site_dir, *paths, os.environ.get("PYTHONPATH", "")]).rstrip(
            os.pathsep)
    if args.hide:
        os.environ[HIDE_ENV] = args.hide
        sys.meta_path.insert(0, HideFinder(n for n in args.hide.split(",") if n))
    manifest = None
    if args.manifest and os.path.exists(args.manifest):
        manifest = json.loads(Path(args.manifest).read_text())
    if "vllm_gpu_probe" in sys.modules:  # a subprocess: its sitecustomize.py installed the parent's stubs
        inherited = sys.modules["vllm_gpu_probe"]
        sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, (inherited.StubFinder, inherited.HideFinder))]
        if os.environ.get(HIDE_ENV) and not args.hide:
            sys.meta_path.insert(0, HideFinder(n for n in os.environ[HIDE_ENV].split(",") if n))
    prober = Prober(manifest, args.max_stubs)  # first on sys.meta_path: a stub wins over --hide
    prober.install(json.loads(os.environ.get(STUBS_ENV) or "[]"))
    return prober


def child_main(args) -> int:
    """The CPU side-by-side in its own process (``--child-side-by-side``): one line of JSON at the end."""
    prober = _setup(args)
    ok, _, _ = prober.attempt("cpu model class", import_model_class)
    ok, result, seconds = prober.attempt("cpu side-by-side", lambda: run_side_by_side(args, None))
    new = [dataclasses.asdict(s) for s in prober.stubs if s.step.startswith("cpu ")]
    print("CHILD_RESULT " + json.dumps({"ok": ok, "seconds": round(seconds, 1), "figures": result,
                                        "new_stubs": new, "failures": prober.failures}, default=str), flush=True)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--vllm-src", default="/tmp/vsrc", help="folder holding vLLM's Python sources (vllm/)")
    parser.add_argument("--manifest", default=str(REPO / ".gpu_carry" / "MANIFEST.json"),
                        help="scripts/gpu_carry.sh's manifest (names a stub 'compiled' or 'pruned')")
    parser.add_argument("--json", help="write the outcome here")
    parser.add_argument("--budget-s", type=float, default=160.0, help="no step starts after this many seconds")
    parser.add_argument("--max-stubs", type=int, default=MAX_STUBS)
    parser.add_argument("--platform-class", help="force vLLM's platform class (local testing of the CUDA path)")
    parser.add_argument("--hide", default="", help="comma-separated packages made unimportable (local testing)")
    parser.add_argument("--preset", default="qwen3.5-0.8b")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--concurrency", type=int, default=8, help="requests per wave")
    parser.add_argument("--waves", type=int, default=2, help="timed waves")
    parser.add_argument("--warmup", type=int, default=1, help="untimed waves first")
    parser.add_argument("--connectors", default=DEFAULT_CONNECTORS, help="the side-by-side's, in this order")
    parser.add_argument("--side-by-side-json", help="write the side-by-side's figures here")
    parser.add_argument("--min-side-by-side-s", type=float, default=60.0,
                        help="start the side-by-side only with this many seconds of the budget left")
    parser.add_argument("--cpu-side-by-side", action="store_true",
                        help="if vllm_peer is CPU-only, run the side-by-side on this host's CPU memory instead")
    parser.add_argument("--child-side-by-side", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.child_side_by_side:
        return child_main(args)

    start = time.monotonic()
    prober = _setup(args)
    report: dict = {"environment": environment(), "steps": {}}
    print("environment:", json.dumps(report["environment"]), flush=True)

    def step(name, fn):
        if time.monotonic() - start > args.budget_s:
            report["steps"][name] = {"ok": False, "skipped": f"the {args.budget_s:.0f} s budget is spent"}
            print(f"== {name}: skipped (budget spent)", flush=True)
            return False, None
        ok, value, seconds = prober.attempt(name, fn)
        report["steps"][name] = {"ok": ok, "seconds": round(seconds, 2), "value": value}
        shown = f": {value}" if ok and len(str(value)) < 600 else (" (figures in the JSON)" if ok else "")
        print(f"== {name}: {'ok' if ok else 'BLOCKED'} in {seconds:.1f} s{shown}", flush=True)
        write_report()  # after every step: a run cut short by its timeout still leaves what it found
        return ok, value

    def write_report():
        report["stubs"] = [dataclasses.asdict(s) for s in prober.stubs]
        report["failures"] = prober.failures
        report["seconds"] = round(time.monotonic() - start, 1)
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(report, indent=1, default=str))

    imported, _ = step("import vllm", lambda: importlib.import_module("vllm").__version__)
    if imported:
        step("vllm platform", lambda: resolve_platform(args.platform_class))
        report["cuda_detection"] = cuda_detection()
        print("vLLM's CUDA check here:", report["cuda_detection"], flush=True)
        connector_ok, _ = step("import NixlConnector", import_connector)
        step("import the model class", import_model_class)
        step("NIXL through vLLM's wrapper", nixl_check)
        ok, support = step("vllm_peer device support", peer_device_support)
        if ok:
            gpu = bool(report["environment"].get("cuda_available"))
            left = args.budget_s - (time.monotonic() - start)
            if support["device_argument"] and gpu and connector_ok and left > args.min_side_by_side_s:
                step("side-by-side on cuda", lambda: run_side_by_side(args, "cuda"))
            elif support["device_argument"] and gpu:
                why = "the NixlConnector did not import" if not connector_ok else f"{left:.0f} s of the budget left"
                report["steps"]["side-by-side on cuda"] = {"ok": False, "skipped": why}
                print(f"== side-by-side on cuda: skipped ({why})", flush=True)
            else:
                if not support["device_argument"]:
                    print("integrations/vllm_peer is CPU-only; the lines that fix the CPU:", flush=True)
                    for line in support["cpu_fixed_at"]:
                        print("   ", line)
                else:
                    print("no GPU here (torch.cuda.is_available() is False): no side-by-side on cuda", flush=True)
                if args.cpu_side_by_side and left > 45:
                    step("side-by-side on this host's CPU", lambda: cpu_side_by_side(args, left - 5, report))
                elif args.cpu_side_by_side:
                    report["steps"]["side-by-side on this host's CPU"] = {"ok": False, "skipped": f"{left:.0f} s left"}

    write_report()
    print(f"\n{len(prober.stubs)} stub(s):")
    for kind in KINDS:
        for s in (s for s in prober.stubs if s.kind == kind):
            print(f"  {kind:9s} {s.name:60s} [{s.step}] {s.error}")
    print(f"{len(prober.failures)} failure(s):")
    for f in prober.failures:
        print(f"  [{f['step']}] {f['error']}  at {f['where']}")
        for frame in f["vllm_frames"]:
            print(f"      from {frame}")
    return 0 if not prober.failures else 1


if __name__ == "__main__":
    sys.exit(main())
