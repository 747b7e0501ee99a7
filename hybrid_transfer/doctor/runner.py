"""Run every doctor check in order, each check that needs an earlier one's outcome after it.

Each check returns a CheckResult (pass / warn / fail, what was seen, the fix); the checks that judge a
measurement take it as a parameter so tests can feed them any outcome. Checks of the host itself (NIXL
import, UCX backend, port, progress thread) live in ``host``; the transfer checks (transports, loopback
READs, cuda_ipc) in ``paths``.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from hybrid_transfer.doctor import host, mapped, paths
from hybrid_transfer.doctor.types import CheckResult, Device, DoctorOptions, DoctorReport, gpu_info, not_run


def run_doctor(options: DoctorOptions, on_check: Callable[[CheckResult], None] | None = None) -> DoctorReport:
    """Run every check; ``on_check(result)`` is called as each finishes (for progress output)."""
    options.validate()
    done: dict[str, CheckResult] = {}

    def record(result: CheckResult) -> CheckResult:
        done[result.name] = result
        if on_check is not None:
            on_check(result)
        return result

    nixl = record(host.check_nixl_import())
    api_module = nixl.data.get("api_module")
    if api_module:
        record(host.check_ucx_backend(api_module))
    else:
        record(not_run("ucx_backend", "NIXL is not importable"))

    gpu_present, num_gpus = gpu_info()
    want_vram = options.device is Device.CUDA or (options.device is Device.AUTO and gpu_present)
    dram = vram = None
    if api_module:
        dram = paths.run_transfer(paths.Memory.DRAM, options, api_module, num_gpus)
        if want_vram and gpu_present:
            vram = paths.run_transfer(paths.Memory.VRAM, options, api_module, num_gpus)
        record(paths.check_transports(dram, vram, options.num_bytes, vram_wanted=want_vram,
                                      gpu_present=gpu_present))
        record(paths.check_loopback(paths.Memory.DRAM, dram))
        record(paths.check_loopback(paths.Memory.VRAM, vram, wanted=want_vram, gpu_present=gpu_present))
    else:
        for name in ("transports", "loopback_dram", "loopback_vram"):
            record(not_run(name, "NIXL is not importable"))
    record(paths.check_cuda_ipc(gpu_present=gpu_present, environ=os.environ,
                                vram_transports=paths.observed_transports(vram, paths.Memory.VRAM,
                                                                          options.num_bytes),
                                device=options.device))
    record(mapped.check_mapped_path(gpu_present=gpu_present))
    record(host.check_side_channel_port(options.host, options.port))
    if api_module:
        record(host.check_progress_thread(api_module, sample_s=options.progress_sample_s))
    else:
        record(not_run("progress_thread", "NIXL is not importable"))
    return DoctorReport(checks=tuple(done.values()))
