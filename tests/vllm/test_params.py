"""params.check_request_params: every field of a client's kv_transfer_params judged, the bad one named."""

from __future__ import annotations

import copy

import pytest
from flows import ticket_params

from hybrid_transfer.errors import TicketParamsError
from hybrid_transfer.integrations.vllm import params as kvp

N = 100


def _load() -> dict:
    params = ticket_params(N - 1)
    params.update(remote_engine_id="absent-prefill", remote_request_id="p-absent", remote_num_tokens=N - 1)
    return params


def _with(**changes) -> dict:
    params = _load()
    params.update(changes)
    return params


def _with_ticket(**changes) -> dict:
    params = _load()
    params[kvp.TICKET].update(changes)
    return params


def test_honest_params_pass_with_their_role():
    assert kvp.check_request_params(None).role is kvp.Role.NONE
    assert kvp.check_request_params({kvp.DO_REMOTE_DECODE: True}).role is kvp.Role.HAND_OFF
    # vLLM's NIXL proxy sends nulls for its own fields; vLLM itself adds remote_prefill_cached_tokens.
    assert kvp.check_request_params({kvp.DO_REMOTE_DECODE: True, kvp.DO_REMOTE_PREFILL: False,
                                     "remote_engine_id": None, "remote_block_ids": None}).role is kvp.Role.HAND_OFF
    judged = kvp.check_request_params(_with(remote_prefill_cached_tokens=0))
    assert judged.role is kvp.Role.LOAD and judged.ticket.num_tokens == N - 1
    assert kvp.check_request_params({**_load(), kvp.DO_REMOTE_PREFILL: False}).role is kvp.Role.NONE  # never read


@pytest.mark.parametrize(("params", "field"), [
    (["garbage"], "*"),
    ("do_remote_prefill", "*"),
    ({f"k{i}": None for i in range(kvp.MAX_PARAMS_KEYS + 1)}, "*"),
    ({kvp.DO_REMOTE_DECODE: True, kvp.TRUNCATED: True}, kvp.TRUNCATED),
    (_with(**{kvp.TRUNCATED: False}), kvp.TRUNCATED),
    (_with(do_remote_prefill="yes"), kvp.DO_REMOTE_PREFILL),
    (_with(do_remote_prefill=1), kvp.DO_REMOTE_PREFILL),
    ({kvp.DO_REMOTE_DECODE: "true"}, kvp.DO_REMOTE_DECODE),
    (_with(do_remote_decode=True), kvp.DO_REMOTE_PREFILL),
    (_with(remote_engine_id="x" * (kvp.MAX_ID_CHARS + 1)), "remote_engine_id"),
    (_with(remote_engine_id="another-engine"), "remote_engine_id"),
    (_with(remote_request_id=7), "remote_request_id"),
    (_with(remote_num_tokens=N), "remote_num_tokens"),
    (_with(remote_num_tokens=2**100000), "remote_num_tokens"),
    (_with(remote_prefill_cached_tokens=-1), "remote_prefill_cached_tokens"),
    (_with(remote_prefill_cached_tokens=True), "remote_prefill_cached_tokens"),
    ({kvp.DO_REMOTE_PREFILL: True}, kvp.TICKET),
    (_with(**{kvp.TICKET: "ticket"}), "*"),
    (_with_ticket(addresses=["garbage"]), "addresses"),
    (_with_ticket(tp_size=2**100000), "tp_size"),
    (_with_ticket(addresses=[f"tcp://127.0.0.1:{20000 + i}" for i in range(2000)], tp_size=2000), "tp_size"),
    (_with_ticket(version=2**100000), "version"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_each_bad_field_is_refused_by_name(params, field):
    with pytest.raises(TicketParamsError) as caught:
        kvp.check_request_params(copy.deepcopy(params))
    assert caught.value.field == field
    assert len(str(caught.value)) < 2000  # no echo of a huge value


def test_the_connectors_own_flag_passes_its_second_look():
    params = {kvp.DO_REMOTE_DECODE: True, kvp.TRUNCATED: True}
    assert kvp.check_request_params(params, internal_ok=True).role is kvp.Role.HAND_OFF


def test_the_worker_recheck_refuses_what_the_codec_refuses():
    import msgspec

    from hybrid_transfer.engine.ticket_params import ticket_from_params

    ticket = ticket_from_params(_load()[kvp.TICKET])
    assert kvp.recheck_ticket(ticket) == ticket
    with pytest.raises(TicketParamsError):
        kvp.recheck_ticket(msgspec.structs.replace(ticket, addresses=("garbage",)))
    with pytest.raises(TicketParamsError):
        kvp.recheck_ticket({"not": "a ticket"})
