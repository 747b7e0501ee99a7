"""Request flows shared by the connector tests: prefill -> ticket -> proxy -> decode."""

from __future__ import annotations

from driver import Engine, StepResult, run_until, through_json
from vllm.v1.request import RequestStatus

from hybrid_transfer.engine.ticket_params import ticket_to_params
from hybrid_transfer.engine.tickets import EngineCard, issue_ticket
from hybrid_transfer.integrations.vllm import params as kvp
from hybrid_transfer.layout.model import LayerKind

HYBRID_GROUPS = (LayerKind.ATTENTION, LayerKind.GDN, LayerKind.GDN, LayerKind.GDN)  # the tiny model, our order


def prefill(p: Engine, rid: str, num_tokens: int, *, others: tuple[Engine, ...] = (), add: bool = True) -> dict:
    """Run a handed-off request on the prefill engine (``add``: submit it first); return the params a
    proxy forwards to decode."""
    if add:
        p.add(rid, num_tokens, params={kvp.DO_REMOTE_DECODE: True})
    finished: dict[str, object] = {}

    def record(engine: Engine, result: StepResult) -> None:
        if engine is p:
            finished.update(result.finished)

    run_until(f"prefill of {rid}", lambda: rid in finished, [p, *others], on_step=record)
    output = finished[rid]
    assert output.kv_transfer_params is not None, f"{rid} finished without kv_transfer_params"
    return through_json(output.kv_transfer_params)


def start_decode(d: Engine, rid: str, num_tokens: int, params: dict, *, max_tokens: int = 2):
    """Add the decode request and take one step: it must wait for remote KVs with N-1 tokens counted."""
    request = d.add(rid, num_tokens, params=params, max_tokens=max_tokens)
    d.step()
    return request


def until_received(d: Engine, p: Engine, rid: str, *, extra: tuple[Engine, ...] = ()) -> StepResult:
    """Step both engines until decode reports ``rid`` finished receiving; return that step's result."""
    got: list[StepResult] = []

    def record(engine: Engine, result: StepResult) -> None:
        if engine is d and rid in result.finished_recving:
            got.append(result)

    run_until(f"decode receives {rid}", lambda: bool(got), [d, p, *extra], on_step=record)
    return got[0]


def drain(engines: tuple[Engine, ...], what: str = "both engines empty") -> None:
    run_until(what, lambda: all(e.is_empty() for e in engines), engines)


def waiting_for_kvs(d: Engine, rid: str) -> bool:
    return d.status(rid) is RequestStatus.WAITING_FOR_REMOTE_KVS


def ticket_params(num_tokens: int, *, group_kinds=HYBRID_GROUPS, address: str = "tcp://127.0.0.1:9",
                  block_size: int = 16) -> dict:
    """Decode params with a ticket from a prefill engine that is not there (the scheduler cannot tell)."""
    card = EngineCard(engine_id="absent-prefill", incarnation=7, tp_size=1, addresses=(address,), lease_s=30.0,
                      block_size=block_size, num_blocks=64, group_kinds=tuple(group_kinds), fingerprint="f")
    blocks = [list(range(1, 1 + -(-num_tokens // block_size))) if k is LayerKind.ATTENTION else [40 + i]
              for i, k in enumerate(group_kinds)]
    ticket = issue_ticket(card, "p-absent", blocks, num_tokens)
    return through_json({kvp.DO_REMOTE_PREFILL: True, kvp.DO_REMOTE_DECODE: False, kvp.TICKET: ticket_to_params(ticket)})
