"""MTP speculative decoding on the decode engine (``qwen3_next_mtp``, one speculative token), in real engines
(docs/vllm.md#speculative-decoding).

Both engines of ``PrefixSuite``'s MTP pair run the model with an MTP module: the cache then holds the MTP
layer's attention KV beside the model's (vLLM names it ``mtp.layers.0``: our cached layer 4, never model
layer 0), the GDN groups are regrouped around it (one padded), and every conv state is one slot wider.
A load must land where vLLM's kernels read it: the state after N-1 tokens in the request's first state
block, conv columns [0, K-1).

The criterion is the first step (``parity.first_step_agrees``): it comes from one forward over the loaded KV
and state, and its token must be the same-split reference's (the model without MTP) with the logprobs of
the top tokens both list within the tolerance (runners-up that tie may swap ranks). Later tokens are not
compared bit for bit: a loaded request's first step verifies token N and a placeholder draft in one
forward, where the reference computes token N alone, so the numerics differ by bf16 roundings (recorded in
mtp.json; docs/vllm.md#batch-variance). The control, a load whose state is left zero, must fail the
criterion: the same first token is possible by chance on a tiny model, its logprobs within the tolerance
are not. A decode engine with MTP cannot read from a prefill engine without it.
"""

from __future__ import annotations

import json

import parity
from conftest import mtp_control_prompt

NAMES = ("n-1=1", "issue 30", "a block's last token", "two blocks, inside", "three blocks, inside")


def _rows(prefix_suite, split_reference, prompts):
    ours = parity.disaggregated(prefix_suite.mtp_prefill, prefix_suite.mtp_decode, prompts)
    return [{"n_minus_1": len(p) - 1, "ours": o.tokens, "same_split": split_reference[tuple(p)].tokens,
             "first_token_equal": o.tokens[:1] == split_reference[tuple(p)].tokens[:1],
             "first_step_agrees": parity.first_step_agrees(o, split_reference[tuple(p)]),
             "tokens_equal": o.tokens == split_reference[tuple(p)].tokens,
             "first_step_logprob_diff": parity.largest_logprob_difference(o, split_reference[tuple(p)], 1),
             "first_step_shared_diff": parity.shared_logprob_difference(o, split_reference[tuple(p)])}
            for p, o in zip(prompts, ours, strict=True)]


# split_reference before prefix_suite in each signature: pytest sets fixtures up in that order, and the reference
# needs the first engine set, which prefix_suite closes (so this file also runs alone).
def test_every_request_loaded_into_an_mtp_decode_engine_decodes_the_reference_first_token(split_reference,
                                                                                           prefix_suite):
    prompts = [p for name, p in parity.prompt_set(prefix_suite.block_size).items() if name in NAMES]
    rows = _rows(prefix_suite, split_reference, prompts)
    (prefix_suite.prefill.log_path.parent / "mtp.json").write_text(json.dumps(rows, indent=1))
    print("\nMTP decode:", *(f"N-1={r['n_minus_1']} first token equal={r['first_token_equal']} all tokens equal="
                             f"{r['tokens_equal']} d1={r['first_step_logprob_diff']:.3g} "
                             f"shared d1={r['first_step_shared_diff']:.3g} ours={r['ours']} "
                             f"split={r['same_split']}" for r in rows), sep="\n  ")
    wrong = [r for r in rows if not r["first_step_agrees"]]
    assert not wrong, json.dumps(wrong, indent=1)
    assert prefix_suite.mtp_decode.metric("vllm:hybrid_transfer_reads_total") >= len(prompts)


def test_an_mtp_load_with_its_state_left_zero_fails_the_criterion(split_reference, prefix_suite):
    [row] = _rows(prefix_suite, split_reference, [mtp_control_prompt(prefix_suite.block_size)])
    assert not row["first_step_agrees"], json.dumps(row, indent=1)


def test_a_decode_engine_with_mtp_refuses_a_prefill_engine_without_it(prefix_suite):
    """The MTP cache has one GDN group fewer (its groups are rebuilt around the MTP layer): the ticket is
    refused before any connect, naming both counts; a handshake would name draft_layers and speculative_slots
    (tests/layout/test_draft_layers.py)."""
    pc = prefix_suite
    prompt = parity.prompt_set(pc.block_size)["issue 17"]
    [params] = parity.hand_off(pc.prefill, [prompt])  # no MTP there
    status, out = pc.mtp_decode.post("/v1/completions", parity.engines.completion_body(prompt, kv_transfer_params=params))
    assert status != 200, out
    assert "a ticket for 4 cache groups, this engine has 3" in pc.mtp_decode.log_path.read_text(errors="replace")
