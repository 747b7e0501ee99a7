"""The parity criterion (docs/vllm.md#real-engines): a disaggregated request must decode exactly what the
aggregated engine decodes when it runs the same split, N-1 prompt tokens in one step and token N in the
next (split_scheduler.py), one request at a time. Same kernels on the same inputs: every greedy token and
every top logprob equal, not close, for a load that decodes alone as the reference does. vLLM's CPU
kernels are not batch-invariant (a request's logits move by a bf16 rounding when other requests share its
steps, with no connector at all: docs/vllm.md#batch-variance), so loads that share decode steps are held
to the first-step criterion instead (``first_step_agrees``). A whole-prompt aggregated run is shown
beside it, never used as the reference (the split alone moves near-ties on a tiny random model).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import engines
import numpy as np

MAX_TOKENS = 8

# The first-step criterion's tolerance: four times the largest honest first-step difference measured when the
# reference's step and ours run different batches or query shapes (0.0077, an MTP verify step; loads
# sharing steps: under 1e-6), below every zero-state control measured (0.085). docs/vllm.md#batch-variance.
FIRST_STEP_TOLERANCE = 2.0 ** -5


def prompt_set(block_size: int) -> dict[str, list[int]]:
    """At least 12 prompts named by where their N-1 falls against the attention block size."""
    rng = np.random.default_rng(26)
    b = block_size

    def rand(n: int) -> list[int]:
        return [int(x) for x in rng.integers(1, 1000, n)]

    # name -> prompt; N-1 is len - 1
    return {
        "n-1=1": rand(2), "n-1=2": rand(3), "issue 17": list(range(100, 117)), "issue 30": list(range(10, 40)),
        "inside the first block": rand(b // 2 + 6), "a block's next-to-last token": rand(b),
        "a block's last token": rand(b + 1), "a block's first token": rand(b + 2),
        "two blocks, inside": rand(b + b // 2 + 1), "two blocks, last token": rand(2 * b + 1),
        "three blocks, first token": rand(2 * b + 2), "issue [5]*300": [5] * 300,
        "three blocks, inside": rand(2 * b + 77),
    }


@dataclass
class Outcome:
    tokens: list[int]
    logprobs: list[dict[int, float]]
    finish_reason: str


def outcome(completion: dict) -> Outcome:
    ids, tops = engines.tokens_of(completion)
    return Outcome(ids, tops, completion["choices"][0]["finish_reason"])


def run_all(fn, items: list, workers: int = 8) -> list:
    """``fn`` over ``items`` concurrently (several requests in one engine step), results in order."""
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(fn, items))


def hand_off(prefill: engines.EngineServer, prompts: list[list[int]]) -> list[dict]:
    """Prefill every prompt (concurrently) and return each one's kv_transfer_params for decode."""
    outs = run_all(lambda p: prefill.complete(p, max_tokens=1, kv_transfer_params={"do_remote_decode": True}),
                   prompts)
    return [o["kv_transfer_params"] for o in outs]


def disaggregated(prefill, decode, prompts: list[list[int]], workers: int = 8) -> list[Outcome]:
    """Prefill every prompt concurrently, then load and decode them on ``decode``, ``workers`` at a time
    (1: each load decodes alone, as the one-at-a-time reference does)."""
    params = hand_off(prefill, prompts)
    return run_all(lambda pp: outcome(decode.complete(pp[0], max_tokens=MAX_TOKENS, kv_transfer_params=pp[1])),
                   list(zip(prompts, params, strict=True)), workers)


def aggregated(engine, prompts: list[list[int]], workers: int = 8) -> list[Outcome]:
    return run_all(lambda p: outcome(engine.complete(p, max_tokens=MAX_TOKENS)), prompts, workers)


def largest_logprob_difference(a: Outcome, b: Outcome, steps: int | None = None) -> float:
    """Largest |difference| over the top logprobs both outcomes list, over the first ``steps`` steps."""
    worst = 0.0
    for x, y in list(zip(a.logprobs, b.logprobs, strict=False))[:steps]:
        for token in x.keys() & y.keys():
            worst = max(worst, abs(x[token] - y[token]))
        if x.keys() != y.keys():
            return float("inf")
    return worst


def logprob_difference_by_step(a: Outcome, b: Outcome) -> list[float]:
    """Largest |difference| of the top logprobs at each step (inf where the top tokens differ): where a
    mismatch starts and how large it is."""
    return [largest_logprob_difference(Outcome([], [x], ""), Outcome([], [y], ""))
            for x, y in zip(a.logprobs, b.logprobs, strict=False)]


def equal(a: Outcome, b: Outcome) -> bool:
    return a.tokens == b.tokens and a.logprobs == b.logprobs


def shared_logprob_difference(a: Outcome, b: Outcome, step: int = 0) -> float:
    """Largest |difference| at ``step`` over the top tokens both outcomes list (inf when they share none).
    Unlike ``largest_logprob_difference`` a rank swap is not a mismatch: two runners-up that tie in one run
    may come out in either order from the other (seen: two tokens at exactly -6.1253 in the reference)."""
    x, y = a.logprobs[step], b.logprobs[step]
    shared = x.keys() & y.keys()
    return max((abs(x[t] - y[t]) for t in shared), default=float("inf"))


def first_step_agrees(a: Outcome, b: Outcome) -> bool:
    """The first decoded token equal and the logprobs of every top token both list at that step within
    FIRST_STEP_TOLERANCE: the criterion for a step that the reference cannot run in the same batch or query
    shape."""
    return (bool(a.tokens) and a.tokens[:1] == b.tokens[:1]
            and shared_logprob_difference(a, b) <= FIRST_STEP_TOLERANCE)
