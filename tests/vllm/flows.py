"""Request flows shared by the connector tests: prefill -> ticket -> proxy -> decode."""

from __future__ import annotations

from driver import Engine, StepResult, run_until, through_json
from vllm.v1.request import RequestStatus

from hybrid_transfer.integrations.vllm import params as kvp


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
