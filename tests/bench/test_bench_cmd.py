"""`hybrid-transfer bench` end to end: real rank processes and NIXL agents, bytes verified, JSON checked."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hybrid_transfer.engine.config import EngineConfig
from hybrid_transfer.errors import ConfigError
from hybrid_transfer.layout import RankGeometry, load_preset
from hybrid_transfer.plan.types import PlanMode

TIMEOUT_S = 300


def _bench(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "hybrid_transfer", "bench", *args, "--json", str(out)],
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    return proc, out


def test_p1_d1_verified_run_reports_every_figure(tmp_path):
    # 600 tokens: a full and a partial block of 544; fragmentation 0.5 shuffles half the ids on both sides.
    proc, out = _bench(tmp_path, "--tokens", "600", "--requests", "3", "--concurrency", "2", "--warmup", "1",
                       "--fragmentation", "0.5", "--verify", "--rounds", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert (doc["preset"], doc["prefill_tp"], doc["decode_tp"]) == ("qwen3.5-0.8b", 1, 1)
    assert (doc["tokens"], doc["requests"], doc["device"], doc["mode"]) == (600, 3, "cpu", "coalesced")
    assert doc["kv_layout"] == "interleaved"
    assert doc["verified"] is True
    assert all(v["verified"] for v in doc["variants"].values())
    assert doc["gbps"] > 0 and doc["naive_gbps"] > 0 and doc["ceiling_gbps"] > 0
    geo = RankGeometry(load_preset("qwen3.5-0.8b"), 1, 0)
    # Valid payload for every variant, naive included (it moves whole 544-token pages: 1088 tokens of KV).
    assert doc["payload_bytes_per_request"] == 600 * geo.kv_bytes_per_token * 6 + geo.state_bytes_per_request
    assert doc["naive_descriptors_per_request"] > doc["descriptors_per_request"] > 1
    assert doc["ceiling_descriptors_per_request"] == 1
    assert doc["copy_gbps"] > 0 and doc["copy_descriptors_per_request"] == 1  # the physical-limit row
    assert doc["ceiling_over_copy"] == pytest.approx(doc["ceiling_gbps"] / doc["copy_gbps"], rel=1e-3)
    assert doc["mode_over_naive"] == pytest.approx(doc["gbps"] / doc["naive_gbps"], rel=1e-3)
    assert doc["mode_over_ceiling"] == pytest.approx(doc["gbps"] / doc["ceiling_gbps"], rel=1e-3)
    assert 0 < doc["p50_ms"] <= doc["p99_ms"]
    assert doc["plan_ms"] > 0 and doc["notify_lag_p50_ms"] is not None
    assert len(doc["consumer_cpu_s"]) == 1 and len(doc["producer_cpu_s"]) == 1
    assert "ceiling" in proc.stdout and "coalesced*" in proc.stdout  # the summary table


def test_vllm_pool_allocation_moves_verified_bytes_and_states_its_pool(tmp_path):
    """--allocation vllm-pool: ids from the simulated vLLM pool after a churn (bench/vllm_pool.py), P1 -> D2 so
    the two sides' block sizes differ; every byte verified through real NIXL agents."""
    from hybrid_transfer.bench import vllm_pool

    proc, out = _bench(tmp_path, "--tokens", "600", "--requests", "3", "--concurrency", "2", "--warmup", "1",
                       "--decode-tp", "2", "--allocation", "vllm-pool", "--verify", "--rounds", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["allocation"] == "vllm-pool" and doc["verified"] is True
    assert doc["live_requests"] == vllm_pool.LIVE_PER_TIMED * 3
    model = load_preset("qwen3.5-0.8b")
    want = [vllm_pool.bench_pool_blocks(RankGeometry(model, tp, 0), 600, 3) for tp in (1, 2)]
    assert doc["pool_blocks"] == want
    assert doc["descriptors_per_request"] > 1 and doc["gbps"] > 0
    assert "vllm-pool" in proc.stdout  # the headline names the allocation


def test_fan_out_sweep_with_naive_mode_and_plot(tmp_path):
    plot = tmp_path / "bench.png"
    proc, out = _bench(tmp_path, "--decode-tp", "2", "--mode", "naive", "--tokens", "64", "--requests", "2",
                       "--warmup", "1", "--sweep", "fragmentation", "--sweep-values", "0,1", "--verify",
                       "--plot", str(plot), "--kv-layout", "split", "--rounds", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["kv_layout"] == "split"
    assert doc["sweep"] == "fragmentation" and doc["sweep_values"] == [0.0, 1.0]
    assert doc["verified"] is True and len(doc["points"]) == 2
    for point in doc["points"]:
        assert set(point["variants"]) == {"naive", "ceiling", "copy"}
        assert point["gbps"] == point["naive_gbps"] > 0
        assert point["ceiling_descriptors_per_request"] == 2  # one READ per decode rank
        assert len(point["consumer_cpu_s"]) == 2
    assert plot.read_bytes()[:4] == b"\x89PNG"


def test_pack_mode_runs_or_is_refused_clearly(tmp_path):
    """Pack rows go through staging (gather at hold, one READ, scatter), all of them; an engine without
    pack execution is refused before anything starts."""
    try:
        EngineConfig(mode=PlanMode.PACK).validate()
        engine_runs_pack = True
    except ConfigError:
        engine_runs_pack = False
    proc, out = _bench(tmp_path, "--mode", "pack", "--tokens", "64", "--requests", "2", "--warmup", "0",
                       "--verify", "--rounds", "1")
    if engine_runs_pack:
        assert proc.returncode == 0, proc.stderr[-3000:]
        doc = json.loads(out.read_text())
        assert doc["verified"] is True and doc["mode"] == "pack"
        assert doc["packed_sources"] == 2 and doc["fallback_sources"] == 0  # one source, two requests
        assert doc["gather_ms"] is not None and doc["scatter_ms"] is not None
        assert doc["descriptors_per_request"] == 1 and doc["naive_descriptors_per_request"] > 1
    else:
        assert proc.returncode == 2
        assert "not yet supported by the engine" in proc.stderr
        assert not out.exists()


def test_bad_flags_exit_with_the_field_named(tmp_path):
    proc, _ = _bench(tmp_path, "--prefill-tp", "2", "--decode-tp", "3")
    assert proc.returncode == 2 and "decode_tp" in proc.stderr
    proc, _ = _bench(tmp_path, "--kv-layout", "HND")
    assert proc.returncode == 2 and "--kv-layout" in proc.stderr


def test_token_sweep_reports_each_point_its_time_split_and_plots_it(tmp_path):
    plot = tmp_path / "tokens.png"
    proc, out = _bench(tmp_path, "--sweep", "tokens", "--sweep-values", "64,600", "--requests", "2",
                       "--concurrency", "2", "--warmup", "1", "--rounds", "1", "--verify", "--plot", str(plot),
                       "--wide")
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["sweep"] == "tokens" and doc["sweep_values"] == [64, 600]
    assert [p["tokens"] for p in doc["points"]] == [64, 600] and doc["verified"] is True
    assert doc["points"][1]["payload_bytes_per_request"] > doc["points"][0]["payload_bytes_per_request"]
    for point in doc["points"]:
        for name, v in point["variants"].items():
            assert v["read_ms"] is not None and v["settle_ms"] is not None, name
            assert 0 <= v["read_ms"] <= v["p50_ms"] and v["settle_ms"] >= 0, name
            assert v["post_ms"] <= v["p99_ms"] and v["consumer_cpu_ms_per_request"] >= 0, name
        assert point["ceiling_settle_ms"] == 0.0  # one READ and nothing after it
        assert point["plan_ms"] > 0 and point["producer_cpu_ms_per_request"] >= 0
    assert "time split" in proc.stdout and "read ms" in proc.stdout  # --wide: every column and the split
    assert plot.read_bytes()[:4] == b"\x89PNG"


def test_a_request_count_the_host_cannot_hold_is_refused_before_any_process_starts(tmp_path):
    proc, out = _bench(tmp_path, "--preset", "qwen3.5-397b-a17b", "--tokens", "16384", "--requests", "512",
                       "--verify")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "GiB are available" in proc.stderr and "prefill rank" in proc.stderr and "decode rank" in proc.stderr
    hint = re.search(r"use --requests (\d+)", proc.stderr)  # the count that fits this host, when one does
    assert hint is not None and 1 <= int(hint.group(1)) < 512, proc.stderr
    assert not out.exists()


def test_a_default_cpu_run_takes_three_rounds_of_steps_shows_progress_and_fits_100_columns(tmp_path):
    """Issue 20: 4 requests per step through one start_reads call, verified, hook time with NIXL apart; issue 21
    item 2: 3 rounds by default on CPU, progress lines on a piped stderr, a summary table of at most 100 columns."""
    proc, out = _bench(tmp_path, "--tokens", "600", "--requests", "4", "--concurrency", "4", "--per-step", "4",
                       "--warmup", "1", "--fragmentation", "1", "--verify")
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["rounds"] == 3 and all(len(v["gbps_rounds"]) == 3 for v in doc["variants"].values())
    assert (doc["per_step"], doc["read_batching"], doc["verified"]) == (4, "per_step", True)
    assert doc["requests_per_step"] == 4.0  # every step's requests started in one start_reads call
    assert 0 < doc["hook_nixl_ms"] < doc["hook_ms"]
    assert doc["hook_python_ms"] == pytest.approx(doc["hook_ms"] - doc["hook_nixl_ms"], abs=1e-5)
    assert doc["ceiling_hook_ms"] is None and doc["naive_hook_ms"] is not None
    progress = [line for line in proc.stderr.splitlines() if line.startswith("bench [")]
    assert progress and progress[-1].startswith("bench [") and "planned again" in "".join(progress)
    table = proc.stdout.splitlines()
    assert max(len(line.rstrip()) for line in table) <= 100, max(table, key=len)
    assert "coalesced*" in proc.stdout and "hook" in proc.stdout and "--rounds" not in proc.stdout


def test_per_request_batching_with_one_round_names_rounds(tmp_path):
    """--read-batching per_request reaches the decode ranks' EngineConfig; one round prints a line naming --rounds."""
    proc, out = _bench(tmp_path, "--tokens", "64", "--requests", "2", "--concurrency", "2", "--warmup", "1",
                       "--read-batching", "per_request", "--rounds", "1", "--verify")
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert (doc["read_batching"], doc["per_step"], doc["rounds"], doc["verified"]) == ("per_request", 2, 1, True)
    assert "--rounds 3" in proc.stdout
    wide, _ = _bench(tmp_path, "--per-step", "3", "--concurrency", "2")
    assert wide.returncode == 2 and "per_step" in wide.stderr
