"""`hybrid-transfer plan`: the table and the --json list (stdout holds only JSON)."""

from __future__ import annotations

import json

from hybrid_transfer.cli import main

P2_D8 = ["plan", "--preset", "qwen3.5-397b-a17b", "--prefill-tp", "2", "--decode-tp", "8", "--tokens", "8192",
         "--fragmentation", "1.0", "--json"]


def test_json_lists_every_decode_rank(capsys):
    code = main(P2_D8 + ["--kv-layout", "split"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert [d["decode_rank"] for d in out] == list(range(8))
    for d in out:
        assert d["total_bytes"] == d["expected_bytes"] == d["valid_bytes"] == 149_836_800
        assert d["descriptors"] == 750
        assert d["sources"] == [{"rank": d["decode_rank"] // 4, "bytes": 149_836_800, "descriptors": 750,
                                 "pieces": 750, "mode": "coalesced"}]
        assert (d["mode"], d["kv_layout"]) == ("coalesced", "split")
        assert d["notify"] == [{"rank": d["decode_rank"] // 4, "expected_consumers": 4}]


def test_interleaved_default_needs_at_most_six_tenths_of_split_descriptors(capsys):
    """Issue 11's bar: same 149,836,800 bytes, <= 0.6 x 750 descriptors (KV pieces halve; state is unchanged)."""
    assert main(P2_D8) == 0
    out = json.loads(capsys.readouterr().out)
    for d in out:
        assert d["kv_layout"] == "interleaved"
        assert d["total_bytes"] == d["valid_bytes"] == 149_836_800
        assert d["descriptors"] <= 0.6 * 750


def test_naive_json_reports_whole_pages_and_the_valid_payload(capsys):
    assert main(["plan", "--preset", "qwen3.5-0.8b", "--prefill-tp", "1", "--decode-tp", "1", "--tokens", "2047",
                 "--mode", "naive", "--json"]) == 0
    (d,) = json.loads(capsys.readouterr().out)
    assert d["descriptors"] == 96  # vLLM 0.33: R * K_fa + G_gdn * R * 4 = 6*4 + 3*6*4
    assert d["valid_bytes"] < d["total_bytes"] == d["expected_bytes"]
    assert d["total_bytes"] - d["valid_bytes"] == (4 * 544 - 2047) * 6 * 2048  # page tails of 6 FA layers


def test_one_decode_rank_in_pack_mode(capsys):
    assert main(["plan", "--preset", "qwen3.5-397b-a17b", "--prefill-tp", "8", "--decode-tp", "2",
                 "--decode-rank", "1", "--tokens", "100", "--mode", "pack", "--json"]) == 0
    (d,) = json.loads(capsys.readouterr().out)
    assert d["decode_rank"] == 1 and d["descriptors"] == 4
    assert [s["rank"] for s in d["sources"]] == [4, 5, 6, 7]
    assert all(s["descriptors"] == 1 and s["pieces"] > 1 for s in d["sources"])
    # The READ ranges the engine posts: offsets into each source's staging, as many as the descriptors.
    for s in d["sources"]:
        assert len(s["read_ranges"]) == s["descriptors"]
        assert sum(n for _, n in s["read_ranges"]) == s["bytes"] <= s["staged_bytes"]


def test_table_names_sources_and_totals(capsys):
    assert main(["plan", "--preset", "qwen3.5-0.8b", "--prefill-tp", "1", "--decode-tp", "2", "--tokens", "50",
                 "--mode", "naive"]) == 0
    out = capsys.readouterr().out
    assert "prefill TP 1 -> decode TP 2" in out and "total" in out and "0:2" in out


def test_block_size_flags_and_errors_exit_non_zero(capsys):
    assert main(["plan", "--preset", "qwen3.5-0.8b", "--prefill-tp", "1", "--decode-tp", "1", "--tokens", "50",
                 "--decode-block-size", "1024", "--decode-kernel-block-size", "16", "--json"]) == 0
    capsys.readouterr()
    assert main(["plan", "--preset", "qwen3.5-0.8b", "--prefill-tp", "3", "--decode-tp", "2", "--tokens", "5"]) == 2
    assert "error" in capsys.readouterr().err


def test_bad_decode_rank_and_fragmentation_exit_non_zero(capsys):
    base = ["plan", "--preset", "qwen3.5-0.8b", "--prefill-tp", "1", "--decode-tp", "2", "--tokens", "5"]
    assert main(base + ["--decode-rank", "2"]) == 2
    assert "decode-rank" in capsys.readouterr().err
    assert main(base + ["--fragmentation", "1.5"]) == 2
    assert "fragmentation" in capsys.readouterr().err
