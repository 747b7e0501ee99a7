"""`hybrid-transfer bench --peer vllm-nixl` (cli/peer_run.py) where vLLM is missing or an option does not apply:
one error line, exit 2, before any process starts. The run itself is tests/vllm/test_vllm_nixl_peer.py."""

from __future__ import annotations

import pytest

from hybrid_transfer.cli import main, peer_run


def test_without_vllm_one_line_names_the_vllm_environment_command(monkeypatch, capsys):
    monkeypatch.setattr(peer_run, "vllm_importable", lambda: False)
    assert main(["bench", "--peer", "vllm-nixl"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "needs vLLM 0.33" in err[0] and "scripts/vllm_env.sh" in err[0] and "--peer vllm-nixl" in err[0]


@pytest.mark.parametrize(("flag", "value"), [("--decode-tp", "2"), ("--device", "cuda"), ("--allocation", "vllm-pool"),
                                             ("--mode", "pack")])
def test_options_the_peer_run_cannot_honour_are_named(monkeypatch, capsys, flag, value):
    monkeypatch.setattr(peer_run, "vllm_importable", lambda: True)  # refused before vLLM would be imported
    assert main(["bench", "--peer", "vllm-nixl", flag, value]) == 2
    err = capsys.readouterr().err
    assert f"does not take: {flag} (" in err


def test_an_unknown_peer_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--peer", "vllm"])
    assert exc.value.code == 2
    assert "--peer" in capsys.readouterr().err
