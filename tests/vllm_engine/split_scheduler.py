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
