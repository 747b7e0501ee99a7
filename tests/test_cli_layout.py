"""`hybrid-transfer layout`: table and JSON figures, in-process and as `python -m hybrid_transfer`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hybrid_transfer.cli import main

BIG = "qwen3.5-397b-a17b"
REQUIRED_KEYS = ("block_size", "page_bytes", "kv_bytes_per_token", "conv_bytes", "ssm_bytes",
                 "state_bytes_per_request", "num_fa_layers", "num_gdn_layers")


def run_module(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hybrid_transfer", *args], capture_output=True, text=True,
                          timeout=120)


def run_json(capsys, *args: str) -> dict:
    assert main(["layout", *args, "--json"]) == 0
    out = capsys.readouterr().out
    return json.loads(out)  # the whole of stdout is one JSON document


# ---- as a subprocess ------------------------------------------------------------------------------

def test_module_json_is_one_document_with_design_numbers():
    proc = run_module("layout", "--preset", BIG, "--tp", "8", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert isinstance(doc, dict)
    for key in REQUIRED_KEYS:
        assert key in doc
    assert (doc["block_size"], doc["page_bytes"], doc["kv_bytes_per_token"]) == (528, 528 * 1024, 1024)
    assert (doc["conv_bytes"], doc["ssm_bytes"]) == (9_216, 524_288)
    assert doc["state_bytes_per_request"] == 24_007_680
    assert (doc["num_fa_layers"], doc["num_gdn_layers"], doc["num_tensors"]) == (15, 45, 15)
    assert [r["tp_rank"] for r in doc["ranks"]] == list(range(8))
    assert [r["kv_heads"] for r in doc["ranks"]] == [[0, 1]] * 4 + [[1, 2]] * 4


def test_module_table_lists_every_rank():
    proc = run_module("layout", "--preset", BIG, "--tp", "2")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert BIG in lines[0] and "60 layers (15 full attention, 45 GDN)" in lines[0]
    rows = [line.split() for line in lines if line.split() and line.split()[0].isdigit()]
    assert [r[0] for r in rows] == ["0", "1"]
    for r in rows:
        assert r[1:] == [r[0], "1,024", "36,864", "2,097,152", "96,030,720", "91.58", "2,096", "2,146,304", "15"]


def test_console_script_is_installed():
    script = Path(sys.executable).parent / "hybrid-transfer"
    proc = subprocess.run([str(script), "layout", "--preset", BIG, "--tp", "4", "--rank", "3", "--json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert (doc["tp_rank"], doc["block_size"], doc["kv_heads"]) == (3, 1056, [1, 2])


def test_module_error_exits_2_naming_value():
    proc = run_module("layout", "--preset", BIG, "--tp", "3", "--json")
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert "tp_size=3" in proc.stderr


# ---- in process -------------------------------------------------------------------------------------

@pytest.mark.parametrize(("tp", "mib", "block"), [(1, 183.16, 2096), (2, 91.58, 2096), (4, 45.79, 1056),
                                                  (8, 22.90, 528)])
def test_json_check_numbers(capsys, tp, mib, block):
    doc = run_json(capsys, "--preset", BIG, "--tp", str(tp))
    assert doc["tp_rank"] == 0
    assert doc["state_bytes_per_request"] == 45 * (73_728 + 4_194_304) // tp
    assert doc["state_mib_per_request"] == mib
    assert doc["block_size"] == block
    assert doc["kv_bytes_per_token_all_layers"] == (30_720 if tp == 1 else 15_360)
    assert len(doc["ranks"]) == tp
    assert all(r["block_size"] == block for r in doc["ranks"])


@pytest.mark.parametrize(("tp", "block"), [(1, 4176), (8, 1056)])
def test_json_fp8(capsys, tp, block):
    doc = run_json(capsys, "--preset", BIG, "--tp", str(tp), "--kv-dtype", "fp8")
    assert (doc["kv_dtype"], doc["block_size"]) == ("fp8_e4m3", block)


# docs/layout.md#draft-layers: Qwen3-Next-80B-A3B with one MTP layer and s = 1, per TP rank.
@pytest.mark.parametrize(("tp", "block", "state"), [(1, 544, 40_108_032), (2, 544, 20_054_016), (4, 272, 10_027_008),
                                                    (8, 144, 5_013_504)])
def test_json_draft_layers_and_speculative_slots(capsys, tp, block, state):
    doc = run_json(capsys, "--preset", "qwen3-next-80b-a3b", "--tp", str(tp), "--draft-layers", "1",
                   "--speculative-slots", "1")
    assert (doc["draft_layers"], doc["speculative_slots"], doc["num_tensors"]) == (1, 1, 13)
    assert (doc["block_size"], doc["state_bytes_per_request"]) == (block, state)
    plain = run_json(capsys, "--preset", "qwen3-next-80b-a3b", "--tp", str(tp))
    assert "draft_layers" not in plain and plain["num_tensors"] == 12


def test_table_names_the_draft_layers(capsys):
    assert main(["layout", "--preset", "qwen3-next-80b-a3b", "--draft-layers", "1", "--speculative-slots", "2"]) == 0
    assert "MTP draft layers 1, speculative slots 2 (conv window" in capsys.readouterr().out


def test_negative_draft_layers_exit_2_naming_the_value(capsys):
    assert main(["layout", "--preset", "qwen3-next-80b-a3b", "--draft-layers", "-1"]) == 2
    assert "draft_layers=-1" in capsys.readouterr().err


def test_json_rank_selects_one(capsys):
    doc = run_json(capsys, "--preset", "qwen3.5-27b", "--tp", "8", "--rank", "5")
    assert (doc["tp_rank"], doc["kv_heads"], doc["kv_heads_replicated"]) == (5, [2, 3], True)
    assert [r["tp_rank"] for r in doc["ranks"]] == [5]


def test_json_kernel_block_and_alignment(capsys):
    doc = run_json(capsys, "--preset", BIG, "--tp", "1", "--kernel-block-size", "16")
    assert (doc["kernel_block_size"], doc["kernel_ratio"]) == (16, 131)
    doc = run_json(capsys, "--preset", BIG, "--tp", "8", "--alignment", "64")
    assert doc["block_size"] == 576  # 64 * ceil(533,504 / (64 * 1,024))


def test_json_kv_layout_default_and_split(capsys):
    doc = run_json(capsys, "--preset", BIG, "--tp", "2")
    assert doc["kv_layout"] == "interleaved" and all(r["kv_layout"] == "interleaved" for r in doc["ranks"])
    split = run_json(capsys, "--preset", BIG, "--tp", "2", "--kv-layout", "split")
    assert split["kv_layout"] == "split"
    # Page and block sizes do not depend on the layout.
    assert (split["block_size"], split["page_bytes"]) == (doc["block_size"], doc["page_bytes"]) == (2096, 2096 * 1024)
    assert main(["layout", "--preset", BIG, "--tp", "2", "--kv-layout", "split"]) == 0
    assert "KV layout split" in capsys.readouterr().out


def test_bad_kv_layout_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        main(["layout", "--preset", BIG, "--tp", "2", "--kv-layout", "HND"])
    assert info.value.code == 2
    assert "--kv-layout" in capsys.readouterr().err


def test_config_file(capsys, tmp_path, tiny_config):
    path = tmp_path / "tiny" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"text_config": tiny_config}))
    doc = run_json(capsys, "--config", str(path), "--tp", "2")
    assert doc["preset"] == "tiny"
    assert (doc["num_fa_layers"], doc["num_gdn_layers"], doc["num_tensors"]) == (2, 6, 2)
    assert (doc["conv_bytes"], doc["ssm_bytes"], doc["block_size"]) == (192, 256, 16)


def test_table_single_rank(capsys):
    assert main(["layout", "--preset", "qwen3.5-0.8b", "--tp", "4", "--rank", "2"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.split() and line.split()[0].isdigit()]
    assert len(rows) == 1
    assert rows[0][:3] == ["2", "1", "(repl.)"]


@pytest.mark.parametrize(("args", "needle"), [
    (["--preset", "qwen9", "--tp", "1"], "unknown preset 'qwen9'"),
    (["--preset", BIG, "--tp", "6"], "tp_size=6"),
    (["--preset", BIG, "--tp", "32"], "linear_num_key_heads=16"),
    (["--preset", BIG, "--tp", "0"], "tp_size=0"),
    (["--preset", BIG, "--tp", "2", "--rank", "2"], "tp_rank=2"),
    (["--preset", BIG, "--tp", "8", "--kernel-block-size", "100"], "kernel_block_size=100"),
    (["--preset", BIG, "--tp", "8", "--alignment", "0"], "alignment=0"),
    (["--config", "/nonexistent/config.json", "--tp", "1"], "/nonexistent/config.json"),
])
def test_errors_exit_2_and_name_value(capsys, args, needle):
    assert main(["layout", *args, "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert needle in captured.err


def test_tp_defaults_to_one(capsys):
    """issue 21 row 4: `layout` had no default --tp (a usage error without it)."""
    assert run_json(capsys, "--preset", BIG) == run_json(capsys, "--preset", BIG, "--tp", "1")
    assert run_json(capsys, "--preset", BIG)["tp_size"] == 1
