#!/usr/bin/env bash
# The device-side command of the H200 probe of vLLM 0.33's NixlConnector (issue 20 deliver 3, "On the H200,
# attempted"; docs/benchmarks.md#vllm-nixl). Run from the repo root on the device machine, with .gpu_carry/
# (built here by scripts/gpu_carry.sh) carried instead of .whl/:
#
#   run(kind="nvidia-h200", timeout_s=300, carry=[".gpu_carry"], command="timeout 280 bash scripts/gpu_vllm_probe.sh")
#
# Installs the carried wheels into /tmp/site, unpacks vLLM's Python sources into /tmp/vsrc, then runs
# benchmarks/vllm_gpu_probe.py (bounded by `timeout`, to end $PROBE_DEADLINE_S = 265 s after this script started, inside
# the device call's `timeout 280`): vLLM's import under logged
# stubs, the NixlConnector, a NIXL GPU loopback READ through vLLM's wrapper, then the side-by-side with both
# engines' caches on GPU 0 (qwen3.5-0.8b, 1,024 tokens, 8 requests per wave, 2 timed waves after 1 warm-up,
# connectors vllm-nixl, hybrid, hybrid-post; each overridable below). VLLM_TARGET_DEVICE stays unset: vLLM's CUDA
# platform. Without a GPU (PROBE_CPU_SIDE_BY_SIDE=1, the default) it runs on the host's CPU memory instead.
# The probe's JSON and log, and the side-by-side's JSON, go to $OUT.
set -u
OUT=${OUT:-$PWD/out}
CARRY=${CARRY:-.gpu_carry}
mkdir -p "$OUT"
[ -d "$CARRY/wheels" ] && [ -f "$CARRY/vllm_src.tar.gz" ] || { echo "no $CARRY: run scripts/gpu_carry.sh here first"; exit 1; }
du -sh "$CARRY"
t0=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$CARRY"/wheels/*.whl || exit 1
rm -rf /tmp/vsrc && mkdir -p /tmp/vsrc && tar -xzf "$CARRY/vllm_src.tar.gz" -C /tmp/vsrc || exit 1
echo "+ installed $(ls "$CARRY"/wheels | wc -l) wheels into /tmp/site, vLLM's sources into /tmp/vsrc in $((SECONDS - t0)) s"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
# Without it UCX moves GPU bytes over TCP on hosts without NVLink (docs/tuning.md#cuda-ipc). Multicast stays off
# (the device tool's rule).
export UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi -L
cpu=()
[ "${PROBE_CPU_SIDE_BY_SIDE:-1}" = 1 ] && cpu=(--cpu-side-by-side)
unset VLLM_TARGET_DEVICE
export VLLM_SSM_CONV_STATE_LAYOUT=DS  # vLLM's NIXL reads a GDN conv state in 3 parts only in this layout (asserts)
limit=$(( ${PROBE_DEADLINE_S:-265} - (SECONDS - t0) ))  # what the installs left
budget=$(( limit - 90 ))  # no step starts later: the side-by-side keeps at least 90 s
run=(python3 benchmarks/vllm_gpu_probe.py --vllm-src /tmp/vsrc --manifest "$CARRY/MANIFEST.json" --budget-s "$budget"
     --min-side-by-side-s 0 --preset "${PROBE_PRESET:-qwen3.5-0.8b}" --tokens "${PROBE_TOKENS:-1024}"
     --concurrency "${PROBE_CONCURRENCY:-8}" --waves "${PROBE_WAVES:-2}" --warmup "${PROBE_WARMUP:-1}"
     --connectors "${PROBE_CONNECTORS:-vllm-nixl,hybrid,hybrid-post}" "${cpu[@]}"
     --side-by-side-json "$OUT/side_by_side.json" --json "$OUT/probe.json")
echo "+ timeout $limit ${run[*]}"
set -o pipefail
timeout "$limit" "${run[@]}" 2>&1 | grep -v 'NIXL INFO' | tee "$OUT/probe.log"
rc=$?
echo "+ probe exit code $rc after $((SECONDS - t0)) s"
exit $rc
