"""The parity reference's scheduler: every prompt's first chunk ends at N-1, token N runs in the next step.

A disaggregated request runs exactly that split: prefill computes the prompt's first N-1 tokens in
one step, decode computes token N (and samples) in its first step. The aggregated reference must run
the same kernels on the same inputs, so it must split the same way. With one request at a time
(``max_num_seqs=1``) the step budget of a fresh request's first step is set to N-1; every later
step has the engine's own budget. One engine then serves prompts of any N (one engine per N-1
would cost a start each). Loaded by vLLM from ``scheduler_cls`` in the engine-core process.
"""

from __future__ import annotations

from vllm.v1.core.sched.scheduler import Scheduler


class SplitAtNMinusOneScheduler(Scheduler):
    """vLLM's scheduler with a fresh prompt's first step cut to its first N-1 tokens."""

    def schedule(self, *args, **kwargs):
        budget = self.max_num_scheduled_tokens
        if not self.running and self.waiting:
            request = self.waiting.peek_request()
            if request.num_computed_tokens == 0 and request.num_prompt_tokens > 1:
                self.max_num_scheduled_tokens = request.num_prompt_tokens - 1
        try:
            return super().schedule(*args, **kwargs)
        finally:
            self.max_num_scheduled_tokens = budget


class AlignedSplitScheduler(Scheduler):
    """The parity reference with prefix caching on (``mamba_cache_mode='align'``): a prompt's chunks follow
    exactly the chunk ends a prefill engine gives its N-1-token prompt, then token N runs alone.

    Align mode clips every prefill chunk in ``_mamba_block_aligned_split`` to the block boundaries where
    the GDN state is cached, and what it clips to depends on the prompt's length. A disaggregated prefill
    engine sees the prompt cut to N-1 tokens (the connector cuts it): so while a request has computed
    fewer than N-1 tokens, its chunk is capped at N-1 and the split is taken with the request's last
    prompt token out of sight, as the prefill engine's request has it. After N-1 tokens the next chunk is
    token N alone, as on the decode engine. Any number of requests at a time.
    """

    def _mamba_block_aligned_split(self, request, num_new_tokens, num_new_local_computed_tokens=0,
                                   num_external_computed_tokens=0):
        start = request.num_computed_tokens + num_new_local_computed_tokens + num_external_computed_tokens
        cut = request.num_prompt_tokens - 1
        if request.num_prompt_tokens < 2 or start >= cut:
            return super()._mamba_block_aligned_split(request, num_new_tokens, num_new_local_computed_tokens,
                                                      num_external_computed_tokens)
        num_new_tokens = min(num_new_tokens, cut - start)
        last = request._all_token_ids.pop()  # the request as the prefill engine holds it, for this call only
        request.num_prompt_tokens -= 1
        try:
            return super()._mamba_block_aligned_split(request, num_new_tokens, num_new_local_computed_tokens,
                                                      num_external_computed_tokens)
        finally:
            request.num_prompt_tokens += 1
            request._all_token_ids.append(last)
