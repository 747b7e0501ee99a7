"""Hostile ``kv_transfer_params`` for the soak: a real ticket's JSON form with one field made hostile.

In vLLM a request's ``kv_transfer_params`` come from whoever sent the request, so the decode side
must refuse any of these with a typed error before a socket, connect or pin, and never end one DONE
(docs/soak.md#hostile-params). Each draw names the field it changed; the soak counts outcomes per field.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

Mutation = Callable[[dict[str, Any], random.Random], Any]


def _huge_int(_: dict, rng: random.Random) -> int:
    return 2 ** rng.choice((64, 100, 4096, 100_000))


def _huge_digits(_: dict, rng: random.Random) -> str:
    return "9" * rng.choice((20, 64, 5000))  # a decimal string past int64 (and past Python's str->int limit)


def _garbage_address(_: dict, rng: random.Random) -> list[str]:
    return [rng.choice(("garbage", "tcp://", "tcp://127.0.0.1:99999", "tcp://[::1", "ipc:///tmp/x",
                        "tcp://203.0.113.9:5600", "tcp://" + "a" * 300 + ":1", "tcp://127.0.0.1:-1"))]


def _many_addresses(p: dict, rng: random.Random) -> list[str]:
    return [f"tcp://127.0.0.1:{20000 + i}" for i in range(rng.choice((64, 2000)))]


def _other_port(p: dict, rng: random.Random) -> list[str]:
    # An allowed host with a port nobody listens on: the honest engine's link must not be poisoned.
    return [f"tcp://127.0.0.1:{rng.randrange(40000, 60000)}" for _ in p["addresses"]]


def _block_ids(p: dict, rng: random.Random) -> Any:
    return rng.choice(([[2 ** 70]], [[-1]], [list(range(100_000))], [[1.5]], "blocks", [[True]], [[]] * 5000))


def _mac(p: dict, rng: random.Random) -> str:
    return rng.choice(("zz", "00" * 32, "ab" * 200, ""))


MUTATIONS: dict[str, Mutation] = {
    "addresses:garbage": _garbage_address,
    "addresses:2000": _many_addresses,
    "addresses:other_port": _other_port,
    "tp_size": lambda p, rng: rng.choice((0, -1, _huge_int(p, rng), "2", 1.0, True)),
    "version": lambda p, rng: rng.choice((_huge_int(p, rng), -1, "7", None)),
    "nonce": lambda p, rng: rng.choice((_huge_digits(p, rng), "-1", "0x10", 5, "")),
    "incarnation": lambda p, rng: rng.choice((_huge_digits(p, rng), "abc", -3)),
    "engine_id": lambda p, rng: rng.choice(("x" * 100_000, 12, "", None)),
    "request_id": lambda p, rng: rng.choice(("r" * 10_000, 7, None)),
    "block_ids": _block_ids,
    "num_tokens": lambda p, rng: rng.choice((-1, _huge_int(p, rng), 1e300, "5")),
    "state_position": lambda p, rng: rng.choice((-1, _huge_int(p, rng), p["num_tokens"] + 1)),
    "lease_s": lambda p, rng: rng.choice((float("nan"), float("inf"), -1.0, 0.0, "10")),
    "mac": _mac,
    "unknown_key": None,  # an extra key (the connector's own keys among them)
    "not_a_dict": None,
}
_UNKNOWN_KEYS = ("do_remote_decode", "do_remote_prefill", "remote_engine_id", "x" * 300, "")


def draw(params: dict[str, Any], rng: random.Random) -> tuple[str, Any]:
    """One hostile copy of ``params`` (a real ticket's JSON form): (the field it changed, the copy)."""
    field = rng.choice(sorted(MUTATIONS))
    if field == "not_a_dict":
        return field, rng.choice(([params], "ticket", 7, None))
    bad = dict(params)
    if field == "unknown_key":
        bad[rng.choice(_UNKNOWN_KEYS)] = True
        return field, bad
    bad[field.split(":")[0]] = MUTATIONS[field](params, rng)
    return field, bad
