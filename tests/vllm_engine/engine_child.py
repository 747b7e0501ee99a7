"""One real vLLM engine (``vllm.LLM``) in a process of its own, driven over a local socket.

Started by ``engines.EngineProcess`` as ``python engine_child.py <socket> <spec json>`` in a new
session (its own process group), so the parent can stop or kill the engine together with the
engine-core and worker processes vLLM spawns. Each command is a dict; each answer is
``{"ok": value}`` or ``{"error": text}``. Commands:

- ``{"op": "generate", "prompts": [[ids]...], "params": [{...}...]}``: greedy generation, one params
  dict per prompt (``max_tokens``, ``logprobs``, ``kv_transfer_params``); returns per prompt its
  token ids, per-step logprobs of the top tokens, finish reason and returned ``kv_transfer_params``.
- ``{"op": "pids"}``: this process and its descendants; ``{"op": "stop"}``: shut down and exit.
"""

from __future__ import annotations

import json
import os
import sys
from multiprocessing.connection import Client
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def build(spec: dict):
    from vllm import LLM

    kwargs = dict(model=spec["model"], dtype="bfloat16", enforce_eager=True, skip_tokenizer_init=True,
                  max_model_len=spec.get("max_model_len", 512), enable_prefix_caching=False,
                  max_num_seqs=spec.get("max_num_seqs", 8), seed=0)
    if spec.get("max_num_batched_tokens"):
        kwargs["max_num_batched_tokens"] = spec["max_num_batched_tokens"]
    if spec.get("kv_transfer_config"):
        kwargs["kv_transfer_config"] = spec["kv_transfer_config"]
    if spec.get("scheduler_cls"):
        kwargs["scheduler_cls"] = spec["scheduler_cls"]
    kwargs.update(spec.get("extra", {}))
    return LLM(**kwargs)


def generate(llm, prompts: list[list[int]], params: list[dict]) -> list[dict]:
    from vllm import SamplingParams

    sampling = []
    for p in params:
        extra = {"kv_transfer_params": p["kv_transfer_params"]} if p.get("kv_transfer_params") else None
        sampling.append(SamplingParams(temperature=0.0, max_tokens=p.get("max_tokens", 8), detokenize=False,
                                       logprobs=p.get("logprobs", 2), extra_args=extra, ignore_eos=True))
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], sampling, use_tqdm=False)
    answers = []
    for out in outputs:
        completion = out.outputs[0]
        steps = []
        for step in completion.logprobs or []:
            steps.append(sorted(((int(t), float(lp.logprob)) for t, lp in step.items()), key=lambda x: -x[1]))
        answers.append({"token_ids": list(completion.token_ids), "logprobs": steps,
                        "finish_reason": completion.finish_reason,
                        "kv_transfer_params": out.kv_transfer_params})
    return answers


def descendants() -> list[int]:
    import psutil

    me = psutil.Process()
    return [me.pid] + [c.pid for c in me.children(recursive=True)]


def main() -> None:
    address, spec = sys.argv[1], json.loads(sys.argv[2])
    conn = Client(address, authkey=spec["authkey"].encode())
    try:
        llm = build(spec)
    except BaseException as exc:  # the parent shows why the engine did not start
        conn.send({"error": f"{type(exc).__name__}: {exc}"})
        raise
    conn.send({"ok": "ready"})
    while True:
        cmd = conn.recv()
        try:
            if cmd["op"] == "generate":
                conn.send({"ok": generate(llm, cmd["prompts"], cmd["params"])})
            elif cmd["op"] == "pids":
                conn.send({"ok": descendants()})
            elif cmd["op"] == "stop":
                conn.send({"ok": "stopping"})
                break
            else:
                conn.send({"error": f"unknown op {cmd['op']!r}"})
        except Exception as exc:  # noqa: BLE001 - the test sees the engine's error as a failed command
            conn.send({"error": f"{type(exc).__name__}: {exc}"})
    os._exit(0)  # vLLM's atexit shutdown is what the process group kill covers; exit at once


if __name__ == "__main__":
    main()
