"""Doctor checks of the transfer paths: which transport UCX picks, loopback READ rates, the cuda_ipc read setting.

Figures these verdicts cite (docs/tuning.md#measured-anchors): DRAM between two processes on this kind of host moves 4.6 GB/s over
shared memory and 0.9 GB/s over TCP (16 MiB descriptors); GPU memory on an H200 moves ~1,755 GB/s over
cuda_ipc and 0.4-0.5 GB/s when UCX silently falls back to TCP.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from hybrid_transfer.doctor.loopback import READER_NAME, LoopbackResult, Memory, run_loopback
from hybrid_transfer.doctor.types import CheckResult, Device, DoctorOptions, Status
from hybrid_transfer.doctor.ucx_tables import ProtoTable, parse_proto_tables, read_tables

__all__ = ["Memory", "check_cuda_ipc", "check_loopback", "check_transports", "observed_transports", "run_transfer"]

CUDA_IPC_GET_VAR = "UCX_CUDA_IPC_ENABLE_GET_ZCOPY"
_TRUE_WORDS = {"y", "yes", "on", "1", "true"}  # UCX's spellings of "on"
SHARED_MEMORY_TRANSPORTS = {"cma", "sysv", "posix", "xpmem", "knem"}
VRAM_SUSPECT_GBPS = 10.0  # far above TCP (0.4-0.5 GB/s), far below any GPU-to-GPU path
_MEMORY_WORD = {Memory.DRAM: "host", Memory.VRAM: "cuda"}  # how UCX's tables name the memory type
_FIX_CUDA_IPC = f"export {CUDA_IPC_GET_VAR}=y  (in the environment of every prefill and decode process)"


def run_transfer(memory: Memory, options: DoctorOptions, api_module: str, num_gpus: int) -> LoopbackResult:
    """The loopback run behind checks 3-5; on a host with two GPUs the VRAM source sits on the second one."""
    source_device = 1 if memory is Memory.VRAM and num_gpus >= 2 else 0
    return run_loopback(memory, options.num_bytes, api_module=api_module, repeats=options.repeats,
                        timeout_s=options.timeout_s, source_device=source_device)


def _read_tables(result: LoopbackResult | None, memory: Memory) -> list[ProtoTable]:
    if result is None or not result.ucx_log:
        return []
    return read_tables(parse_proto_tables(result.ucx_log.splitlines()), READER_NAME, _MEMORY_WORD[memory])


def observed_transports(result: LoopbackResult | None, memory: Memory, num_bytes: int) -> list[str] | None:
    """Transports UCX selected for the loopback READ of ``num_bytes``; None when nothing was observed."""
    tables = _read_tables(result, memory)
    if not tables:
        return None
    found = [t for table in tables for t in table.transports_for(num_bytes)]
    return list(dict.fromkeys(found)) or None


def _ucx_errors(result: LoopbackResult | None) -> list[str]:
    if result is None:
        return []
    return [line.split("UCX", 1)[-1].strip() for line in result.ucx_log.splitlines()
            if "UCX  ERROR" in line or "UCX  WARN" in line][:5]


def _why_unobserved(result: LoopbackResult | None, memory: Memory) -> str:
    if result is None:
        return "no loopback run"
    if not result.ok:
        return f"the loopback READ failed ({result.error})"
    return (f"UCX printed no READ protocol table for {memory.value} (UCX_PROTO_INFO had no effect: "
            "UCX_PROTO_ENABLE=n or a UCX older than 1.15?)")


def _describe(memory: Memory, result: LoopbackResult | None, num_bytes: int) -> dict[str, Any]:
    tables = _read_tables(result, memory)
    rows = [{"operation": t.operation, "scope": t.scope,
             "rows": [{"min_bytes": r.min_bytes, "max_bytes": r.max_bytes, "protocol": r.description,
                       "config": r.config} for r in t.rows]} for t in tables]
    return {"transports": observed_transports(result, memory, num_bytes), "tables": rows}


def check_transports(dram: LoopbackResult | None, vram: LoopbackResult | None, num_bytes: int, *,
                     vram_wanted: bool = False, gpu_present: bool = False) -> CheckResult:
    """3. The transports UCX selected for the loopback READs, read from its UCX_PROTO_INFO tables."""
    data = {"dram": _describe(Memory.DRAM, dram, num_bytes), "vram": _describe(Memory.VRAM, vram, num_bytes),
            "method": "UCX_PROTO_INFO=y in the reading process; the 'remote memory read by ucp_get*' table "
                      "towards the peer, row covering the READ size"}
    statuses, parts, fixes = [], [], []

    seen = data["dram"]["transports"]
    if seen is None:
        statuses.append(Status.WARN)
        parts.append(f"DRAM: not observed: {_why_unobserved(dram, Memory.DRAM)}")
        fixes.append("rerun with UCX_PROTO_INFO=y UCX_LOG_LEVEL=info and look for 'remote memory read'")
    elif SHARED_MEMORY_TRANSPORTS & set(seen) or "tcp" not in seen:
        statuses.append(Status.PASS)
        parts.append(f"DRAM READ via {'+'.join(seen)}")
    else:
        statuses.append(Status.WARN)
        parts.append(f"DRAM READ via {'+'.join(seen)} (TCP: about 5x slower than shared memory, 0.9 vs 4.6 GB/s)")
        fixes.append("let UCX use shared memory: UCX_TLS must not exclude cma/sysv/posix (unset it, or add "
                     "'sm'); in containers allow process_vm_readv (CAP_SYS_PTRACE / --ipc=host)")

    if not vram_wanted:
        parts.append("VRAM: not applicable (--device cpu)" if gpu_present else "VRAM: not applicable (no GPU)")
    else:
        seen = data["vram"]["transports"]
        if vram is None:  # loopback_vram fails for this and carries the fix
            statuses.append(Status.WARN)
            parts.append("VRAM: not observed: no GPU (torch.cuda.is_available() is False)")
            fixes.append("see loopback_vram")
        elif seen is None:
            statuses.append(Status.WARN)
            parts.append(f"VRAM: not observed: {_why_unobserved(vram, Memory.VRAM)}")
            fixes.append("rerun with UCX_PROTO_INFO=y UCX_LOG_LEVEL=info and look for 'remote memory read'")
        elif "tcp" in seen:
            statuses.append(Status.FAIL)
            parts.append(f"VRAM READ via {'+'.join(seen)}: GPU bytes go over TCP (0.4-0.5 GB/s instead of "
                         "~1.7 TB/s)")
            fixes.append(_FIX_CUDA_IPC)
        elif "cuda_ipc" in seen:
            statuses.append(Status.PASS)
            parts.append(f"VRAM READ via {'+'.join(seen)}")
        else:
            statuses.append(Status.WARN)
            parts.append(f"VRAM READ via {'+'.join(seen)} (expected cuda_ipc between processes of one host)")
            fixes.append(f"{_FIX_CUDA_IPC}; check UCX_TLS includes cuda_ipc")
    return CheckResult(name="transports", status=_worst(statuses), detail="; ".join(parts),
                       fix="; ".join(dict.fromkeys(fixes)), data=data)


def check_loopback(memory: Memory, result: LoopbackResult | None, *, wanted: bool = True,
                   gpu_present: bool = True) -> CheckResult:
    """4. A READ between two processes moved and verified the bytes; its rate."""
    name = f"loopback_{memory.value.lower()}"
    if result is None:
        if not wanted:
            why = "--device cpu" if gpu_present else "no GPU"
            return CheckResult(name=name, status=Status.PASS, detail=f"not applicable ({why})",
                               data={"applicable": False})
        return CheckResult(name=name, status=Status.FAIL, detail="no GPU: torch.cuda.is_available() is False",
                           fix="run on a GPU host with a CUDA build of torch, or pass --device cpu",
                           data={"applicable": True})
    data = {"applicable": True, "num_bytes": result.num_bytes, "gbps": result.gbps,
            "gbps_samples": list(result.gbps_samples), "first_read_s": result.first_read_s,
            "verified": result.verified, "reader_device": result.reader_device,
            "source_device": result.source_device, "error": result.error, "ucx_errors": _ucx_errors(result)}
    size = f"{result.num_bytes / 2**20:g} MiB"
    if not result.ok:
        errors = "; ".join(data["ucx_errors"])
        return CheckResult(
            name=name, status=Status.FAIL, detail=f"{size} READ between two processes failed: {result.error}"
            + (f" (UCX: {errors})" if errors else ""),
            fix="the error and UCX's lines say why; rerun with UCX_LOG_LEVEL=info, and check UCX_TLS / "
                "UCX_NET_DEVICES settings in the environment", data=data)
    where = (f", GPU {result.source_device} -> GPU {result.reader_device}" if memory is Memory.VRAM else "")
    detail = (f"{size} in one READ between two processes{where}: {result.gbps:.2f} GB/s (median of "
              f"{len(result.gbps_samples)}; first READ with connection set-up {result.first_read_s * 1e3:.0f} ms), "
              "bytes verified")
    if memory is Memory.VRAM and result.gbps is not None and result.gbps < VRAM_SUSPECT_GBPS:
        return CheckResult(name=name, status=Status.WARN,
                           detail=f"{detail}; far below any GPU path: looks like TCP (0.4-0.5 GB/s)",
                           fix=_FIX_CUDA_IPC, data=data)
    return CheckResult(name=name, status=Status.PASS, detail=detail, data=data)


def cuda_ipc_get_enabled(environ: Mapping[str, str]) -> bool:
    return environ.get(CUDA_IPC_GET_VAR, "").strip().lower() in _TRUE_WORDS


def check_cuda_ipc(gpu_present: bool, environ: Mapping[str, str], vram_transports: Sequence[str] | None = None,
                   device: Device = Device.AUTO) -> CheckResult:
    """5. GPU READs need ``UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y``: without it UCX turns cuda_ipc reads off on hosts
    without NVLink and moves GPU bytes over TCP, silently (docs/tuning.md#cuda-ipc)."""
    value = environ.get(CUDA_IPC_GET_VAR)
    enabled = cuda_ipc_get_enabled(environ)
    data = {"variable": CUDA_IPC_GET_VAR, "value": value, "enabled": enabled, "gpu_present": gpu_present,
            "vram_transports": list(vram_transports) if vram_transports is not None else None}
    if device is Device.CPU or not gpu_present:
        why = "--device cpu" if device is Device.CPU else "no GPU"
        data["applicable"] = False
        return CheckResult(name="cuda_ipc_read", status=Status.PASS,
                           detail=f"not applicable ({why}); on GPU hosts {CUDA_IPC_GET_VAR}=y is required",
                           data=data)
    data["applicable"] = True
    setting = f"{CUDA_IPC_GET_VAR}={value}" if value is not None else f"{CUDA_IPC_GET_VAR} is not set"
    over_tcp = vram_transports is not None and "tcp" in vram_transports
    if over_tcp:
        cause = ("UCX disables cuda_ipc reads on hosts without NVLink" if not enabled
                 else "cuda_ipc reads are enabled, so UCX_TLS or UCX_CUDA_IPC_* settings exclude cuda_ipc")
        return CheckResult(
            name="cuda_ipc_read", status=Status.FAIL,
            detail=f"{setting}; the VRAM READ went over TCP: {cause}, and GPU bytes move at 0.4-0.5 GB/s "
                   "instead of ~1.7 TB/s",
            fix=_FIX_CUDA_IPC if not enabled else "let UCX_TLS include cuda_ipc (or unset it)", data=data)
    if enabled:
        seen = f"; VRAM READ via {'+'.join(vram_transports)}" if vram_transports else ""
        return CheckResult(name="cuda_ipc_read", status=Status.PASS, detail=f"{setting}{seen}", data=data)
    seen = (f"here the READ used {'+'.join(vram_transports)} (NVLink lets UCX's 'auto' enable it), but "
            if vram_transports else "")
    return CheckResult(
        name="cuda_ipc_read", status=Status.WARN,
        detail=f"{setting}: {seen}UCX turns cuda_ipc reads off on hosts without NVLink and then moves GPU bytes "
               "over TCP without a word (0.4-0.5 GB/s instead of ~1.7 TB/s)",
        fix=_FIX_CUDA_IPC, data=data)


def _worst(statuses: Sequence[Status]) -> Status:
    if Status.FAIL in statuses:
        return Status.FAIL
    return Status.WARN if Status.WARN in statuses else Status.PASS
