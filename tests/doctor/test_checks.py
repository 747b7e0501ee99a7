"""doctor's checks (hybrid_transfer.doctor): structure, verdicts on injected outcomes, real loopback READs.

The UCX tables below are lines UCX 1.23.0 (nixl-cu13 1.5.1) printed with UCX_PROTO_INFO=y: a DRAM READ on
this 2-core host, and VRAM READs on an H200 with default settings (tcp) and with
UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y (cuda_ipc).
"""

from __future__ import annotations

import errno
import socket

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybrid_transfer.doctor.host import (
    check_nixl_import,
    check_progress_thread,
    check_side_channel_port,
    check_ucx_backend,
    judge_progress_thread,
)
from hybrid_transfer.doctor.loopback import READER_NAME, LoopbackResult, Memory, run_loopback
from hybrid_transfer.doctor.paths import (
    CUDA_IPC_GET_VAR,
    check_cuda_ipc,
    check_loopback,
    check_transports,
    observed_transports,
)
from hybrid_transfer.doctor.types import (
    CheckResult,
    Device,
    DoctorOptions,
    DoctorReport,
    Status,
    not_run,
)
from hybrid_transfer.doctor.ucx_tables import parse_proto_tables, read_tables
from hybrid_transfer.errors import ConfigError

P = "[1795959126.047886] [vm:8284 :0]   "
DRAM_LOG = f"""\
{P}+--------+-------------+-----------------------------------+
{P}| {READER_NAME} self cfg#0                          |
{P}| remote memory read by ucp_get*(multi) into host memory from host |
{P}+--------+-------------+-----------------------------------+
{P}| Range  | Description |              Config               |
{P}+--------+-------------+-----------------------------------+
{P}| 0..inf | zero-copy   | sysv/memory                       |
{P}+--------+-------------+-----------------------------------+
{P}+------------+--------------------+---------------+
{P}| {READER_NAME} intra-node cfg#1                           |
{P}| active message by ucp_am_send* from host memory |
{P}+------------+--------------------+---------------+
{P}|   Range    |    Description     |    Config     |
{P}+------------+--------------------+---------------+
{P}|          0 | short              | tcp/lo        |
{P}|   1..16515 | zero-copy          | tcp/lo        |
{P}| 16516..inf | multi-frag copy-in | tcp/lo        |
{P}+------------+--------------------+---------------+
2026-11-29 13:32:05 NIXL INFO    _api.py:405 Backend UCX was instantiated
{P}+--------+-------------+-------------------------------------------+
{P}| {READER_NAME} intra-node cfg#1                                            |
{P}| remote memory read by ucp_get*(multi) into host memory from host |
{P}+--------+-------------+-------------------------------------------+
{P}| Range  | Description |                  Config                   |
{P}+--------+-------------+-------------------------------------------+
{P}| 0..inf | zero-copy   | cma/memory                                |
{P}+--------+-------------+-------------------------------------------+
"""


def vram_log(config: str, description: str) -> str:
    return f"""\
{P}+--------+--------------------+-----------------------------------------+
{P}| {READER_NAME} intra-node cfg#2                                     |
{P}| remote memory read by ucp_get*(multi) into cuda/GPU0 from cuda/dev[1] |
{P}+--------+--------------------+-----------------------------------------+
{P}| Range  |    Description     |                 Config                  |
{P}+--------+--------------------+-----------------------------------------+
{P}| 0..inf | {description} | {config}                                  |
{P}+--------+--------------------+-----------------------------------------+
"""


VRAM_TCP_LOG = vram_log("tcp/lo", "software emulation")
VRAM_IPC_LOG = vram_log("cuda_ipc/cuda", "zero-copy")
MIB = 1 << 20


def result(memory: Memory, log: str = "", *, gbps: float = 5.0, error: str | None = None,
           verified: bool = True) -> LoopbackResult:
    return LoopbackResult(memory=memory, num_bytes=64 * MIB, verified=verified, error=error, gbps=gbps,
                          gbps_samples=(gbps,), first_read_s=0.1, ucx_log=log)


def assert_well_formed(check: CheckResult, name: str) -> None:
    assert check.name == name
    assert isinstance(check.status, Status)
    assert isinstance(check.detail, str) and check.detail
    assert isinstance(check.data, dict)
    if check.status is not Status.PASS:
        assert check.fix, f"{name}: a {check.status.value} without a fix"
    msgspec.json.encode(check)  # JSON-serialisable as the CLI prints it


@pytest.fixture(scope="module")
def api_module() -> str:
    check = check_nixl_import()
    assert check.status is Status.PASS, check.detail
    return check.data["api_module"]


# ---- UCX protocol tables ------------------------------------------------------------------------------------


def test_parser_reads_every_table_and_its_rows():
    tables = parse_proto_tables(DRAM_LOG.splitlines())
    assert [(t.worker, t.scope) for t in tables] == [(READER_NAME, "self"), (READER_NAME, "intra-node"),
                                                     (READER_NAME, "intra-node")]
    am = tables[1]
    assert [(r.min_bytes, r.max_bytes, r.description) for r in am.rows] == [
        (0, 0, "short"), (1, 16515, "zero-copy"), (16516, None, "multi-frag copy-in")]
    assert am.transports_for(20000) == ("tcp",)
    assert not am.is_read


def test_read_tables_pick_the_peer_read_of_the_memory_type():
    tables = parse_proto_tables(DRAM_LOG.splitlines())
    reads = read_tables(tables, READER_NAME, "host")
    assert len(reads) == 1 and reads[0].scope == "intra-node"  # the self-loopback table is not the peer's
    assert reads[0].transports_for(64 * MIB) == ("cma",)
    assert read_tables(tables, READER_NAME, "cuda") == []
    assert read_tables(tables, "someone-else", "host") == []
    vram = read_tables(parse_proto_tables(VRAM_TCP_LOG.splitlines()), READER_NAME, "cuda")
    assert vram[0].transports_for(1) == ("tcp",)


def test_parser_splits_multi_lane_configs():
    log = vram_log("50% on rc_mlx5/mlx5_0:1 and 50% on rc_mlx5/mlx5_1:1", "zero-copy")
    (table,) = parse_proto_tables(log.splitlines())
    assert table.rows[0].transports == ("rc_mlx5",)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(alphabet="|+-. 0123456789abcinf/:_#", max_size=40), max_size=30))
def test_parser_never_raises_on_garbage(lines):
    for table in parse_proto_tables(lines):
        assert table.rows
        for row in table.rows:
            assert row.min_bytes >= 0 and all(isinstance(t, str) and t for t in row.transports)


# ---- 1, 2: NIXL and the UCX backend -------------------------------------------------------------------------


def test_nixl_import_names_the_build(api_module):
    check = check_nixl_import()
    assert_well_formed(check, "nixl")
    assert check.data["build"] in ("nixl-cu12", "nixl-cu13", "nixl-rocm")
    assert check.data["api_module"].startswith(check.data["build"].replace("-", "_"))
    assert check.data["build_version"] and check.data["module_path"]


def test_nixl_import_failure_is_a_fail_with_a_fix():
    check = check_nixl_import(meta_module="nixl_not_installed_here")
    assert_well_formed(check, "nixl")
    assert check.status is Status.FAIL
    assert "pip install" in check.fix and "error" in check.data


def test_ucx_backend_comes_up(api_module):
    check = check_ucx_backend(api_module)
    assert_well_formed(check, "ucx_backend")
    assert check.status is Status.PASS
    assert "UCX" in check.data["plugins"] and "UCX" in check.data["backends"]
    assert "DRAM_SEG" in check.data["mem_types"]


# ---- 3, 4: real loopback READs between two processes ---------------------------------------------------------


def test_loopback_dram_moves_and_verifies_bytes(api_module):
    run = run_loopback(Memory.DRAM, 4 * MIB, api_module=api_module, repeats=2)
    assert run.error is None and run.verified and run.ok
    assert len(run.gbps_samples) == 2 and all(g > 0 for g in run.gbps_samples)
    check = check_loopback(Memory.DRAM, run)
    assert_well_formed(check, "loopback_dram")
    assert check.status is Status.PASS and check.data["verified"]
    seen = observed_transports(run, Memory.DRAM, 4 * MIB)
    assert seen  # UCX_PROTO_INFO tables were captured from the reader process
    transports = check_transports(run, None, 4 * MIB)
    assert transports.data["dram"]["transports"] == seen


def test_forcing_tcp_is_observed_and_warned(api_module, monkeypatch):
    monkeypatch.setenv("UCX_TLS", "tcp")  # the children inherit it
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")  # TCP over loopback only: no traffic to the host's interfaces
    run = run_loopback(Memory.DRAM, 1 * MIB, api_module=api_module, repeats=1)
    assert run.ok
    assert observed_transports(run, Memory.DRAM, 1 * MIB) == ["tcp"]
    check = check_transports(run, None, 1 * MIB)
    assert check.status is Status.WARN and "tcp" in check.detail and "UCX_TLS" in check.fix


def test_loopback_rejects_sizes_it_cannot_verify():
    with pytest.raises(ValueError):
        run_loopback(Memory.DRAM, 1001)


# ---- 3, 4: verdicts on injected outcomes ---------------------------------------------------------------------


def test_transports_verdicts():
    dram = result(Memory.DRAM, DRAM_LOG)
    assert check_transports(dram, None, 64 * MIB).status is Status.PASS
    tcp = check_transports(dram, result(Memory.VRAM, VRAM_TCP_LOG), 64 * MIB, vram_wanted=True, gpu_present=True)
    assert tcp.status is Status.FAIL and CUDA_IPC_GET_VAR in tcp.fix
    ipc = check_transports(dram, result(Memory.VRAM, VRAM_IPC_LOG), 64 * MIB, vram_wanted=True, gpu_present=True)
    assert ipc.status is Status.PASS and ipc.data["vram"]["transports"] == ["cuda_ipc"]
    unseen = check_transports(result(Memory.DRAM, ""), None, 64 * MIB)
    assert unseen.status is Status.WARN and "not observed" in unseen.detail
    no_gpu = check_transports(dram, None, 64 * MIB, vram_wanted=True, gpu_present=False)
    assert no_gpu.status is Status.WARN
    for check in (tcp, ipc, unseen, no_gpu):
        assert_well_formed(check, "transports")


def test_loopback_verdicts():
    failed = check_loopback(Memory.DRAM, result(Memory.DRAM, error="reader: boom", verified=False))
    assert failed.status is Status.FAIL and "boom" in failed.detail and failed.fix
    slow_gpu = check_loopback(Memory.VRAM, result(Memory.VRAM, gbps=0.5))
    assert slow_gpu.status is Status.WARN and CUDA_IPC_GET_VAR in slow_gpu.fix
    assert check_loopback(Memory.VRAM, result(Memory.VRAM, gbps=1400.0)).status is Status.PASS
    not_applicable = check_loopback(Memory.VRAM, None, wanted=False, gpu_present=False)
    assert not_applicable.status is Status.PASS and not not_applicable.data["applicable"]
    missing_gpu = check_loopback(Memory.VRAM, None, wanted=True, gpu_present=False)
    assert missing_gpu.status is Status.FAIL
    for check in (failed, slow_gpu, not_applicable, missing_gpu):
        assert_well_formed(check, check.name)


# ---- 5: the cuda_ipc read setting ---------------------------------------------------------------------------


def test_cuda_ipc_warns_when_the_variable_is_missing_on_a_gpu_host():
    check = check_cuda_ipc(gpu_present=True, environ={})
    assert_well_formed(check, "cuda_ipc_read")
    assert check.status is Status.WARN
    assert f"export {CUDA_IPC_GET_VAR}=y" in check.fix and "TCP" in check.detail


@pytest.mark.parametrize("value", ["n", "no", "auto", ""])
def test_cuda_ipc_warns_when_the_variable_is_not_on(value):
    assert check_cuda_ipc(gpu_present=True, environ={CUDA_IPC_GET_VAR: value}).status is Status.WARN


@pytest.mark.parametrize("value", ["y", "yes", "on", "1", "Y"])
def test_cuda_ipc_passes_when_set(value):
    check = check_cuda_ipc(gpu_present=True, environ={CUDA_IPC_GET_VAR: value}, vram_transports=["cuda_ipc"])
    assert check.status is Status.PASS and check.data["enabled"]


def test_cuda_ipc_fails_when_gpu_bytes_went_over_tcp():
    unset = check_cuda_ipc(gpu_present=True, environ={}, vram_transports=["tcp"])
    assert unset.status is Status.FAIL and CUDA_IPC_GET_VAR in unset.fix
    set_but_tcp = check_cuda_ipc(gpu_present=True, environ={CUDA_IPC_GET_VAR: "y"}, vram_transports=["tcp"])
    assert set_but_tcp.status is Status.FAIL and "UCX_TLS" in set_but_tcp.fix


def test_cuda_ipc_not_applicable_without_gpu_or_on_cpu():
    no_gpu = check_cuda_ipc(gpu_present=False, environ={})
    cpu = check_cuda_ipc(gpu_present=True, environ={}, device=Device.CPU)
    for check in (no_gpu, cpu):
        assert check.status is Status.PASS and check.data["applicable"] is False
    assert "no GPU" in no_gpu.detail and "--device cpu" in cpu.detail


# ---- 6: side-channel port -----------------------------------------------------------------------------------


def test_port_in_use_fails():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        check = check_side_channel_port("127.0.0.1", port)
    assert_well_formed(check, "side_channel_port")
    assert check.status is Status.FAIL
    assert errno.errorcode[errno.EADDRINUSE] in check.data["error"] and str(port) in check.fix


def test_free_port_and_engine_default_pass():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    free = check_side_channel_port("127.0.0.1", port)
    assert free.status is Status.PASS and free.data["port"] == port
    default = check_side_channel_port()
    assert default.status is Status.PASS and default.data["bound_port"] > 0


def test_unresolvable_host_fails():
    check = check_side_channel_port("no-such-host.invalid", 5555)
    assert check.status is Status.FAIL and check.fix


# ---- 7: progress thread -------------------------------------------------------------------------------------


def test_progress_thread_check_measures(api_module):
    check = check_progress_thread(api_module, sample_s=0.2, num_cores=2)
    assert_well_formed(check, "progress_thread")
    assert check.data["nixl_default_cores"] >= 0 and check.data["usable_cores"] == 2
    assert isinstance(check.data["engine_policy"], dict)


def test_progress_thread_verdicts():
    spinning_small = judge_progress_thread(0.98, 2, {"policy": "off", "progress_delay_us": 100, "cores": 0.0})
    assert spinning_small.status is Status.WARN and "progress='off'" in spinning_small.fix
    assert judge_progress_thread(0.98, 64).status is Status.PASS
    assert judge_progress_thread(0.01, 2).status is Status.PASS


# ---- report and options -------------------------------------------------------------------------------------


def test_report_ok_means_no_failure():
    passing = CheckResult(name="a", status=Status.PASS, detail="fine")
    warning = not_run("b", "because")
    failing = CheckResult(name="c", status=Status.FAIL, detail="bad", fix="do this")
    assert DoctorReport(checks=(passing, warning)).ok
    report = DoctorReport(checks=(passing, failing))
    assert not report.ok
    doc = report.to_builtins()
    assert doc["ok"] is False and [c["status"] for c in doc["checks"]] == ["pass", "fail"]


@pytest.mark.parametrize("bad", [{"num_bytes": 1000}, {"num_bytes": 4100}, {"port": 70000}, {"repeats": 0}])
def test_options_reject_bad_values(bad):
    with pytest.raises(ConfigError):
        DoctorOptions(**bad).validate()


def test_the_mapped_path_check_names_the_kinds_and_wants_a_secret(monkeypatch):
    from hybrid_transfer.doctor.mapped import check_mapped_path
    from hybrid_transfer.engine import auth

    monkeypatch.delenv(auth.SECRET_ENV, raising=False)
    without = check_mapped_path(gpu_present=False)
    assert_well_formed(without, "mapped_path")
    assert without.status is Status.WARN and "no shared secret" in without.detail
    assert without.data["kinds"] == ["shm"] and without.data["round_trip"] == "ok"
    monkeypatch.setenv(auth.SECRET_ENV, "doctor-secret-0123456789abcdef")
    with_secret = check_mapped_path(gpu_present=False)
    assert_well_formed(with_secret, "mapped_path")
    assert with_secret.status is Status.PASS and "shm" in with_secret.detail
