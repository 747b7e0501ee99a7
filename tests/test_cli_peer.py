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


@pytest.mark.parametrize(("flag", "value"), [("--decode-tp", "2"), ("--prefill-tp", "2"), ("--allocation", "vllm-pool"),
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


def test_bench_options_map_onto_the_peer_run(monkeypatch, capsys):
    import hybrid_transfer.integrations.vllm_peer as peer

    seen = []
    monkeypatch.setattr(peer_run, "vllm_importable", lambda: True)
    monkeypatch.setattr(peer, "run_side_by_side", lambda spec: seen.append(spec) or [])
    assert main(["bench", "--peer", "vllm-nixl", "--preset", "qwen3.5-0.8b", "--tokens", "600", "--concurrency", "4",
                 "--requests", "10", "--warmup", "5", "--rounds", "2", "--backend-threads", "3", "--seed", "9"]) == 0
    [spec] = seen
    assert (spec.preset, spec.tokens, spec.concurrency, spec.waves, spec.warmup, spec.rounds, spec.num_threads,
            spec.seed) == ("qwen3.5-0.8b", 600, 4, 3, 2, 2, 3, 9)  # 10 requests in waves of 4: 3 waves
    assert "600 tokens, 4 requests per wave, 3 timed waves (+2 warm-up) x 2 round(s)" in capsys.readouterr().out


def test_the_device_reaches_the_peer_run_and_an_unknown_one_is_refused(monkeypatch, capsys):
    import hybrid_transfer.integrations.vllm_peer as peer
    from hybrid_transfer.errors import ConfigError
    from hybrid_transfer.integrations.vllm_peer import PeerSpec

    seen = []
    monkeypatch.setattr(peer_run, "vllm_importable", lambda: True)
    monkeypatch.setattr(peer, "run_side_by_side", lambda spec: seen.append(spec) or [])
    assert main(["bench", "--peer", "vllm-nixl", "--device", "cuda", "--concurrency", "2", "--requests", "2"]) == 0
    assert [spec.device for spec in seen] == ["cuda"]
    with pytest.raises(ConfigError, match="device 'tpu'"):
        PeerSpec(device="tpu").validate()
