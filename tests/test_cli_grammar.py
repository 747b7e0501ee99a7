"""One grammar for every subcommand (issue 21 row 4): `--json [PATH]`, global options after the subcommand,
"did you mean", a quiet exit on a closed pipe, and usage errors before any heavy import."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from hybrid_transfer.cli import build_parser, main
from hybrid_transfer.doctor import CheckResult, DoctorReport, Status

PRESET = "qwen3.5-0.8b"
PLAN = ["plan", "--preset", PRESET, "--prefill-tp", "1", "--decode-tp", "2", "--tokens", "1000"]
LAYOUT = ["layout", "--preset", PRESET]
SUBCOMMANDS = ["layout", "plan", "bench", "doctor", "soak"]


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hybrid_transfer", *args], capture_output=True, text=True,
                          timeout=timeout)


# ---- --json [PATH] -----------------------------------------------------------------------------------------


def test_every_subcommand_has_json_with_an_optional_path():
    subs = _subparsers()
    assert sorted(subs) == sorted(SUBCOMMANDS)
    for name, sub in subs.items():
        action = sub._option_string_actions["--json"]
        assert (action.nargs, action.const, action.default) == ("?", "-", None), name


@pytest.mark.parametrize("argv", [PLAN, LAYOUT], ids=["plan", "layout"])
def test_json_alone_puts_only_json_on_stdout_and_the_table_on_stderr(capsys, argv):
    assert main([*argv, "--json"]) == 0
    out, err = capsys.readouterr()
    json.loads(out)  # the whole of stdout is one document
    assert "-----" in err  # the table's rule went to stderr


@pytest.mark.parametrize("argv", [PLAN, LAYOUT], ids=["plan", "layout"])
def test_json_with_a_path_writes_it_and_keeps_the_table_on_stdout(capsys, tmp_path, argv):
    path = tmp_path / "out.json"
    assert main([*argv, "--json", str(path)]) == 0
    out, err = capsys.readouterr()
    assert main([*argv, "--json"]) == 0
    assert json.loads(path.read_text()) == json.loads(capsys.readouterr().out)
    assert "-----" in out and err == ""


@pytest.mark.parametrize("argv", [PLAN, LAYOUT, ["soak"], ["doctor"]], ids=["plan", "layout", "soak", "doctor"])
def test_an_unwritable_json_path_exits_2_naming_it(capsys, tmp_path, argv):
    path = tmp_path / "missing-dir" / "out.json"
    assert main([*argv, "--json", str(path)]) == 2
    assert str(path) in capsys.readouterr().err
    assert not path.parent.exists()


def _fake_doctor(monkeypatch):
    """The CLI's side only: the report the checks would give (test_cli_doctor runs the real checks)."""
    report = DoctorReport(checks=(CheckResult(name="nixl", status=Status.PASS, detail="nixl 1.5.1"),))
    monkeypatch.setattr("hybrid_transfer.cli.doctor_cmd.run_doctor", lambda options, on_check=None: report)
    return report


def test_doctor_json_goes_to_stdout_alone_or_to_a_path(capsys, monkeypatch, tmp_path):
    report = _fake_doctor(monkeypatch)
    assert main(["doctor", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out) == report.to_builtins() and "nixl" in err
    path = tmp_path / "doctor.json"
    assert main(["doctor", "--json", str(path)]) == 0
    out, _ = capsys.readouterr()
    assert json.loads(path.read_text()) == report.to_builtins() and "nixl" in out


# ---- global options, suggestions ---------------------------------------------------------------------------


def test_log_level_is_accepted_after_the_subcommand():
    parser = build_parser()
    assert parser.parse_args([*LAYOUT, "--log-level", "debug"]).log_level == "DEBUG"
    assert parser.parse_args(["--log-level", "info", *LAYOUT]).log_level == "INFO"
    assert parser.parse_args(LAYOUT).log_level == "WARNING"  # the subcommand's copy does not reset it
    proc = _cli(*LAYOUT, "--log-level", "error", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["tp_size"] == 1


@pytest.mark.parametrize(("level", "nixl"), [("debug", "DEBUG"), ("info", "INFO"), ("warning", None)])
def test_log_level_debug_or_info_lets_nixl_log_too(capsys, monkeypatch, level, nixl):
    monkeypatch.delenv("NIXL_LOG_LEVEL", raising=False)
    assert main([*LAYOUT, "--log-level", level]) == 0
    assert os.environ.get("NIXL_LOG_LEVEL") == nixl  # read by NIXL when it is first imported


def test_a_nixl_log_level_in_the_environment_wins(capsys, monkeypatch):
    monkeypatch.setenv("NIXL_LOG_LEVEL", "ERROR")
    assert main([*LAYOUT, "--log-level", "debug"]) == 0
    assert os.environ["NIXL_LOG_LEVEL"] == "ERROR"


def test_a_mistyped_subcommand_gets_a_suggestion(capsys):
    with pytest.raises(SystemExit) as info:
        main(["plna"])
    assert info.value.code == 2
    assert "did you mean 'plan'?" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "needle"), [
    ([*PLAN, "--mode", "coalesed"], "did you mean 'coalesced'?"),
    ([*LAYOUT, "--log-level", "debg"], "did you mean 'DEBUG'?"),
    ([*LAYOUT, "--ranks", "0"], "--ranks is not an option, did you mean '--rank'?"),
    (["plan", "--preset", PRESET, "--prefill-tp", "1", "--decode-tp", "1", "--tokns", "5"],
     "--tokns is not an option, did you mean '--tokens'?"),
])
def test_mistyped_choices_and_options_get_a_suggestion(capsys, argv, needle):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and f"hybrid-transfer {argv[0]}" in err  # the subcommand's usage, not the top level's


# ---- closed pipe -------------------------------------------------------------------------------------------


def test_a_closed_stdout_pipe_ends_quietly():
    proc = subprocess.Popen([sys.executable, "-m", "hybrid_transfer", *PLAN, "--json"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader is gone before the JSON is written, as with `| head` that exited
    _, err = proc.communicate(timeout=120)
    err = err.decode()
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert proc.returncode == 128 + signal.SIGPIPE  # what a shell reports for a program SIGPIPE ended


def test_a_broken_pipe_that_is_not_stdout_still_raises(monkeypatch):
    def handler(args):
        raise BrokenPipeError("a rank process went away")

    parser = build_parser()
    monkeypatch.setattr("hybrid_transfer.cli.build_parser", lambda: parser)
    parser.set_defaults(handler=handler)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            action.choices["layout"].set_defaults(handler=handler)
    with pytest.raises(BrokenPipeError):
        main(LAYOUT)


# ---- usage errors before heavy imports ---------------------------------------------------------------------

_PROBE = textwrap.dedent("""
    import json, sys
    from hybrid_transfer.cli import main
    try:
        code = main(sys.argv[1:])
    except SystemExit as exc:
        code = exc.code
    heavy = sorted(m for m in ("torch", "nixl", "zmq") if m in sys.modules)
    print(json.dumps({"code": code, "heavy": heavy}))
""")


@pytest.mark.parametrize("argv", [
    ["plna"],
    ["bench", "--tokens", "many"],
    ["bench", "--mode", "fast"],
    ["plan", "--preset", PRESET],
    ["layout", "--tp", "two"],
    ["doctor", "--bytes", "12x"],
    ["soak", "--requests", "0"],
], ids=lambda argv: "-".join(argv[:2]))
def test_a_usage_error_imports_no_torch_nixl_or_zmq(argv):
    proc = subprocess.run([sys.executable, "-c", _PROBE, *argv], capture_output=True, text=True, timeout=120)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"code": 2, "heavy": []}, proc.stderr[-2000:]


# ---- the long-running subcommands: JSON on stdout while their processes print ------------------------------


def test_bench_json_on_stdout_is_the_whole_stdout():
    proc = _cli("bench", "--tokens", "64", "--requests", "1", "--warmup", "0", "--rounds", "1", "--json",
                timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)  # rank processes, NIXL and the table all went to stderr
    assert doc["tokens"] == 64 and doc["gbps"] > 0
    assert "ceiling" in proc.stderr


def test_soak_json_on_stdout_is_the_whole_stdout():
    proc = _cli("soak", "--requests", "10", "--batch", "5", "--no-kills", "--json", timeout=300)
    doc = json.loads(proc.stdout)  # progress, the report's table and both processes' output went to stderr
    assert doc["requests"] == 10
    assert proc.returncode == (0 if all(doc["checks"].values()) else 1), proc.stderr[-3000:]
    assert "soak:" in proc.stderr
