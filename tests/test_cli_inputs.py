"""Bad CLI input exits 2 with a message naming the value, never a traceback (issue 14, row 9).

Run in-process through ``main()``: an exception that escapes fails the test with its own traceback.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybrid_transfer.cli import main

PLAN = ["plan", "--preset", "qwen3.5-0.8b", "--prefill-tp", "1", "--decode-tp", "1", "--tokens", "64"]
TINY_CONFIG = {
    "num_hidden_layers": 4, "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "num_key_value_heads": 2, "head_dim": 64, "linear_num_key_heads": 2, "linear_num_value_heads": 2,
    "linear_key_head_dim": 32, "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4, "dtype": "bfloat16",
}


def _run(capsys, argv: list[str]) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own errors exit 2 with a usage line
        code = exc.code
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


def _plan_with(**changes: str) -> list[str]:
    argv = list(PLAN)
    for flag, value in changes.items():
        flag = "--" + flag.replace("_", "-")
        argv[argv.index(flag) + 1] = value
    return argv


# ---- --config -----------------------------------------------------------------------------------------


def _config_cases(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    non_utf8 = tmp_path / "latin1.json"
    non_utf8.write_bytes(b'{"name": "caf\xe9"}')
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    return {"directory": (tmp_path, "not a file"), "non-utf8": (non_utf8, "UTF-8"), "deep": (deep, "nested")}


@pytest.mark.parametrize("case", ["directory", "non-utf8", "deep"])
@pytest.mark.parametrize("command", ["plan", "layout"])
def test_a_bad_config_file_exits_2_naming_the_path(capsys, tmp_path, case, command):
    path, why = _config_cases(tmp_path)[case]
    argv = (["plan", "--config", str(path), "--prefill-tp", "1", "--decode-tp", "1", "--tokens", "8"]
            if command == "plan" else ["layout", "--config", str(path), "--tp", "1"])
    code, err = _run(capsys, argv)
    assert code == 2 and str(path) in err and why in err


# ---- ranges -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("changes", "shown"), [
    ({"prefill_tp": "0"}, "--prefill-tp"),
    ({"decode_tp": "0"}, "--decode-tp"),
    ({"decode_tp": "-2"}, "-2"),
    ({"tokens": "-1"}, "-1"),
    ({"tokens": "1.5"}, "1.5"),
])
def test_plan_ranges_exit_2_naming_the_value(capsys, changes, shown):
    code, err = _run(capsys, _plan_with(**changes))
    assert code == 2 and shown in err


@pytest.mark.parametrize("command", ["plan", "bench"])
def test_a_negative_seed_exits_2(capsys, monkeypatch, command):
    _no_bench(monkeypatch)
    code, err = _run(capsys, (PLAN if command == "plan" else ["bench"]) + ["--seed", "-1"])
    assert code == 2 and "-1" in err and "seed" in err


@pytest.mark.parametrize("tokens", ["1e10", "10000000000", "262145"])
def test_plan_tokens_are_capped_at_the_model_context(capsys, tokens):
    code, err = _run(capsys, _plan_with(tokens=tokens))
    assert code == 2 and "262144" in err and "tokens" in err


def test_tokens_in_scientific_notation_within_the_context_are_planned(capsys):
    assert main(_plan_with(tokens="1e3") + ["--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["num_tokens"] == 1000


def test_a_config_context_caps_tokens_and_a_config_without_one_has_a_default_cap(capsys, tmp_path):
    own = tmp_path / "own.json"
    own.write_text(json.dumps(TINY_CONFIG | {"max_position_embeddings": 1000}))
    base = ["plan", "--config", str(own), "--prefill-tp", "1", "--decode-tp", "1", "--json", "--tokens"]
    assert main(base + ["1000"]) == 0
    capsys.readouterr()
    code, err = _run(capsys, base + ["1001"])
    assert code == 2 and "1001" in err and "1000" in err
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps(TINY_CONFIG))
    code, err = _run(capsys, ["plan", "--config", str(bare), "--prefill-tp", "1", "--decode-tp", "1",
                              "--tokens", "10000000000"])
    assert code == 2 and "10000000000" in err


def test_bench_tokens_are_capped_too(capsys, monkeypatch):
    _no_bench(monkeypatch)
    code, err = _run(capsys, ["bench", "--tokens", "10000000000"])
    assert code == 2 and "10000000000" in err


# ---- output paths of bench, checked before it runs ---------------------------------------------------------


def _no_bench(monkeypatch) -> None:
    """Any bench that gets as far as starting its rank processes fails the test."""
    from hybrid_transfer.bench import coordinator

    def refuse(self, *args, **kwargs):
        raise AssertionError("the bench started before its arguments were checked")

    monkeypatch.setattr(coordinator.Coordinator, "__init__", refuse)


@pytest.mark.parametrize("flag", ["--json", "--plot"])
@pytest.mark.parametrize("where", ["missing-dir", "parent-is-file", "is-dir"])
def test_an_unwritable_output_path_exits_2_before_the_bench_runs(capsys, monkeypatch, tmp_path, flag, where):
    _no_bench(monkeypatch)
    a_file = tmp_path / "file"
    a_file.write_text("x")
    path = {"missing-dir": tmp_path / "nowhere" / "out", "parent-is-file": a_file / "out",
            "is-dir": tmp_path}[where]
    code, err = _run(capsys, ["bench", flag, str(path)])
    assert code == 2 and str(path) in err and flag in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # nothing created


def test_a_writable_output_path_is_left_as_it_was(capsys, monkeypatch, tmp_path):
    from hybrid_transfer.cli.common import check_output_path

    fresh, existing = tmp_path / "fresh.json", tmp_path / "existing.json"
    existing.write_text("keep")
    check_output_path(fresh, "--json")
    check_output_path(existing, "--json")
    assert not fresh.exists() and existing.read_text() == "keep"
