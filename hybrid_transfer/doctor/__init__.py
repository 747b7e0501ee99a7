"""`hybrid-transfer doctor`: check that this host can move cache bytes the way the engine will.

Modules, imports pointing down: types (verdicts, report, options) <- ucx_tables (UCX's protocol
tables) <- loopback (a two-process READ through the engine's agent) <- host, paths (the checks)
<- runner (their order) and render (the table the CLI prints); link_wire (the messages of a check
between two hosts) <- link (``--serve`` and ``--peer``, docs/between-hosts.md#doctor-peer). Every NIXL
call goes through ``hybrid_transfer.engine.agent.NixlAgent``.
"""

from hybrid_transfer.doctor.render import render
from hybrid_transfer.doctor.runner import run_doctor
from hybrid_transfer.doctor.types import (
    DEFAULT_NUM_BYTES,
    MIN_NUM_BYTES,
    CheckResult,
    Device,
    DoctorOptions,
    DoctorReport,
    Status,
)

__all__ = ["DEFAULT_NUM_BYTES", "MIN_NUM_BYTES", "CheckResult", "Device", "DoctorOptions", "DoctorReport", "Status",
           "render", "run_doctor"]
