"""Read the protocol tables UCX prints with ``UCX_PROTO_INFO=y``: which transport really moved the bytes.

UCX (1.23.0, bundled in the nixl 1.5.1 wheels) prints one table per protocol selection, to its log
stream (stdout, or ``UCX_LOG_FILE``). Seen here for a two-process DRAM READ through NIXL:

    [1795959126.047886] [vm:8284 :0]   | init intra-node cfg#1                                            |
    [1795959126.047886] [vm:8284 :0]   | remote memory read by ucp_get*(multi) into host memory from host |
    [1795959126.047886] [vm:8284 :0]   +--------+-------------+-------------------------------------------+
    [1795959126.047886] [vm:8284 :0]   | Range  | Description |                  Config                   |
    [1795959126.047886] [vm:8284 :0]   | 0..inf | zero-copy   | cma/memory                                |

On an H200 (UCX 1.23.0, nixl-cu13 1.5.1), the VRAM READ between two processes, default settings, then with
``UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y``:

    | ht-doctor-reader intra-node cfg#2                                     |
    | remote memory read by ucp_get*(multi) into cuda/GPU0 from cuda/dev[1] |
    | 0..inf | software emulation | tcp/lo                                  |
    ...
    | 0..inf | zero-copy   | cuda_ipc/cuda                                  |

The first title line is ``<worker name> <scope> cfg#<n>`` (NIXL names the UCX worker after the agent;
scope is ``self`` for the process's own loopback endpoint, ``intra-node`` for a peer on this host), the
second names the operation and the memory types; each row maps a message size range to a protocol and
its ``transport/device`` lanes. A NIXL READ is a ``ucp_get``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

import msgspec

_PREFIX = re.compile(r"^\[[^\]]*\]\s*\[[^\]]*\]\s*")  # "[timestamp] [host:pid:thread]"
_BORDER = re.compile(r"^\+[-+]+\+$")
_LANE = re.compile(r"([A-Za-z][A-Za-z0-9_]*)/([A-Za-z0-9_:.\-]+)")
_RANGE = re.compile(r"^(\d+)(?:\.\.(\d+|inf))?$")


class ProtoRow(msgspec.Struct, frozen=True):
    """One size range of a protocol table."""

    min_bytes: int
    max_bytes: int | None  # None: no upper bound ("inf")
    description: str  # e.g. "zero-copy", "multi-frag copy-in"
    config: str  # e.g. "cma/memory", "50% on rc/mlx5_0:1 and 50% on rc/mlx5_1:1"
    transports: tuple[str, ...]  # transport names of the lanes, e.g. ("cma",)

    def covers(self, num_bytes: int) -> bool:
        return self.min_bytes <= num_bytes and (self.max_bytes is None or num_bytes <= self.max_bytes)


class ProtoTable(msgspec.Struct, frozen=True):
    """One protocol selection UCX printed."""

    worker: str  # UCX worker name (NIXL: the agent name)
    scope: str  # "self", "intra-node", ...
    operation: str  # e.g. "remote memory read by ucp_get*(multi) into host memory from host"
    rows: tuple[ProtoRow, ...]

    @property
    def is_read(self) -> bool:
        return "remote memory read" in self.operation or "ucp_get" in self.operation

    def transports_for(self, num_bytes: int) -> tuple[str, ...]:
        """Transports of the row covering a message of ``num_bytes`` (empty when none covers it)."""
        for row in self.rows:
            if row.covers(num_bytes):
                return row.transports
        return ()


def parse_proto_tables(lines: Iterable[str]) -> list[ProtoTable]:
    """Every protocol table in a UCX log, in print order; other log lines are skipped."""
    tables: list[ProtoTable] = []
    titles: list[str] = []
    rows: list[ProtoRow] = []
    in_rows = False

    def flush() -> None:
        if len(titles) >= 2 and rows:
            head = titles[0].split()
            worker = head[0] if head else ""
            scope = " ".join(w for w in head[1:] if not w.startswith("cfg#"))
            tables.append(ProtoTable(worker=worker, scope=scope, operation=titles[1], rows=tuple(rows)))

    for raw in lines:
        text = _PREFIX.sub("", raw.rstrip("\n")).strip()
        if not text or _BORDER.match(text):
            continue
        if not (text.startswith("|") and text.endswith("|")):
            continue
        cells = [c.strip() for c in text[1:-1].split("|")]
        if len(cells) == 1:
            if in_rows:  # a new title after rows: the previous table is complete
                flush()
                titles, rows, in_rows = [], [], False
            titles.append(cells[0])
        elif len(cells) == 3 and cells[0] == "Range":
            in_rows = True
        elif len(cells) == 3 and in_rows:
            row = _parse_row(*cells)
            if row is not None:
                rows.append(row)
    if in_rows:
        flush()
    return tables


def _parse_row(size_range: str, description: str, config: str) -> ProtoRow | None:
    match = _RANGE.match(size_range.replace(" ", ""))
    if match is None:
        return None
    low = int(match.group(1))
    high_text = match.group(2)
    high = low if high_text is None else (None if high_text == "inf" else int(high_text))
    transports = tuple(dict.fromkeys(m.group(1) for m in _LANE.finditer(config)))
    return ProtoRow(min_bytes=low, max_bytes=high, description=description, config=config, transports=transports)


def read_tables(tables: Sequence[ProtoTable], worker: str, memory_word: str) -> list[ProtoTable]:
    """READ (ucp_get) tables of one worker towards a peer (not ``self``) whose operation names ``memory_word``.

    ``memory_word`` is how UCX names the memory type in the operation line: "host" for DRAM ("into host
    memory from host"), "cuda" for GPU memory ("into cuda/GPU0 from cuda/dev[1]").
    """
    return [
        t for t in tables
        if t.worker == worker and t.is_read and t.scope != "self" and memory_word in t.operation
    ]
