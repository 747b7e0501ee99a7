"""Issue 19, row 7: a producer's RSS and poll milliseconds under the floods a hostile neighbour can send.

Not in CI (CI checks the same bounds with counters and lowered caps: tests/engine/test_limits.py,
test_bounded_poll.py, test_early.py). Three floods against one real Producer (tiny model, CPU, no
secret) in this process, each sent from a spawned process so its own buffers are not counted:

  frames     one message of ``--message-mib`` MiB split into 64 frames (each under the 16 MiB frame
             cap) sent to the producer's side-channel listener; reported: the producer process's
             peak RSS above its RSS before (VmHWM after a reset), and whether the listener answered
  notifs     ``--notifications`` heartbeats over NIXL from an agent that never handshaked; reported:
             every poll's milliseconds (max, median of those over 1 ms) until all are handled, NIXL's
             own fetch (timed around ``agent.get_notifs``, the same on every commit) and the rest of
             the poll, the engine's own work ("own": max and total)
  early      ``--completions`` completions over NIXL from a handshaken stranger, each for a request
             that is not held (kept as early completions, the table at its bound); reported: poll
             milliseconds (max, median) until all are handled

It runs on older commits too (it touches no API added by issue 19), so a before figure is taken by
running it in a worktree of the parent commit:

    git worktree add /tmp/before 5a12cf6
    PYTHONPATH=/tmp/before .venv/bin/python benchmarks/hostile_bounds.py
    PYTHONPATH=$PWD .venv/bin/python benchmarks/hostile_bounds.py

Options: --only frames|notifs|early, --message-mib (1024), --notifications (100000),
--completions (40000), --json.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import statistics
import time
from pathlib import Path

FRAMES = 64
WAIT_S = 120.0
ANSWER_WAIT_MS = 15_000
PRESET = "qwen3.5-0.8b"  # 16 blocks of 1.1 MiB pages: the cache is not what is measured


def _geometry():
    from hybrid_transfer.layout import RankGeometry, load_preset

    return RankGeometry(load_preset(PRESET), 1, 0)


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _reset_peak() -> None:
    """Make VmHWM start again from the current RSS (Linux: 5 > /proc/self/clear_refs)."""
    Path("/proc/self/clear_refs").write_text("5")


def _producer(**config):
    from hybrid_transfer.cache import HybridCache
    from hybrid_transfer.engine import EngineConfig, Producer

    return Producer(HybridCache.allocate(_geometry(), 16), EngineConfig(**config))


# ---- the senders, in spawned processes ---------------------------------------------------------------------


def _send_frames(address: str, message_mib: int, done) -> None:
    import zmq

    frame = b"\0" * ((message_mib << 20) // FRAMES)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 5000)
    sock.connect(address)
    sock.send_multipart([frame] * FRAMES)
    answered = bool(sock.poll(ANSWER_WAIT_MS))  # a listener that read it answers within this; a capped one never
    done.put(answered)
    ctx.destroy(linger=0)


def _send_notifs(name: str, metadata: bytes, messages: list[bytes], count: int, sent, stop) -> None:
    from hybrid_transfer.engine.agent import NixlAgent, quiet_nixl_logging
    from hybrid_transfer.engine.config import EngineConfig

    quiet_nixl_logging()
    agent = NixlAgent(name, EngineConfig())
    peer = agent.add_remote(metadata)
    for i in range(count):
        agent.send_notif(peer, messages[i % len(messages)])
        if i % 256 == 255:
            agent.get_notifs()  # progress this side too
    sent.put(count)
    while stop.empty():  # stay up (and progressing) until the producer has taken everything in
        agent.get_notifs()
        time.sleep(0.001)
    agent.close()


# ---- the floods --------------------------------------------------------------------------------------------


def frames_flood(message_mib: int) -> dict:
    producer = _producer()
    try:
        ctx = mp.get_context("spawn")
        done = ctx.Queue()
        base_kib = _rss_kib("VmRSS")
        _reset_peak()
        sender = ctx.Process(target=_send_frames, args=(producer.address, message_mib, done))
        sender.start()
        answered = done.get(timeout=WAIT_S)
        sender.join(WAIT_S)
        return {"message_mib": message_mib, "frames": FRAMES, "answered": answered,
                "rss_before_mib": round(base_kib / 1024, 1),
                "peak_rss_above_mib": round((_rss_kib("VmHWM") - base_kib) / 1024, 1),
                "oversized_counted": getattr(producer._server, "num_oversized", None)}
    finally:
        producer.close()


def _timed_polls(producer, handled, total: int) -> dict:
    """Poll until ``handled()`` reaches ``total``; every poll's ms and NIXL's fetch ms within it."""
    fetch_ms: list[float] = []
    real = producer.agent.get_notifs

    def timed():
        start = time.perf_counter()
        try:
            return real()
        finally:
            fetch_ms.append((time.perf_counter() - start) * 1000)

    producer.agent.get_notifs = timed
    polls: list[float] = []
    deadline = time.monotonic() + WAIT_S
    while handled() < total and time.monotonic() < deadline:
        start = time.perf_counter()
        producer.poll()
        polls.append((time.perf_counter() - start) * 1000)
    own = [p - f for p, f in zip(polls, fetch_ms, strict=True)]  # the engine's work: the poll less NIXL's fetch
    busy = [p for p in polls if p > 1.0] or polls
    return {"handled": handled(), "polls": len(polls), "poll_ms_max": round(max(polls), 2),
            "poll_ms_median_busy": round(statistics.median(busy), 2),
            "fetch_ms_max": round(max(fetch_ms), 2), "own_ms_max": round(max(own), 2),
            "own_ms_total": round(sum(own), 1), "fetch_ms_total": round(sum(fetch_ms), 1)}


def _flood(producer, name: str, messages: list[bytes], count: int, handled) -> dict:
    """The producer polls (timed) while the flood arrives, until it has handled all of it."""
    ctx = mp.get_context("spawn")
    sent, stop = ctx.Queue(), ctx.Queue()
    sender = ctx.Process(target=_send_notifs, args=(name, producer.agent.metadata, messages, count, sent, stop))
    base_kib = _rss_kib("VmRSS")
    _reset_peak()
    sender.start()
    try:
        out = _timed_polls(producer, handled, count)
        out["peak_rss_above_mib"] = round((_rss_kib("VmHWM") - base_kib) / 1024, 1)
        out["sender_done"] = not sent.empty()
        return out
    finally:
        stop.put("stop")
        sender.join(WAIT_S)


def notification_flood(count: int) -> dict:
    from hybrid_transfer.engine import wire

    producer = _producer()
    try:
        heartbeat = wire.encode(wire.Heartbeat(0, (wire.RequestRef("r", 1),)), producer.fingerprint.digest())
        out = _flood(producer, "hostile-stranger", [heartbeat], count, lambda: producer.stats.unknown_agent)
        return {"notifications": count, **out}
    finally:
        producer.close()


def early_flood(count: int) -> dict:
    from hybrid_transfer.engine import handshake, wire
    from hybrid_transfer.layout import fingerprint_of
    from hybrid_transfer.plan.rank import describe_rank

    producer = _producer()
    try:
        name = "hostile-c0-handshaken"
        geometry = _geometry()
        request = handshake.make_request(fingerprint_of(geometry),
                                         describe_rank(geometry, [(j + 1) << 32 for j in range(geometry.num_tensors)],
                                                       16), name, "hostile")
        assert producer._respond(request) == producer._card.accepted_reply  # the listener's own answer
        digest = producer.fingerprint.digest()
        completions = [wire.encode(wire.Completion(request_id=f"stray-{i}", nonce=1, consumer_rank=0,
                                                   expected_consumers=1), digest) for i in range(count)]
        out = _flood(producer, name, completions, count, lambda: producer.stats.early_kept)
        out["early_limit"] = producer.config.early_completion_limit
        return {"completions": count, **out}
    finally:
        producer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("frames", "notifs", "early"))
    parser.add_argument("--message-mib", type=int, default=1024)
    parser.add_argument("--notifications", type=int, default=100_000)
    parser.add_argument("--completions", type=int, default=40_000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    from hybrid_transfer.engine.agent import quiet_nixl_logging

    quiet_nixl_logging()
    results = {}
    if args.only in (None, "frames"):
        results["frames"] = frames_flood(args.message_mib)
    if args.only in (None, "notifs"):
        results["notifs"] = notification_flood(args.notifications)
    if args.only in (None, "early"):
        results["early"] = early_flood(args.completions)
    if args.json:
        print(json.dumps(results, indent=2))
        return
    for name, row in results.items():
        print(f"{name:7s} " + "  ".join(f"{k}={v}" for k, v in row.items()))


if __name__ == "__main__":
    main()
