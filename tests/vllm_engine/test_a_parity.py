"""P/D parity in real engines, and the negative controls that must fail it (docs/vllm.md#real-engines).

Every prompt is prefilled by the prefill engine (concurrently: several prompts a prefill step),
loaded by the decode engine through our connector (concurrently: several loads a decode step) and
must decode exactly what the reference decodes. Each negative control is a load corrupted on purpose
by a test subclass of the connector; it finishes normally and must fail the criterion.
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
    ours = parity.disaggregated(suite.prefill, suite.decode, ids)
    reference = [split_reference[tuple(p)] for p in ids]
    whole = parity.aggregated(suite.prefill, ids)  # a plain request on the prefill engine: the whole prompt at once
    rows = []
    for name, prompt, o, r, w in zip(names, ids, ours, reference, whole, strict=True):
        rows.append({"prompt": name, "n_minus_1": len(prompt) - 1, "ours": o.tokens, "same_split": r.tokens,
                     "whole_prompt": w.tokens, "equal": parity.equal(o, r),
                     "first_step_logprob_diff": parity.largest_logprob_difference(o, r, 1),
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
