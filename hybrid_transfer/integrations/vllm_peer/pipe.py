"""A spawned process commanded through a pipe: ``(op, args)`` in, ``("ok", value)`` or ``("err", text)`` out.

The decode host (decode_host.py) serves its commands with ``serve``; the orchestrator ends the process
with ``close``. ``None`` on the pipe asks the serving loop to return.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

CLOSE_JOIN_S = 30.0  # how long close() waits for the process to return before it kills it


def serve(conn, handle: Callable[[str, tuple], Any], idle_s: float) -> None:
    """Answer each ``(op, args)`` with ``("ok", handle(op, args))``, or ``("err", type, message and traceback)``.

    Returns when ``None`` arrives; the pipe is polled every ``idle_s`` seconds meanwhile.
    """
    while True:
        if not conn.poll(idle_s):
            continue
        message = conn.recv()
        if message is None:
            return
        op, args = message
        try:
            reply = ("ok", handle(op, args))
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the process that asked
            reply = ("err", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        conn.send(reply)


def close(process, conn) -> None:
    """Ask a serving process to return (``None``), wait ``CLOSE_JOIN_S``, then kill it if it is still alive."""
    if process.is_alive():
        try:
            conn.send(None)
        except (BrokenPipeError, OSError):
            pass
        process.join(timeout=CLOSE_JOIN_S)
    if process.is_alive():
        process.kill()
        process.join()
