"""`hybrid-transfer soak` refuses bad arguments with exit 2 and a message, before any process starts."""

from __future__ import annotations

import pytest

from hybrid_transfer.cli import main


@pytest.mark.parametrize("argv, needle", [
    (["--requests", "0"], "--requests: '0' must be at least 1"),
    (["--abort-rate", "0.5"], "--abort-rate: '0.5' must be in [0, 0.3]"),
    (["--batch", "x"], "--batch: 'x' is not an integer"),
])
def test_argparse_errors_exit_2(capsys, argv, needle):
    with pytest.raises(SystemExit) as exc:
        main(["soak", *argv])
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize("argv, needle", [
    (["--num-blocks", "10"], "num_blocks=10 must be at least 4800"),
    (["--json", "/nonexistent-dir/x.json"], "--json '/nonexistent-dir/x.json' cannot be written: '/nonexistent-dir' is not a directory"),
    (["--seed", "-1"], "--seed -1 must be non-negative"),
    (["--model", "no-such-model"], "no-such-model"),
    (["--lease", "0.1"], "heartbeat_s=0.5 must be positive and shorter than the lease"),
])
def test_bad_values_exit_2_before_anything_runs(capsys, argv, needle):
    assert main(["soak", *argv]) == 2
    assert needle in capsys.readouterr().err


def test_help_explains_the_checks(capsys):
    with pytest.raises(SystemExit):
        main(["soak", "--help"])
    out = capsys.readouterr().out
    for phrase in ("SIGKILL", "exactly once", "handles leaked", "docs/soak.md"):
        assert phrase in " ".join(out.split()), phrase
