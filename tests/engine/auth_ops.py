"""Worker-side helpers for the authentication tests (test_auth.py), run through harness ``call``.

A module of their own so spawned workers import them by name without the test module's imports.
"""

from __future__ import annotations

from hybrid_transfer.engine import wire


def record_sends(state, key) -> None:
    """Keep a copy of every notification a hosted rank's agent sends (what a wiretap would see)."""
    agent = state.ranks[key].engine.agent
    sent = state.extra[f"{key}/sent"] = []
    original = agent.send_notif

    def send(peer, message):
        sent.append((peer, bytes(message)))
        return original(peer, message)

    agent.send_notif = send


def replay_sent(state, key, kind_name) -> int:
    """Send again, byte for byte, every recorded notification whose inner kind is ``kind_name``."""
    agent = state.ranks[key].engine.agent
    replayed = 0
    for peer, message in list(state.extra[f"{key}/sent"]):
        env = wire.decode_envelope(message)
        if env.kind is not wire.Kind.SEALED:
            continue
        inner = wire.decode_envelope(wire.decode_body(env).message)
        if inner.kind.name == kind_name:
            agent.send_notif(peer, message)
            replayed += 1
    return replayed


def sealed_notify(state, key, peer, message) -> bool:
    """Send ``message`` sealed under the rank's real link: a consumer that holds the key but lies."""
    return state.ranks[key].engine._send(peer, message)


def rejections(state, key) -> dict:
    return dict(state.ranks[key].engine.rejections.counts)


def failure_causes(state, key) -> dict:
    return dict(state.ranks[key].engine.failure_causes)
