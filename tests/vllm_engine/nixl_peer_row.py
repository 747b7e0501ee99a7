"""vLLM's own NixlConnector on the same prompts and criterion: the peer row beside ours (not run in CI).

    PYTHONPATH=. $(bash scripts/vllm_cpu_env.sh)/bin/python tests/vllm_engine/nixl_peer_row.py [--out DIR]

Starts a prefill and a decode engine with vLLM's NixlConnector (CPU buffers, each engine its own
side-channel port) and the same-split reference, runs parity.prompt_set through them, and prints one
row per prompt: NixlConnector's tokens, the reference's, equal or not, the largest first-step logprob
difference. vLLM's NixlConnector worker pins its process to one core (nixl/base_worker.py), so each
generate is slow on a small host; the figures are its tokens, not its speed.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import engines  # noqa: E402
import parity  # noqa: E402
from conftest import block_size_of  # noqa: E402
from tiny_weights import write_model  # noqa: E402

NIXL_HAND_OFF = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                 "remote_block_ids": None, "remote_host": None, "remote_port": None}


def nixl_config(role: str) -> dict:
    return {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu",
            "kv_load_failure_policy": "fail"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="directory for the engines' logs and nixl_peer.json")
    args = parser.parse_args()
    root = args.out or Path(tempfile.mkdtemp(prefix="nixl-peer-"))
    root.mkdir(parents=True, exist_ok=True)
    model = write_model(root / "tiny-qwen3-next")
    prefill = engines.EngineServer("nixl-prefill", model, root, kv=nixl_config("kv_both"),
                                   env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(engines.free_port())})
    decode = engines.EngineServer("nixl-decode", model, root, kv=nixl_config("kv_both"),
                                  env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(engines.free_port())})
    reference = engines.EngineServer("reference", model, root, args=[
        "--scheduler-cls", "split_scheduler.SplitAtNMinusOneScheduler", "--max-num-seqs", "1"])
    try:
        engines.start_all([prefill, decode, reference])
        prompts = parity.prompt_set(block_size_of(reference))
        ids = list(prompts.values())
        handed = parity.run_all(lambda p: prefill.complete(p, max_tokens=1, kv_transfer_params=dict(NIXL_HAND_OFF)),
                                ids)
        ours = parity.run_all(lambda pp: parity.outcome(decode.complete(
            pp[0], max_tokens=parity.MAX_TOKENS, kv_transfer_params=pp[1]["kv_transfer_params"])),
            list(zip(ids, handed, strict=True)))
        ref = parity.aggregated(reference, ids)
        rows = [{"prompt": name, "n_minus_1": len(p) - 1, "nixl": o.tokens, "same_split": r.tokens,
                 "equal": parity.equal(o, r), "first_step_logprob_diff": parity.largest_logprob_difference(o, r, 1)}
                for name, p, o, r in zip(prompts, ids, ours, ref, strict=True)]
        (root / "nixl_peer.json").write_text(json.dumps(rows, indent=1))
        for row in rows:
            print(f"{row['prompt']:>28} N-1={row['n_minus_1']:>4} nixl={row['nixl']} split={row['same_split']} "
                  f"equal={row['equal']} d1={row['first_step_logprob_diff']:.3g}")
        print(f"{sum(r['equal'] for r in rows)}/{len(rows)} equal; logs and nixl_peer.json in {root}")
    finally:
        for server in (prefill, decode, reference):
            server.close()


if __name__ == "__main__":
    main()
