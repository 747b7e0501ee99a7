"""P/D parity in real engines, and the negative controls that must fail it (docs/vllm.md#real-engines).

Every prompt is prefilled by the prefill engine (concurrently: several prompts a prefill step) and
loaded by the decode engine through our connector. Loaded one at a time, as the reference decodes, every
request must decode exactly what the reference decodes. Loaded concurrently (several loads a decode step)
they are held to the first-step criterion, because vLLM's CPU kernels round differently in a different
batch with or without a connector (docs/vllm.md#batch-variance); each step's difference is recorded.
Each negative control is a load corrupted on purpose by a test subclass of the connector; it finishes
normally and must fail the criterion.
"""

from __future__ import annotations

import json

import parity
import pytest
from conftest import FAULT_TOKENS


@pytest.fixture(scope="module")
def runs(suite, split_reference):
    prompts = parity.prompt_set(suite.block_size)
    assert not {len(p) - 1 for p in prompts.values()} & set(FAULT_TOKENS.values())
    names, ids = list(prompts), list(prompts.values())
    ours = parity.disaggregated(suite.prefill, suite.decode, ids, workers=1)
    reference = [split_reference[tuple(p)] for p in ids]
    whole = parity.aggregated(suite.prefill, ids)  # a plain request on the prefill engine: the whole prompt at once
    rows = []
    for name, prompt, o, r, w in zip(names, ids, ours, reference, whole, strict=True):
        rows.append({"prompt": name, "n_minus_1": len(prompt) - 1, "ours": o.tokens, "same_split": r.tokens,
                     "whole_prompt": w.tokens, "equal": parity.equal(o, r),
                     "first_step_logprob_diff": parity.largest_logprob_difference(o, r, 1),
                     "logprob_diff_by_step": parity.logprob_difference_by_step(o, r),
                     "whole_vs_split_first_step": parity.largest_logprob_difference(w, r, 1)})
    (suite.root / "parity.json").write_text(json.dumps(rows, indent=1))
    print(f"\nparity (block size {suite.block_size}):")
    for row in rows:
        print(f"  {row['prompt']:>28} N-1={row['n_minus_1']:>4} ours={row['ours']} split={row['same_split']} "
              f"whole={row['whole_prompt']} equal={row['equal']} d1={row['first_step_logprob_diff']:.3g}")
    return rows, dict(zip(names, zip(ids, ours, reference, strict=True), strict=True))


def test_the_prompts_cover_every_place_n_minus_1_can_fall(suite):
    b = suite.block_size
    counts = {len(p) - 1 for p in parity.prompt_set(b).values()}
    assert len(counts) >= 12
    assert {1, 2, b, b + 1, 2 * b} <= counts  # 1 and 2 tokens; a block's last token; a block's first token
    assert any(c % b and c < b for c in counts) and any(c % b and c > 2 * b for c in counts)  # inside blocks


def test_every_disaggregated_request_decodes_exactly_as_the_same_split(runs):
    rows, _ = runs
    wrong = [r for r in rows if not r["equal"]]
    assert not wrong, json.dumps(wrong, indent=1)


def test_concurrent_loads_decode_their_first_token_as_the_same_split(suite, split_reference):
    """Eight loads at a time share decode steps; the first step must agree within the tolerance and the
    later steps' differences are recorded (bf16 roundings of a different batch, docs/vllm.md#batch-variance)."""
    prompts = parity.prompt_set(suite.block_size)
    ids = list(prompts.values())
    ours = parity.disaggregated(suite.prefill, suite.decode, ids, workers=8)
    rows = []
    for name, prompt, o in zip(prompts, ids, ours, strict=True):
        r = split_reference[tuple(prompt)]
        rows.append({"prompt": name, "ours": o.tokens, "same_split": r.tokens,
                     "first_step_agrees": parity.first_step_agrees(o, r),
                     "first_step_shared_diff": parity.shared_logprob_difference(o, r),
                     "logprob_diff_by_step": parity.logprob_difference_by_step(o, r)})
    (suite.root / "parity_concurrent.json").write_text(json.dumps(rows, indent=1))
    print("\nconcurrent loads (8 at a time), largest logprob difference by step:")
    for row in rows:
        print(f"  {row['prompt']:>28} " + " ".join(f"{d:.2g}" for d in row["logprob_diff_by_step"]))
    wrong = [r for r in rows if not r["first_step_agrees"]]
    assert not wrong, json.dumps(wrong, indent=1)


@pytest.mark.parametrize("fault", sorted(FAULT_TOKENS))
def test_a_corrupted_load_finishes_normally_and_fails_parity(suite, fault):
    """The control prompt has several blocks; other_state takes the state of the honest load just before it."""
    n = FAULT_TOKENS[fault]
    prompts = parity.prompt_set(suite.block_size)
    honest = prompts["two blocks, inside"]
    control = (honest * 4)[: n + 1]
    before = parity.disaggregated(suite.prefill, suite.faulty, [honest])[0]
    assert parity.equal(before, parity.aggregated(suite.reference, [honest])[0])  # the engine is right otherwise
    got = parity.disaggregated(suite.prefill, suite.faulty, [control])[0]
    want = parity.aggregated(suite.reference, [control])[0]
    assert got.finish_reason == "length" and len(got.tokens) == parity.MAX_TOKENS
    assert not parity.equal(got, want), f"{fault}: the corrupted load still decoded {got.tokens}"
