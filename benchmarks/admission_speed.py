"""The consumer's admission checks per request (Consumer._check), each call timed alone, no engine running.

Builds the tickets of one engine step as a producer issues them (claims.sign over wire.Ticket, the
preset's groups, verify.make_requests' block ids) and times, per ticket and warm, the calls ``_check``
makes: inputs.ticket, inputs.count (twice), inputs.block_id_lists, plan.validate.block_id_arrays,
claims.digest_of, claims.mac_ok, and AllowedProducers.allows on every address (the default list).
Each sample runs every call once per ticket of the step, on fresh ticket objects (as decoded from
the embedder's bytes, so no identity cache is warm from the last sample); a row is the median over
``--reps`` samples of the per-ticket time, in microseconds.

Measured (2-core dev VM, 2026-12-02, ``--secret --extra-blocks 71``: 78 ids in 4 groups, prefill TP 1; medians of
3 interleaved runs against the tree before the fast paths, ba46fde): the sum 27.5 -> 12.3 us per request
(inputs.ticket 10.0 -> 6.4, block_id_lists 6.5 -> 2.2, allows 2.3 -> 0.3, digest_of 4.3 -> 1.5, mac_ok 3.7 ->
1.6, inputs.count x2 0.8 -> 0.3); this host's speed swings about 2x between runs, so compare interleaved runs
only, and block_id_arrays (code these changes leave alone) shows when a run is slow.

Run: python benchmarks/admission_speed.py [--preset qwen3.5-397b-a17b] [--tokens 8192] [--batch 16]
     [--prefill-tp 1] [--decode-tp 1]
     [--extra-blocks 0] [--reps 400] [--secret] [--json]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time

from hybrid_transfer import RankGeometry, load_preset
from hybrid_transfer.engine import claims, inputs, wire
from hybrid_transfer.engine.addresses import DEFAULT_ALLOWED_PRODUCERS, AllowedProducers
from hybrid_transfer.plan.validate import block_id_arrays
from hybrid_transfer.verify import make_requests

log = logging.getLogger("admission_speed")


def step_tickets(preset: str, tokens: int, batch: int, prefill_tp: int, decode_tp: int, extra: int,
                 secret: bytes | None):
    """(tickets, local block ids) of one step: a producer's signed tickets and the consumer's own ids.

    ``extra`` pads each attention list (verify.make_requests' extra_local_blocks) to model tickets of more ids
    than the preset's large blocks give; the checks timed here do not compare the count with the tokens."""
    geometry = RankGeometry(load_preset(preset), decode_tp, 0)
    layouts = make_requests(geometry, [tokens] * batch, 1 << 20, rng=3, fragmentation=0.3, extra_local_blocks=extra)
    locals_ = make_requests(geometry, [tokens] * batch, 1 << 20, rng=4, fragmentation=0.3, extra_local_blocks=extra)
    addresses = tuple(f"tcp://127.0.0.1:{5600 + r}" for r in range(prefill_tp))
    tickets = [claims.sign(wire.Ticket(
        engine_id="bench-prefill", incarnation=12345678901, addresses=addresses, tp_size=prefill_tp,
        request_id=f"cmpl-{i:08x}-0123456789abcdef", nonce=(1 << 62) + i, block_ids=layout.block_ids,
        num_tokens=tokens, state_position=tokens, lease_s=30.0), secret) for i, layout in enumerate(layouts)]
    return tickets, [[list(g) for g in lay.block_ids] for lay in locals_]


def _calls(allowed: AllowedProducers, secret: bytes | None, num_groups: int):
    """(name, f(ticket as passed, local ids, state)) for each call _check makes, in its order; ``state`` carries
    the checked ticket and its digest from one call to the next, as _check does."""
    def ticket(t, _ids, state):
        state["checked"] = inputs.ticket(t)

    def allows(_t, _ids, state):
        for address in state["checked"].addresses:
            if not allowed.allows(address):
                raise AssertionError(address)

    def digest(_t, _ids, state):
        state["digest"] = claims.digest_of(state["checked"])

    def mac(_t, _ids, state):
        if not claims.mac_ok(state["checked"], secret, state["digest"]):
            raise AssertionError("MAC")

    return [
        ("inputs.ticket", ticket),
        ("inputs.count x2", lambda _t, _ids, _s: (inputs.count("e", 8192), inputs.count("f", 0))),
        ("block_id_lists", lambda _t, ids, _s: inputs.block_id_lists("local", ids)),
        ("allows", allows),
        ("block_id_arrays", lambda _t, ids, _s: block_id_arrays("local", ids, num_groups)),
        ("digest_of", digest),
        ("mac_ok", mac),
    ]


def measure(tickets, local_ids, secret: bytes | None, reps: int) -> dict[str, float]:
    """Median microseconds per ticket of each call, and of them all together ("sum", less block_id_arrays:
    plan/validate's, not an admission check of engine/; "sum with block_id_arrays" has it).

    Each ticket runs the calls in _check's order, each timed alone (perf_counter_ns, less the cost of timing
    nothing), so a digest the ticket check left for digest_of is found as in the consumer."""
    allowed = AllowedProducers(DEFAULT_ALLOWED_PRODUCERS)
    calls = _calls(allowed, secret, len(local_ids[0]))
    data = [wire.encode_ticket(t) for t in tickets]
    clock = time.perf_counter_ns
    empty = statistics.median(-clock() + clock() for _ in range(10000))
    samples: dict[str, list[float]] = {name: [] for name, _ in calls}
    for rep in range(reps + 20):  # the first 20 warm up
        fresh = [wire.decode_ticket(d) for d in data]  # new objects each sample, as each step brings
        spent = dict.fromkeys(samples, 0.0)
        for t, ids in zip(fresh, local_ids, strict=True):
            state: dict = {}
            for name, call in calls:
                t0 = clock()
                call(t, ids, state)
                spent[name] += clock() - t0 - empty
        if rep >= 20:
            for name, ns in spent.items():
                samples[name].append(ns / len(fresh) / 1e3)
    result = {name: statistics.median(v) for name, v in samples.items()}
    result["sum"] = sum(v for name, v in result.items() if name != "block_id_arrays")
    result["sum with block_id_arrays"] = result["sum"] + result["block_id_arrays"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3.5-397b-a17b")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prefill-tp", type=int, default=1)
    parser.add_argument("--decode-tp", type=int, default=1, help="the decode rank's TP (its block size)")
    parser.add_argument("--extra-blocks", type=int, default=0, help="ids added to each attention list")
    parser.add_argument("--reps", type=int, default=400)
    parser.add_argument("--secret", action="store_true", help="sign the tickets under a secret (HMAC)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    secret = b"s" * 32 if args.secret else None
    tickets, local_ids = step_tickets(args.preset, args.tokens, args.batch, args.prefill_tp, args.decode_tp,
                                     args.extra_blocks, secret)
    ids = sum(map(len, tickets[0].block_ids))
    result = measure(tickets, local_ids, secret, args.reps)
    if args.json:
        log.info(json.dumps(result))
        return
    log.info("%s, %d tokens, %d tickets per step, %d ids in %d groups, prefill TP %d, secret %s; median of %d",
             args.preset, args.tokens, args.batch, ids, len(tickets[0].block_ids), args.prefill_tp,
             "yes" if secret else "no", args.reps)
    for name, us in result.items():
        log.info("  %-24s %7.2f us per request", name, us)


if __name__ == "__main__":
    main()
