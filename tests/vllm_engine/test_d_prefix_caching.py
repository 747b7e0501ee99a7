"""Prefix caching on both sides, in real engines left at vLLM's defaults (docs/vllm.md#prefix-caching).

One conversation runs turn by turn (one request at a time) through the prefill and decode engines of
``PrefixSuite`` and, the same turns in the same order, through the aggregated reference with prefix
caching on, whose chunks end where the prefill engine's do (split_scheduler.AlignedSplitScheduler). Every
turn must decode exactly as the reference (greedy tokens and top-5 logprobs bit-equal), and every load
must move exactly the attention bytes past the decode engine's local hit plus the state:

- turn 1 (N-1 = B, one whole block): nothing cached anywhere; decode loads everything, and the state it
  loads at N-1 = B fills its block, which vLLM then caches;
- turn 2 extends turn 1 (N-1 = B + B/2 + 9, inside a block): decode hits B and reads only past it (prefill
  has no hit: a prompt whose N-1 ends on a block boundary leaves no cached state there in align mode);
- turn 1 again: a full hit on decode (every token to load is cached, the state at N-1 too): nothing moves
  and the producer is told at once;
- turn 3 extends turn 2 after prefill and reference dropped their prefix caches: decode's hit (B) is
  longer than prefill's (0); its prefill chunks end at B, where vLLM caches the state;
- turn 4 extends turn 3: prefill hits B too and computes only the rest; the ticket still covers all N-1
  tokens, and decode reads past its own hit;
- controls: a read that ignores the hit moves the whole prompt (the byte count shows it), a state from
  the hit's position instead of N-1 fails parity;
- a decode engine with blocks twice as large, prefix caching on.
"""

from __future__ import annotations

import json
import random
import time

import parity
import pytest
from conftest import PC_FAULT_EXTRA

READS = "vllm:hybrid_transfer_reads_total"
READ_BYTES = "vllm:hybrid_transfer_read_bytes_total"
READ_BLOCKS = "vllm:hybrid_transfer_read_blocks_total"
HIT_READS = "vllm:hybrid_transfer_hit_reads_total"
HIT_TOKENS = "vllm:hybrid_transfer_hit_tokens_total"
HIT_BLOCKS = "vllm:hybrid_transfer_hit_blocks_total"
HIT_BYTES = "vllm:hybrid_transfer_hit_bytes_total"
PREFIX_HITS = "vllm:prefix_cache_hits_total"  # vLLM's own: tokens served from the local prefix cache
SERIES = (READS, READ_BYTES, READ_BLOCKS, HIT_READS, HIT_TOKENS, HIT_BLOCKS, HIT_BYTES, PREFIX_HITS)
HELD = "vllm:hybrid_transfer_held_blocks"


def _rand(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 999) for _ in range(n)]


def _figures(engine) -> dict[str, float]:
    text = engine.metrics()
    return {name: parity.engines.metric_value(text, name) for name in SERIES}


def _wait_held_zero(engine, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while engine.metric(HELD) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert engine.metric(HELD) == 0, f"{engine.name} still holds blocks"


def _reset_prefix_cache(*servers) -> None:
    for server in servers:
        status, out = server.post("/reset_prefix_cache", {})
        assert status == 200 and out.get("success", True) is not False, (server.name, status, out)


class Turns:
    """The conversation, run once for the module: per turn the outcomes and each engine's figure deltas."""

    def __init__(self, pc):
        self.pc = pc
        b = self.block = pc.block_size
        rng = random.Random(27)
        t1 = _rand(rng, b + 1)
        t2 = t1 + _rand(rng, b // 2 + 9)
        t3 = t2 + _rand(rng, 40)
        t4 = t3 + _rand(rng, 30)
        controls = {name: t1 + _rand(rng, b // 2 + extra) for name, extra in PC_FAULT_EXTRA.items()}
        self.rows: dict[str, dict] = {}
        self.turn("turn 1", t1)
        self.turn("turn 2", t2)
        self.turn("full hit", t1)
        _wait_held_zero(pc.prefill)
        _reset_prefix_cache(pc.prefill, pc.reference)
        self.turn("turn 3, prefill cache dropped", t3)
        self.turn("turn 4, hits on both sides", t4)
        for name, prompt in controls.items():
            self.turn(name, prompt)

    def turn(self, name: str, prompt: list[int]) -> None:
        pc = self.pc
        before = {e.name: _figures(e) for e in (pc.prefill, pc.decode)}
        [ours] = parity.disaggregated(pc.prefill, pc.decode, [prompt])
        [reference] = parity.aggregated(pc.reference, [prompt])
        delta = {e.name: {k: v - before[e.name][k] for k, v in _figures(e).items()} for e in (pc.prefill, pc.decode)}
        self.rows[name] = {"prompt": name, "n_minus_1": len(prompt) - 1, "ours": ours.tokens,
                           "reference": reference.tokens, "equal": parity.equal(ours, reference),
                           "first_step_logprob_diff": parity.largest_logprob_difference(ours, reference, 1),
                           "prefill": delta[pc.prefill.name], "decode": delta[pc.decode.name]}


@pytest.fixture(scope="module")
def turns(prefix_suite) -> Turns:
    t = Turns(prefix_suite)
    (prefix_suite.prefill.log_path.parent / "prefix_caching.json").write_text(json.dumps(t.rows, indent=1))
    print(f"\nprefix caching (block size {t.block}):")
    for row in t.rows.values():
        d = row["decode"]
        print(f"  {row['prompt']:>30} N-1={row['n_minus_1']:>4} equal={row['equal']} ours={row['ours'][:4]} "
              f"ref={row['reference'][:4]} decode hit={d[HIT_TOKENS]:.0f} read={d[READ_BYTES]:.0f} B "
              f"saved={d[HIT_BYTES]:.0f} B prefill hit={row['prefill'][PREFIX_HITS]:.0f}")
    return t


def _per_token(row_with_hit: dict, row_whole: dict, tokens: int) -> float:
    return (row_whole["decode"][READ_BYTES] - row_with_hit["decode"][READ_BYTES]) / tokens


@pytest.mark.parametrize("name", ["turn 1", "turn 2", "full hit", "turn 3, prefill cache dropped",
                                  "turn 4, hits on both sides"])
def test_every_turn_decodes_exactly_as_the_aggregated_engine_with_prefix_caching(turns, name):
    row = turns.rows[name]
    assert row["equal"], json.dumps(row, indent=1)


def _moved(turns, name: str, first_token: int) -> int:
    """Bytes a read of turn ``name`` from ``first_token`` moves: whole kernel pages of CPU attention up to the
    one holding N-1 (docs/attention-layouts.md#page-interiors), and the state (turn 1's figures)."""
    one = turns.rows["turn 1"]["decode"]
    per_token = turns.rows["turn 2"]["decode"][HIT_BYTES] / turns.block
    state = one[READ_BYTES] - turns.block * per_token
    kernel = turns.pc.kernel_block_size
    end = -(-turns.rows[name]["n_minus_1"] // kernel) * kernel
    return int((end - first_token) * per_token + state)


def test_turn_2_hits_one_block_on_decode_and_reads_only_past_it(turns):
    b = turns.block
    one, two = turns.rows["turn 1"], turns.rows["turn 2"]
    assert one["decode"][READS] == 1 and one["decode"][HIT_READS] == 0
    assert two["decode"][READS] == 1 and two["decode"][HIT_READS] == 1
    assert two["decode"][HIT_TOKENS] == b and two["decode"][HIT_BLOCKS] == 1 and two["decode"][PREFIX_HITS] == b
    # Blocks written: turn 1 its one block, turn 2 only its second (the first is the hit).
    assert one["decode"][READ_BLOCKS] == 1 and two["decode"][READ_BLOCKS] == -(-two["n_minus_1"] // b) - 1
    # The model's K|V bytes per token of the one attention layer: 2 halves x KV heads x head_dim x bf16.
    cfg = turns.pc.model_config
    assert two["decode"][HIT_BYTES] == b * 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 2
    assert one["decode"][READ_BYTES] == _moved(turns, "turn 1", 0)
    assert two["decode"][READ_BYTES] == _moved(turns, "turn 2", b)  # the tokens past the hit, and the state
    assert two["decode"][READ_BYTES] < _moved(turns, "turn 2", 0)


def test_turn_4_hits_on_both_sides_the_ticket_covering_the_whole_prompt(turns):
    b, row = turns.block, turns.rows["turn 4, hits on both sides"]
    assert row["prefill"][PREFIX_HITS] == b  # prefill computed only past its own hit
    assert row["decode"][HIT_TOKENS] == b and row["decode"][READ_BYTES] == _moved(turns, row["prompt"], b)


def test_a_full_hit_moves_nothing_and_frees_the_producer_at_once(turns, prefix_suite):
    row = turns.rows["full hit"]
    assert row["decode"][READS] == 0 and row["decode"][READ_BYTES] == 0
    assert row["decode"][PREFIX_HITS] == turns.block  # vLLM served all N-1 tokens and the state locally
    _wait_held_zero(prefix_suite.prefill, timeout_s=10.0)


def test_a_decode_hit_longer_than_prefills_reads_from_the_prefills_fresh_blocks(turns):
    row = turns.rows["turn 3, prefill cache dropped"]
    assert row["prefill"][PREFIX_HITS] == 0 and row["decode"][HIT_TOKENS] == turns.block
    assert row["decode"][READS] == 1


def test_a_read_that_ignores_the_hit_shows_in_the_byte_count(turns):
    whole, b = turns.rows["whole_prompt"], turns.block
    assert whole["decode"][HIT_READS] == 0 and whole["decode"][PREFIX_HITS] == b  # vLLM had the hit; we ignored it
    assert whole["decode"][READ_BYTES] == _moved(turns, "whole_prompt", 0) != _moved(turns, "whole_prompt", b)
    assert whole["equal"]  # the same bytes over the hit: only the count tells


def test_a_state_from_the_hits_position_fails_parity(turns):
    row = turns.rows["hit_state"]
    assert row["decode"][HIT_TOKENS] == turns.block
    assert not row["equal"], json.dumps(row, indent=1)


def test_a_decode_engine_of_other_kernel_pages_is_refused_by_name_and_keeps_serving(prefix_suite, turns):
    """Blocks twice as large give vLLM's CPU attention kernel pages twice as large, whose interior is not
    token-addressable: the read is refused naming both page sizes, the request fails (policy fail), the
    engine serves the next request. (Token-major backends re-block: tests/vllm/test_prefix_blocks.py.)"""
    pc, b = prefix_suite, prefix_suite.block_size
    prompt = random.Random(7).choices(range(1, 999), k=b + 50)
    [params] = parity.hand_off(pc.prefill, [prompt])
    status, out = pc.wide.post("/v1/completions", parity.engines.completion_body(prompt, kv_transfer_params=params))
    assert status != 200, out
    log = pc.wide.log_path.read_text(errors="replace")
    assert f"kernel block sizes {b} (prefill) and {2 * b} (decode) differ" in log
    plain = parity.outcome(pc.wide.complete(prompt[:40], max_tokens=4))
    assert plain.finish_reason == "length" and len(plain.tokens) == 4
    _wait_held_zero(pc.prefill, timeout_s=60.0)  # the hold ends at its lease (conftest.SPARE_EXTRA)
