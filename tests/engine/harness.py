"""Process harness for engine tests: spawned worker processes host producer and consumer ranks.

Workers fork from a fork server that imported torch, NIXL and the engine once (worker_context,
worker_imports.py), so a new worker costs a fork, not ~1.5 s of CPU for its imports; each worker still
takes the environment of the test process as it was when the worker started, as a spawned one would.
The engine tests' Cluster (tests/engine/conftest.py) is shared by their tests and closed once they are
done. A worker hosts any number of ranks, each with its own NIXL
agent, keyed by name; between commands it keeps polling every rank it hosts, so producers
progress NIXL (docs/tuning.md#progress-thread: a target must be progressed) and free blocks while the test waits on
consumers. Commands travel over a Pipe and run one at a time; an exception comes back as a
RemoteError with the type name, message and attributes of the original.

The same shape suits a benchmark: ranks on separate processes, commands for hold / start_read /
wait, timings taken inside the worker (``ReadSummary.post_to_done_s``).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from tiny_model import TINY_CONFIG

TINY = TINY_CONFIG  # the tests' tiny hybrid model (tests/tiny_model.py)
IDLE_POLL_S = 0.002  # a worker's wait for the next command between rounds of polling its ranks
WAIT_POLL_S = 0.0005  # sleep between polls while a command waits for requests to finish


# ---- what travels between the test and the workers -----------------------------------
@dataclass(frozen=True)
class RankSpec:
    """A rank's cache: a model (config dict or preset name), TP position, options, block count."""

    model: dict | str
    tp_size: int
    tp_rank: int
    num_blocks: int
    options: Any = None  # CacheOptions or None
    model_name: str = "tiny"
    shared: bool = False  # the cache over named shared memory (a producer's can then be mapped: engine/mapped/)
    device: str = "cpu"  # where the cache lives ("cuda": GPU 0, tests/gpu)

    def geometry(self):
        from hybrid_transfer.layout import RankGeometry, load_preset, model_from_config

        spec = load_preset(self.model) if isinstance(self.model, str) else model_from_config(self.model,
                                                                                           name=self.model_name)
        return RankGeometry(spec, self.tp_size, self.tp_rank, self.options)


@dataclass(frozen=True)
class ReadSummary:
    """A consumer's ReadResult, flattened so it pickles."""

    request_id: str
    state: str
    num_bytes: int
    num_descriptors: int
    post_to_done_s: float
    error_type: str | None = None
    error_message: str | None = None


@dataclass(frozen=True)
class RemoteErrorInfo:
    type_name: str
    message: str
    attrs: dict


class RemoteError(Exception):
    """An exception raised inside a worker; ``type_name`` and ``attrs`` describe the original."""

    def __init__(self, info: RemoteErrorInfo):
        super().__init__(f"{info.type_name}: {info.message}")
        self.type_name = info.type_name
        self.message = info.message
        self.attrs = info.attrs


# ---- the worker side -------------------------------------------------------------
@dataclass
class _Rank:
    engine: Any  # Producer or Consumer
    is_producer: bool
    freed: set = field(default_factory=set)
    results: dict = field(default_factory=dict)


class _WorkerState:
    def __init__(self):
        self.ranks: dict[str, _Rank] = {}
        self.extra: dict[str, Any] = {}  # objects created by call() functions (e.g. stranger agents)

    def poll_all(self) -> None:
        for rank in self.ranks.values():
            if rank.is_producer:
                rank.freed.update(rank.engine.poll())
            else:
                for result in rank.engine.poll():
                    rank.results[result.request_id] = result
        for obj in self.extra.values():
            progress = getattr(obj, "get_notifs", None)  # bare agents (strangers) need progress too
            if progress is not None:
                progress()

    def close_all(self) -> None:
        for rank in self.ranks.values():
            rank.engine.close()
        for obj in self.extra.values():
            close = getattr(obj, "close", None)
            if close is not None:
                close()


def _describe(exc: BaseException) -> RemoteErrorInfo:
    attrs = {}
    for key, value in vars(exc).items():
        try:
            import pickle

            pickle.dumps(value)
        except Exception:  # noqa: BLE001 - attributes that do not pickle are summarised
            value = repr(value)
        attrs[key] = value
    return RemoteErrorInfo(type(exc).__name__, str(exc), attrs)


def _op_create_producer(state, key, spec: RankSpec, engine_id, incarnation, config):
    from hybrid_transfer.cache import HybridCache
    from hybrid_transfer.engine import Producer

    cache = HybridCache.allocate(spec.geometry(), spec.num_blocks, spec.device, shared=spec.shared)
    producer = Producer(cache, config, engine_id=engine_id, incarnation=incarnation)
    state.ranks[key] = _Rank(producer, True)
    return producer.address


def _op_create_consumer(state, key, spec: RankSpec, config, engine_id):
    from hybrid_transfer.cache import HybridCache
    from hybrid_transfer.engine import Consumer
    from hybrid_transfer.verify import poison

    cache = HybridCache.allocate(spec.geometry(), spec.num_blocks, spec.device, shared=spec.shared)
    poison(cache)
    state.ranks[key] = _Rank(Consumer(cache, config, engine_id=engine_id), False)


def _op_set_engine_addresses(state, key, addresses):
    state.ranks[key].engine.set_engine_addresses(addresses)


def _op_fill_and_hold(state, key, request_id, layout, seed, nonce):
    from hybrid_transfer.engine import encode_ticket
    from hybrid_transfer.verify import fill_source

    producer = state.ranks[key].engine
    if seed is not None:
        fill_source(producer.cache, layout, seed)
    return encode_ticket(producer.hold(request_id, layout.block_ids, layout.num_tokens, nonce=nonce))


def _op_start_read(state, key, ticket_bytes, local_block_ids, expected_state_position):
    from hybrid_transfer.engine import decode_ticket

    state.ranks[key].engine.start_read(decode_ticket(ticket_bytes), local_block_ids,
                                       expected_state_position=expected_state_position)


def _op_wait_done(state, key, request_ids, timeout_s):
    rank = state.ranks[key]
    deadline = time.monotonic() + timeout_s
    while not all(r in rank.results for r in request_ids) and time.monotonic() < deadline:
        state.poll_all()
        time.sleep(WAIT_POLL_S)
    out = []
    for rid in request_ids:
        r = rank.results.pop(rid, None)
        if r is None:
            out.append(ReadSummary(rid, "timeout", 0, 0, 0.0))
            continue
        out.append(ReadSummary(rid, r.state.value, r.num_bytes, r.num_descriptors, r.finished_at - r.started_at,
                               type(r.error).__name__ if r.error else None, str(r.error) if r.error else None))
    return out


def _op_wait_freed(state, key, request_ids, timeout_s):
    rank = state.ranks[key]
    deadline = time.monotonic() + timeout_s
    while not set(request_ids) <= rank.freed and time.monotonic() < deadline:
        state.poll_all()
        time.sleep(WAIT_POLL_S)
    return sorted(set(request_ids) & rank.freed)


def _op_settle(state, seconds):
    """Keep polling every rank for ``seconds`` (lets stray notifications arrive and be counted)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        state.poll_all()
        time.sleep(WAIT_POLL_S)


def _op_producer_status(state, key, request_ids=()):
    p = state.ranks[key].engine
    return {"num_held_blocks": p.num_held_blocks, "num_held_requests": p.num_held_requests,
            "agent_name": p.agent.name, "held": [rid for rid in request_ids if p.is_held(rid)],
            "stats": asdict(p.stats), "listener": asdict(p.listener_stats), "metadata": p.agent.metadata,
            "digest": p.fingerprint.digest()}


def _op_consumer_status(state, key):
    c = state.ranks[key].engine
    return {"num_active": c.num_active, "stats": asdict(c.stats), "agent_name": c.agent.name}


def _op_check(state, key, layouts_and_seeds, skip_attention_tails=False):
    from hybrid_transfer.verify import check_destination_many

    check_destination_many(state.ranks[key].engine.cache, layouts_and_seeds,
                           skip_attention_tails=skip_attention_tails)


def _op_connect(state, key, address, timeout_s):
    state.ranks[key].engine.connect(address, timeout_s=timeout_s)


def _op_close(state, key):
    rank = state.ranks.pop(key, None)
    if rank is not None:
        rank.engine.close()


def _op_call(state, func, *args):
    return func(state, *args)


def stranger_notify(state, name, metadata, message) -> None:
    """From a bare agent that never handshaked: load a producer's metadata and send it ``message``."""
    from hybrid_transfer.engine.agent import NixlAgent
    from hybrid_transfer.engine.config import EngineConfig

    if name not in state.extra:
        agent = state.extra[name] = NixlAgent(name, EngineConfig())
        state.extra[name + "/peer"] = agent.add_remote(metadata)
    state.extra[name].send_notif(state.extra[name + "/peer"], message)


def raw_notify(state, key, peer_name, message) -> None:
    """Send ``message`` from a hosted rank's own agent (a handshaked consumer misbehaving)."""
    state.ranks[key].engine.agent.send_notif(peer_name, message)


_OPS = {name.removeprefix("_op_"): fn for name, fn in globals().items() if name.startswith("_op_")}


def worker_main(conn, environ: dict[str, str]) -> None:
    """Command loop of one worker process; polls its ranks whenever no command is waiting.

    ``environ``: the test process's environment when it started this worker (the fork server's is older).
    A worker that hosts nothing to progress sleeps until the next command instead of polling.
    """
    os.environ.clear()
    os.environ.update(environ)
    logging.basicConfig(level=os.environ.get("HT_TEST_LOG", "WARNING"))
    state = _WorkerState()
    try:
        while True:
            if conn.poll(IDLE_POLL_S if state.ranks or state.extra else None):
                message = conn.recv()
                if message is None:
                    break
                op, args = message
                try:
                    reply = ("ok", _OPS[op](state, *args))
                except BaseException as exc:  # noqa: BLE001 - every failure goes back to the test
                    reply = ("err", _describe(exc))
                conn.send(reply)
            state.poll_all()
    finally:
        state.close_all()


# ---- the test side ---------------------------------------------------------------
PRELOAD = ["worker_imports"]  # imported by the fork server before it forks any worker


def worker_context():
    """The multiprocessing context workers start from: a fork server that has imported PRELOAD.

    The server starts here (once; it lives as long as the test process) with this folder on its
    PYTHONPATH: multiprocessing hands it the preload list but not our sys.path. A preload that fails to
    import only makes each worker import on its own. Pass a context of your own (spawn) to Worker for a
    worker that must not share the server's imports.
    """
    from multiprocessing import forkserver

    from hybrid_transfer.engine.tcp_path import environment

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    here = os.path.dirname(os.path.abspath(__file__))
    with environment({"PYTHONPATH": os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))}):
        forkserver.ensure_running()
    return ctx


class Worker:
    """One worker process (forked from the fork server of ``ctx``, or spawned) and its command pipe."""

    def __init__(self, ctx, index: int):
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=worker_main, args=(child, dict(os.environ)), name=f"engine-worker-{index}",
                                   daemon=True)
        self.process.start()
        child.close()  # the worker holds the other end: if it dies, a poll here sees the pipe closed

    def call(self, op: str, *args, timeout_s: float = 120.0):
        self.conn.send((op, args))
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"worker {self.process.name}: {op} did not answer within {timeout_s} s")
        status, value = self.conn.recv()
        if status == "err":
            raise RemoteError(value)
        return value

    def ask_to_stop(self) -> None:
        """Send the stop message (the worker closes its ranks and exits); does not wait."""
        if self.process.is_alive():
            try:
                self.conn.send(None)
            except (BrokenPipeError, OSError):
                pass

    def close(self, timeout_s: float = 20.0) -> None:
        self.ask_to_stop()
        self.process.join(timeout=timeout_s)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.conn.close()


class Cluster:
    """``num_workers`` workers, started together from ``ctx`` (worker_context() unless given)."""

    def __init__(self, num_workers: int, ctx=None):
        ctx = ctx or worker_context()
        self.workers = [Worker(ctx, i) for i in range(num_workers)]

    def close(self, timeout_s: float = 20.0) -> None:
        """Stop every worker: all are asked at once, then each is waited for (killed after ``timeout_s``)."""
        for w in self.workers:
            w.ask_to_stop()
        deadline = time.monotonic() + timeout_s
        for w in self.workers:
            w.close(max(0.0, deadline - time.monotonic()))


@dataclass
class EngineRanks:
    """The ranks of one engine: where each lives and its key there."""

    workers: list[Worker]
    keys: list[str]
    specs: list[RankSpec]
    addresses: list[str] = field(default_factory=list)
    engine_id: str = ""
    incarnation: int = 0

    def close(self) -> None:
        for w, k in zip(self.workers, self.keys, strict=True):
            w.call("close", k)


def start_producers(workers: Sequence[Worker], specs: Sequence[RankSpec], config=None) -> EngineRanks:
    engine_id = f"prefill-{uuid.uuid4().hex[:6]}"
    incarnation = int.from_bytes(os.urandom(6), "little")
    keys = [f"{engine_id}-{s.tp_rank}" for s in specs]
    addresses = [w.call("create_producer", k, s, engine_id, incarnation, config)
                 for w, k, s in zip(workers, keys, specs, strict=True)]
    if len(specs) > 1:
        for w, k in zip(workers, keys, strict=True):
            w.call("set_engine_addresses", k, addresses)
    return EngineRanks(list(workers), keys, list(specs), addresses, engine_id, incarnation)


def start_consumers(workers: Sequence[Worker], specs: Sequence[RankSpec], config=None) -> EngineRanks:
    engine_id = f"decode-{uuid.uuid4().hex[:6]}"
    keys = [f"{engine_id}-{s.tp_rank}" for s in specs]
    for w, k, s in zip(workers, keys, specs, strict=True):
        w.call("create_consumer", k, s, config, engine_id)
    return EngineRanks(list(workers), keys, list(specs), engine_id=engine_id)


def hold_everywhere(producers: EngineRanks, request_id: str, layout, seed: int | None) -> bytes:
    """Hold a request on every producer rank (rank 0 draws the nonce); returns rank 0's ticket bytes."""
    from hybrid_transfer.engine import decode_ticket

    first = producers.workers[0].call("fill_and_hold", producers.keys[0], request_id, layout, seed, None)
    nonce = decode_ticket(first).nonce
    for w, k in zip(producers.workers[1:], producers.keys[1:], strict=True):
        other = w.call("fill_and_hold", k, request_id, layout, seed, nonce)
        if other != first:
            raise AssertionError(f"rank {k} issued a different ticket for {request_id}")
    return first
