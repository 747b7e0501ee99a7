"""The planner: one consumer rank's reads from one producer engine, per request (docs/planner.md).

Build a Planner once per (local rank, remote engine) from the handshake's
RankDescriptors; it checks the topology and precomputes per-source templates.
Each ``plan()`` call then does block-id arithmetic, a vectorised merge over the
pieces of one shared tensor, and a broadcast over the tensors' base addresses.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from typing import NamedTuple

import numpy as np

from hybrid_transfer.errors import FingerprintMismatch, PlanError, TopologyError
from hybrid_transfer.layout.geometry import RankGeometry
from hybrid_transfer.layout.model import LayerKind, ModelSpec
from hybrid_transfer.plan.batch_checks import check_plans
from hybrid_transfer.plan.batch_rows import (
    Broadcast,
    IdCheck,
    Spreader,
    merge_rows,
    segment_bounds,
    stacked,
)
from hybrid_transfer.plan.cost import CostModel
from hybrid_transfer.plan.merge import merge_ranges
from hybrid_transfer.plan.pack import PackRecipe, pack_recipe, structure_recipe
from hybrid_transfer.plan.pieces import (
    Recipe,
    SegmentFrame,
    last_cut,
    naive_token_end,
    recipe,
    segment_frame,
    structure_end,
)
from hybrid_transfer.plan.rank import RankDescriptor, geometry_from_descriptor
from hybrid_transfer.plan.stage_layout import map_rows, stage_layout
from hybrid_transfer.plan.templates import (
    SOURCE_MASK,
    SOURCE_SHIFT,
    SourceTemplate,
    assign_kv_heads,
    kv_template,
    stack_templates,
    state_template,
)
from hybrid_transfer.plan.topology import Topology
from hybrid_transfer.plan.types import Notification, PackSourcePlan, PlanMode, ReadPlan, SourcePlan
from hybrid_transfer.plan.validate import (
    RegionTable,
    block_id_arrays,
    check_first_token,
    plain_int64s,
    validate_block_ids,
    validate_plan,
)

_FRAME_CACHE_SIZE = 64
_SEEN_CACHE_SIZE = 1024
# draft_layers / speculative_slots: another map of layers to tensors, another conv window (docs/layout.md#draft-layers).
_LAYOUT_FIELDS = ("conv_layout", "ssm_order", "kv_layout", "kv_interior", "draft_layers", "speculative_slots")
_NOT_AFFINE = object()  # a structure whose pack recipe is not one per structure: keyed on the exact count
# Every dtype a descriptor carries must be equal on both sides (an item size read with the other side's dtype is
# wrong bytes, not an error): found by name, so a dtype field added to RankDescriptor is checked without an edit.
_DTYPE_FIELDS = tuple(f for f in RankDescriptor.__struct_fields__ if f.endswith("_dtype"))


class Planner:
    """Plans one consumer rank's reads of a request's cache from the ranks of one producer engine.

    Args:
        model: the model both engines serve.
        local: this consumer rank's descriptor.
        remotes: every rank of the producer engine, index == tp_rank.
        cost: cost model for ``PlanMode.AUTO`` (defaults: docs/tuning.md#cost-model).

    Raises:
        TopologyError: the TP sizes cannot be mapped, or the remote list is malformed.
        FingerprintMismatch: the two sides differ in a field that must be equal (dtypes, layouts).
        PlanError: a descriptor disagrees with its own geometry.
    """

    def __init__(self, model: ModelSpec, local: RankDescriptor, remotes: Sequence[RankDescriptor], *,
                 cost: CostModel | None = None):
        self.model = model
        self.cost = cost or CostModel()
        self.local_desc = local
        self.remote_descs = tuple(remotes)
        self.local = geometry_from_descriptor(model, local)
        prefill_tp = self._check_remotes(local.tp_size)
        self.topology = Topology(prefill_tp=prefill_tp, decode_tp=local.tp_size, decode_rank=local.tp_rank)
        self._notify = self.topology.notify  # the same for every request
        # Every remote descriptor is checked against its geometry, not only the ones this rank reads.
        all_geos = [geometry_from_descriptor(model, d) for d in self.remote_descs]
        geos = {s: all_geos[s] for s in self.topology.sources}
        self._check_equal_fields(all_geos)
        self.remote = geos[self.topology.sources[0]]  # block sizes are equal across the engine
        self._check_opaque_interior()
        pairs = assign_kv_heads(self.local, geos)
        self.templates: tuple[SourceTemplate, ...] = tuple(
            SourceTemplate(
                source_rank=s,
                geometry=geos[s],
                kv=kv_template(self.local, geos[s], pairs[s]),
                state=state_template(self.local, geos[s]),
                tensor_addrs=np.asarray(self.remote_descs[s].tensor_addrs, dtype=np.int64),
                device_id=self.remote_descs[s].device_id,
                num_blocks=self.remote_descs[s].num_blocks,
            )
            for s in self.topology.sources
        )
        self._check_state_coverage()
        self._local_base = np.asarray(local.tensor_addrs, dtype=np.int64)
        self._local_regions = RegionTable(local.tensor_addrs, local.region_bytes)
        self._remote_regions = {t.source_rank: RegionTable(self.remote_descs[t.source_rank].tensor_addrs,
                                                           self.remote_descs[t.source_rank].region_bytes)
                                for t in self.templates}
        self._remote_num_blocks = min(t.num_blocks for t in self.templates)
        biggest = max(d.region_bytes for d in self.remote_descs)
        if biggest >> SOURCE_SHIFT:
            raise PlanError(f"remote region of {biggest} B is too large to plan", region_bytes=biggest)
        tensor_map = self.local.tensor_map
        groups = tensor_map.groups
        # A padded group's pieces broadcast onto the tensors holding its layers only (None: every group on every one).
        self._group_tensors = tensor_map.group_tensors if tensor_map.is_padded else None
        self._tensor_index = np.arange(self.local.num_tensors, dtype=np.int64)[:, None]
        self._kinds = tuple(g.kind for g in groups)
        self._attn_groups = tuple(i for i, g in enumerate(groups) if g.kind is LayerKind.ATTENTION)
        self._gdn_groups = np.array([i for i, g in enumerate(groups) if g.kind is LayerKind.GDN], dtype=np.int64)
        self._frames: dict[int, SegmentFrame] = {}
        # Per segment structure (last cut, mode, list lengths); a token end patches the last segment's lengths.
        self._recipes: dict[tuple, Recipe] = {}
        self._plan_fields: dict[tuple, tuple[int, dict, int]] = {}  # _read_plan's per-shape numbers (bounded)
        self._packs: dict[tuple, PackRecipe | object] = {}  # per segment structure (or exact count) and source
        self._pack_seen: dict[tuple, None] = {}  # structures planned once in pack mode (insertion-ordered)
        self._pack_last: dict[tuple, PackRecipe] = {}  # a structure's recipe at the last count planned
        self._auto: dict[tuple, bool] = {}  # auto's choice per segment structure and cost model: pack or not
        self._kv, self._state = stack_templates(self.templates)
        # [tensor, source index]: each source's base address of each shared tensor.
        self._remote_base = np.stack([t.tensor_addrs for t in self.templates], axis=1)
        self._local_page = self.local.page_bytes
        self._remote_page = self.remote.page_bytes
        self._kv_bytes_per_token = self.local.kv_bytes_per_token * self.local.num_attention_layers
        self._state_bytes = self.local.state_bytes_per_request
        self._kv_stride = self.local.kv_token_stride  # a geometry property, computed on every read
        self._broadcast = Broadcast(np.stack((self._local_base, self._remote_base[:, 0]))[:, :, None],
                                    self._remote_base,
                                    np.array([[self._local_page], [self._remote_page]], dtype=np.int64),
                                    len(self.templates), self._group_tensors is not None, local.region_bytes)
        self._rows_follow = self._row_shortcut()
        self._kv_layout_name = self.local.kv_layout.value  # an enum's value is a property: cached for every plan
        self._spreader = Spreader(self._broadcast)
        self._id_check = IdCheck(self.local_desc.num_blocks, self._remote_num_blocks)
        self._counts: dict[tuple, bool] = {}  # _counts_fine per (list lengths, blocks needed)

    # ---- construction checks -------------------------------------------------
    def _check_remotes(self, decode_tp: int) -> int:
        if not self.remote_descs:
            raise TopologyError("the producer engine lists no ranks", prefill_tp=0, decode_tp=decode_tp)
        prefill_tp = self.remote_descs[0].tp_size
        ranks = [d.tp_rank for d in self.remote_descs]
        sizes = {d.tp_size for d in self.remote_descs}
        if sizes != {prefill_tp} or ranks != list(range(prefill_tp)):
            raise TopologyError(f"remote descriptors must be every rank of one engine in order, got ranks {ranks} "
                                f"of TP sizes {sorted(sizes)}", prefill_tp=prefill_tp, decode_tp=decode_tp,
                                ranks=ranks)
        for name in ("block_size", "kernel_block_size"):
            values = {getattr(d, name) for d in self.remote_descs}
            if len(values) != 1:
                raise TopologyError(f"remote ranks disagree on {name}: {sorted(values)}", prefill_tp=prefill_tp,
                                    decode_tp=decode_tp, field=name)
        return prefill_tp

    def _check_equal_fields(self, remotes: Sequence[RankGeometry]) -> None:
        """Layouts and dtypes equal on every rank; a dtype is compared as each geometry resolves it (a
        descriptor's empty ``conv_dtype`` means the model dtype)."""
        diffs = []
        for name in (*_DTYPE_FIELDS, *_LAYOUT_FIELDS):
            ours = _resolved(name, self.local_desc, self.local)
            for desc, geometry in zip(self.remote_descs, remotes, strict=True):
                theirs = _resolved(name, desc, geometry)
                if theirs != ours:
                    diffs.append((name, ours, theirs))
                    break
        if diffs:
            raise FingerprintMismatch(diffs)

    def _check_opaque_interior(self) -> None:
        """A kernel page whose interior is not token-major moves whole, so it must be one page on both sides."""
        if self.local.is_token_major or self.local.kernel_block_size == self.remote.kernel_block_size:
            return
        raise TopologyError(f"kernel block sizes {self.remote.kernel_block_size} (prefill) and "
                            f"{self.local.kernel_block_size} (decode) differ and the page interior "
                            f"{self.local.kv_interior!r} is not token-major: its kernel pages cannot be re-blocked "
                            "(docs/attention-layouts.md#page-interiors)", prefill_tp=self.topology.prefill_tp,
                            decode_tp=self.topology.decode_tp, field="kernel_block_size")

    def _check_state_coverage(self) -> None:
        if not self.local.has_gdn:
            return
        got = sum(int(t.state.length.sum()) for t in self.templates)
        if got != self.local.state_page_bytes:
            raise TopologyError(f"sources {list(self.topology.sources)} cover {got} of the "
                                f"{self.local.state_page_bytes} state bytes of a page",
                                prefill_tp=self.topology.prefill_tp, decode_tp=self.topology.decode_tp)

    # ---- per request ---------------------------------------------------------
    @property
    def notify(self) -> tuple[Notification, ...]:
        """Producer ranks to notify after every request, with the consumer count each must expect."""
        return self._notify

    def expected_bytes(self, num_tokens: int, first_token: int = 0) -> int:
        """Valid payload bytes this rank receives for a request (``validate.expected_bytes``, precomputed)."""
        return (num_tokens - first_token) * self._kv_bytes_per_token + (self._state_bytes if num_tokens > 0 else 0)

    def planned_bytes(self, num_tokens: int, mode: PlanMode = PlanMode.COALESCED, first_token: int = 0) -> int:
        """Bytes a plan of ``mode`` moves: the valid payload, except naive, which moves whole pages like vLLM,
        and a partial kernel page of an interior that is not token-major, which moves whole."""
        if mode is PlanMode.NAIVE or (type(mode) is not PlanMode and PlanMode(mode) is PlanMode.NAIVE):
            end = naive_token_end(num_tokens, self.local, self.remote)
        else:
            end = self.local.moved_token_end(num_tokens)
        return (end - first_token) * self._kv_bytes_per_token + (self._state_bytes if num_tokens > 0 else 0)

    def plan(self, local_block_ids: Sequence[Sequence[int]], remote_block_ids: Sequence[Sequence[int]],
             num_tokens: int, mode: PlanMode = PlanMode.COALESCED, *, validate: bool = True,
             cost: CostModel | None = None, first_token: int = 0) -> ReadPlan:
        """Plan one request: block ids per cache group (tensor_map.groups order) on each side.

        In pack mode (and for the sources ``auto`` packs, decided by ``cost`` or this planner's cost
        model) each source's plan is the path the engine runs: see PackSourcePlan.

        ``first_token`` > 0: the decode side already holds tokens [0, first_token) (a local prefix hit, on a
        local block boundary): only the attention bytes of [first_token, num_tokens) move, and the state at
        ``num_tokens``; both id lists still cover the whole request. Such a plan is direct (coalesced), never
        packed (docs/planner.md#prefix-hits).

        Raises:
            PlanError: when ``validate``, a subclass naming the bad values (GroupCountError,
                BlockCountError, BlockIdError, DuplicateBlockError, RangeError, OverlapError,
                ByteCountError).
        """
        mode = PlanMode(mode)
        req = self._parse(local_block_ids, remote_block_ids, num_tokens, first_token, mode)
        if validate:
            error = self._id_error(req)
            if error is not None:
                raise error
        plans, fine = self._build([req], mode, cost or self.cost)
        if validate and not fine:
            validate_plan(plans[0], self._local_regions, self._remote_regions)
        return plans[0]

    def plan_many(self, items: Sequence[tuple], mode: PlanMode = PlanMode.COALESCED, *,
                  cost: CostModel | None = None) -> list[ReadPlan | PlanError]:
        """``plan`` for every (local ids, remote ids, num_tokens[, first_token]) of a step: a plan, or the PlanError
        ``plan`` raises for that request alone. Every request's rows are built, and checked, in one numpy pass
        (plan/batch_rows.py); a step that pass does not clear is checked again per request for the exact error
        (plan/batch_checks.py)."""
        mode = mode if type(mode) is PlanMode else PlanMode(mode)
        out: list[ReadPlan | PlanError | None] = [None] * len(items)
        ok: list[int] = []
        reqs: list[_Request] = []
        parsed = self._parse_lists(items, mode)
        for i, (local, remote, n, *first) in enumerate(items):
            try:
                req = parsed[i] if parsed is not None else self._parse(local, remote, n, first[0] if first else 0,
                                                                       mode)
                if isinstance(req, PlanError):
                    raise req
            except PlanError as exc:
                out[i] = exc
                continue
            reqs.append(req)
            ok.append(i)
        if not self._ids_fine(reqs):
            keep = []
            for i, req in zip(ok, reqs, strict=True):
                out[i] = self._id_error(req)
                if out[i] is None:
                    keep.append((i, req))
            ok, reqs = [i for i, _ in keep], [req for _, req in keep]
        plans, fine = self._build(reqs, mode, cost or self.cost)
        if fine:
            errors: list[PlanError | None] = [None] * len(plans)
        else:
            errors = check_plans(plans, self._local_regions, self._remote_regions)
        for i, plan, error in zip(ok, plans, errors, strict=True):
            out[i] = error or plan
        return out  # type: ignore[return-value]

    def _parse(self, local: object, remote: object, num_tokens: object, first_token: object,
               mode: PlanMode) -> _Request:
        """A request's count, prefix hit and ids, checked in that order (``plan`` and ``plan_many`` alike): the
        typed errors of a bad count, first token, group count or id type."""
        count = _token_count(num_tokens)
        first = self._first_token(first_token, count, mode)
        parts_l, local_lens = self._id_parts("local", local)
        parts_r, remote_lens = self._id_parts("remote", remote)
        parts = parts_l + parts_r
        ids = parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else _EMPTY
        return _Request(count, first, ids, sum(local_lens), local_lens, remote_lens, local, remote)

    def _parse_lists(self, items: Sequence[tuple], mode: PlanMode) -> list[_Request | PlanError] | None:
        """``_parse`` of a whole step whose ids are all lists or tuples of plain ints (the consumer's proven
        copies and the tickets'): every request's ids in one conversion. None when any request's are of
        another form, or any id is not a plain int within int64 (each request is then parsed alone, which
        names the fault)."""
        groups = len(self._kinds)
        heads: list[tuple | PlanError] = []
        flat: list[int] = []
        for local, remote, n, *first in items:
            if type(local) not in _SEQUENCES or type(remote) not in _SEQUENCES or len(local) != groups \
                    or len(remote) != groups or not _SEQUENCES.issuperset(map(type, local)) \
                    or not _SEQUENCES.issuperset(map(type, remote)):
                return None
            try:
                count = _token_count(n)
                head: tuple | PlanError = (count, self._first_token(first[0] if first else 0, count, mode))
            except PlanError as exc:
                heads.append(exc)  # ``_parse`` checks the count and the first token before the ids
                continue
            local_lens, remote_lens = tuple(map(len, local)), tuple(map(len, remote))
            heads.append((*head, local_lens, remote_lens, local, remote))
            flat.extend(chain.from_iterable(local))
            flat.extend(chain.from_iterable(remote))
        if not plain_int64s(flat):
            return None
        ids = np.array(flat, dtype=np.int64) if flat else _EMPTY
        out: list[_Request | PlanError] = []
        at = 0
        for head in heads:
            if isinstance(head, PlanError):
                out.append(head)
                continue
            count, first_token, local_lens, remote_lens, local, remote = head
            local_len = sum(local_lens)
            end = at + local_len + sum(remote_lens)
            out.append(_Request(count, first_token, ids[at:end], local_len, local_lens, remote_lens, local, remote))
            at = end
        return out

    def _id_parts(self, side: str, block_ids: object) -> tuple[list[np.ndarray], tuple[int, ...]]:
        """A side's ids as int64 arrays whose concatenation is its groups' in group order, and each group's
        length: ``block_id_arrays`` without a numpy call per group where the groups are int64 arrays (the
        consumer's converted ids) or lists or tuples of Python ints (a ticket's), which convert in one; any
        other input takes ``block_id_arrays`` itself, which raises what a bad one gets."""
        if len(block_ids) == len(self._kinds):  # type: ignore[arg-type]
            groups = list(block_ids)  # type: ignore[call-overload]
            kinds = set(map(type, groups))
            if kinds == _ARRAY:
                if set(map(_dtype_of, groups)) == _INT64_1D:
                    return groups, tuple(map(len, groups))
            elif kinds <= _SEQUENCES:
                flat = list(chain.from_iterable(groups))
                if plain_int64s(flat):
                    return [np.array(flat, dtype=np.int64)], tuple(map(len, groups))
        arrays = block_id_arrays(side, block_ids, len(self._kinds))  # type: ignore[arg-type]
        return arrays, tuple(a.shape[0] for a in arrays)

    def _counts_fine(self, req: _Request) -> bool:
        """List lengths as ``validate_block_ids`` wants them on both sides (cached per lengths and need)."""
        need_l = -(-req.num_tokens // self.local.block_size)
        need_r = -(-req.num_tokens // self.remote.block_size)
        key = (req.local_lens, req.remote_lens, need_l, need_r)
        got = self._counts.get(key)
        if got is None:
            got = all((nl == 1 and nr == 1) if k is LayerKind.GDN else (nl >= need_l and nr == need_r)
                      for k, nl, nr in zip(self._kinds, req.local_lens, req.remote_lens, strict=True))
            if len(self._counts) >= _SEEN_CACHE_SIZE:
                self._counts.pop(next(iter(self._counts)))
            self._counts[key] = got
        return got

    def _ids_fine(self, reqs: Sequence[_Request]) -> bool:
        """Every request's ids certainly pass ``validate_block_ids`` on both sides (strict: False is no error)."""
        return all(self._counts_fine(r) for r in reqs) and (
            not reqs or self._id_check([r.ids for r in reqs], [r.local_len for r in reqs]))

    def _row_shortcut(self) -> bool:
        """Whether a plan's rows are sure to pass ``validate_plan`` once its ids pass ``validate_block_ids`` and its
        shape's pieces lie in their pages (batch_rows.Fit): every region is its tensor's ``num_blocks`` pages of
        the page size the planner uses, the local regions do not overlap (rows of two tensors then never do),
        and no region's end passes int64."""
        descs = [self.local_desc, *(self.remote_descs[t.source_rank] for t in self.templates)]
        pages = [self._local_page] + [self._remote_page] * len(self.templates)
        if any(d.page_bytes != page for d, page in zip(descs, pages, strict=True)):
            return False
        if any(max(d.tensor_addrs, default=0) + d.region_bytes >= 1 << 63 for d in descs):
            return False
        starts = sorted(self.local_desc.tensor_addrs)
        size = self.local_desc.region_bytes
        return all(b >= a + size for a, b in zip(starts, starts[1:], strict=False))

    def _id_error(self, req: _Request) -> PlanError | None:
        """``validate_block_ids``'s error for a request, local side first, or None (the fast check first)."""
        if self._ids_fine([req]):
            return None
        num_groups = len(self._kinds)
        try:
            validate_block_ids("local", block_id_arrays("local", req.local, num_groups), self._kinds,
                               req.num_tokens, self.local.block_size, self.local_desc.num_blocks, exact=False,
                               flat=req.ids[:req.local_len])
            validate_block_ids("remote", block_id_arrays("remote", req.remote, num_groups), self._kinds,
                               req.num_tokens, self.remote.block_size, self._remote_num_blocks, exact=True,
                               flat=req.ids[req.local_len:])
        except PlanError as exc:
            return exc
        return None

    def _first_token(self, first_token: object, num_tokens: int, mode: PlanMode) -> int:
        """A prefix hit's end, checked: on a local block boundary and within the request; naive mode moves whole
        requests only. (An interior that is not token-major has one kernel block size on both sides,
        ``_check_opaque_interior``, so a local block boundary is a kernel page boundary of both.)"""
        first = check_first_token(_token_count(first_token, "first_token"), num_tokens, self.local.block_size)
        if first and mode is PlanMode.NAIVE:
            raise PlanError(f"first_token={first} cannot start a naive plan, which moves whole requests",
                            first_token=first, num_tokens=num_tokens)
        return first

    def _read_plan(self, sources: Sequence[SourcePlan | PackSourcePlan], num_tokens: int, mode: PlanMode,
                   first_token: int = 0) -> ReadPlan:
        # A step's requests share their shape: the byte counts and source modes are worked out once per shape.
        key = (num_tokens, mode, first_token, tuple((src.source_rank, type(src)) for src in sources))
        got = self._plan_fields.get(key)
        if got is None:
            if len(self._plan_fields) >= _FRAME_CACHE_SIZE:
                self._plan_fields.pop(next(iter(self._plan_fields)))
            got = self._plan_fields[key] = (
                self.planned_bytes(num_tokens, mode, first_token),
                {src.source_rank: _mode_of(src, mode).value for src in sources},
                self.expected_bytes(num_tokens, first_token))
        planned, modes, valid = got
        return ReadPlan(
            decode_rank=self.local.tp_rank,
            mode=mode,
            sources=tuple(sources),
            notify=self._notify,
            num_tokens=num_tokens,
            expected_bytes=planned,
            meta={"source_modes": dict(modes), "valid_bytes": valid, "kv_layout": self._kv_layout_name,
                  "first_token": first_token},
        )

    def _frame(self, token_end: int, first_token: int = 0) -> SegmentFrame:
        key = (token_end, first_token)
        frame = self._frames.get(key)
        if frame is None:
            if len(self._frames) >= _FRAME_CACHE_SIZE:
                self._frames.pop(next(iter(self._frames)))
            frame = self._frames[key] = segment_frame(token_end, self.local, self.remote, first_token)
        return frame

    def _recipe(self, token_end: int, naive: bool, local_lens: tuple[int, ...],
                remote_lens: tuple[int, ...], first_token: int = 0) -> Recipe:
        cut = last_cut(token_end, self.local, self.remote, first_token)
        key = (cut, naive, local_lens, remote_lens, first_token)
        rec = self._recipes.get(key)
        if rec is None:
            if len(self._recipes) >= _FRAME_CACHE_SIZE:
                self._recipes.pop(next(iter(self._recipes)))
            rec = self._recipes[key] = stacked(
                recipe(self._frame(token_end, first_token), self._kv, self._state, self._attn_groups,
                       self._gdn_groups, local_lens, remote_lens, naive, self._group_tensors),
                sum(local_lens), self.local.num_tensors, self._broadcast.pages)
            return rec
        return rec.with_tail((token_end - cut) * self._kv_stride)

    def _pack(self, rec: Recipe, index: int, num_tokens: int, local_lens: tuple[int, ...],
              remote_lens: tuple[int, ...]) -> PackRecipe | None:
        """The structure's pack recipe from its second request on; None the first time (the caller maps the
        direct rows, ``to_pack``, which costs less than building the recipe when the structure never recurs).

        Keyed like the direct Recipe, on the segment structure (``structure_recipe``); a structure whose
        arrays do not follow the count by whole bytes per token is keyed on the exact count instead."""
        cut = last_cut(num_tokens, self.local, self.remote)
        tpl, stride = self.templates[index], self._kv_stride

        def build(n: int) -> PackRecipe:
            return pack_recipe(rec.with_tail((n - cut) * stride), index, tpl, self._local_base, self._local_page,
                               self._remote_page, remote_lens, n)

        if not self.local.is_token_major:  # counts come in whole kernel pages: few, and not affine within one
            return self._cached_pack(("exact", num_tokens, local_lens, remote_lens, index), lambda: build(num_tokens))
        key = (cut, local_lens, remote_lens, index)
        pack = self._cached_pack(key, lambda: structure_recipe(
            build, cut, structure_end(cut, self.local, self.remote)) or _NOT_AFFINE)
        if pack is _NOT_AFFINE:
            return self._cached_pack(("exact", num_tokens, local_lens, remote_lens, index), lambda: build(num_tokens))
        if pack is None or pack.num_tokens == num_tokens:
            return pack
        # The structure's arrays at its last count only: a repeated count reuses them, and counts that vary
        # (serving) do not keep a copy each (fresh memory per plan cost more than the copy saves).
        at = self._pack_last.get(key)
        if at is None or at.num_tokens != num_tokens:
            if at is None and len(self._pack_last) >= _FRAME_CACHE_SIZE:
                self._pack_last.pop(next(iter(self._pack_last)))
            at = self._pack_last[key] = pack.at(num_tokens)
        return at

    def _cached_pack(self, key: tuple, build) -> PackRecipe | object | None:
        pack = self._packs.get(key)
        if pack is None:
            if key not in self._pack_seen:
                if len(self._pack_seen) >= _SEEN_CACHE_SIZE:
                    self._pack_seen.pop(next(iter(self._pack_seen)))
                self._pack_seen[key] = None
                return None
            if len(self._packs) >= _FRAME_CACHE_SIZE:
                self._packs.pop(next(iter(self._packs)))
            pack = self._packs[key] = build()
        return pack

    def _auto_packs(self, num_tokens: int, local_lens: tuple[int, ...], remote_lens: tuple[int, ...],
                    cost: CostModel) -> bool:
        """Auto's choice for every request of this segment structure: pack all sources, or none.

        Decided once per (structure, cost model) on the structure's fragmented direct plan: its last
        count, block ids two apart so that no two blocks merge (the count a churned pool gives), never
        on one request's ids. So a shape and a geometry get one mode on every rank and in every round
        (docs/planner.md#auto)."""
        cut = last_cut(num_tokens, self.local, self.remote)
        key = (cut, local_lens, remote_lens, cost)
        got = self._auto.get(key)
        if got is None:
            end = structure_end(cut, self.local, self.remote)
            counts, nbytes = self.fragmented_counts(end, local_lens, remote_lens)
            if len(self._auto) >= _SEEN_CACHE_SIZE:
                self._auto.pop(next(iter(self._auto)))
            got = self._auto[key] = cost.choose_all(counts, nbytes) is PlanMode.PACK
        return got

    def fragmented_counts(self, num_tokens: int, local_lens: tuple[int, ...],
                          remote_lens: tuple[int, ...]) -> tuple[list[int], list[int]]:
        """(descriptors, bytes) per source read of a coalesced plan of this shape whose ids never adjoin."""
        rec = self._recipe(num_tokens, False, local_lens, remote_lens)
        spread_l = np.arange(sum(local_lens), dtype=np.int64) * 2
        spread_r = np.arange(sum(remote_lens), dtype=np.int64) * 2
        pieces = rec.pieces(spread_l, spread_r, self._local_page, self._remote_page)
        rel_l, rel_r, rel_len, ntens = self._merge(rec, pieces)
        src = rel_l >> SOURCE_SHIFT
        if ntens is None:
            tensors = self._local_base.shape[0]
            counts = np.bincount(src, minlength=len(self.templates)) * tensors
            nbytes = np.bincount(src, weights=rel_len, minlength=len(self.templates)) * tensors
        else:
            counts = np.bincount(src, weights=ntens, minlength=len(self.templates)).astype(np.int64)
            nbytes = np.bincount(src, weights=rel_len * ntens, minlength=len(self.templates))
        return ([int(c) for c in counts if c], [int(b) for c, b in zip(counts, nbytes, strict=True) if c])

    def _merge(self, rec: Recipe, pieces) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
        """Merged (local, remote, length) pieces of one tensor and, with padded groups, the tensors each covers.

        Pieces of groups on different tensor counts must not merge: their remote offsets carry
        ``num_tensors - count`` above SOURCE_SHIFT through the merge, which keeps them apart."""
        if rec.tensors is None:
            return (*merge_ranges(pieces.local_off, pieces.remote_off, pieces.length, pieces.key), None)
        num_tensors = self._tensor_index.shape[0]
        tagged = pieces.remote_off + ((num_tensors - rec.tensors) << SOURCE_SHIFT)
        rel_l, rel_r, rel_len = merge_ranges(pieces.local_off, tagged, pieces.length, pieces.key)
        return rel_l, rel_r & SOURCE_MASK, rel_len, num_tensors - (rel_r >> SOURCE_SHIFT)

    def _build(self, reqs: Sequence[_Request], mode: PlanMode,
               cost: CostModel) -> tuple[list[ReadPlan], bool]:
        """Every request's plan (batch_rows.py): each request's pieces from its shape's cached recipe, all merged
        in one pass, one broadcast over tensors, then one plan per request; and whether every plan is sure to
        pass ``validate_plan`` (its ids checked: ``_row_shortcut`` and the shape's ``Fit``)."""
        naive = mode is PlanMode.NAIVE
        jobs, built = [], []
        for req in reqs:
            if req.num_tokens <= 0:
                continue
            # A kernel page whose interior is not token-major moves whole (docs/attention-layouts.md); naive is
            # vLLM 0.33's scheme: whole pages, the unused tail of the last one included.
            moved = req.num_tokens if naive else self.local.moved_token_end(req.num_tokens)
            token_end = naive_token_end(moved, self.local, self.remote) if naive else moved
            rec = self._recipe(token_end, naive, req.local_lens, req.remote_lens, req.first_token)
            jobs.append((rec, req.ids))
            built.append((req, rec, moved))
        plans = []
        fine = self._rows_follow
        if jobs:
            merged = merge_rows(jobs, self._broadcast)
            num_sources = len(self.templates)
            seg = segment_bounds(merged, num_sources)
            loc, rem, length, out = self._spreader.spread(merged, seg)
            ld = self.local_desc.device_id
            for j, (req, rec, moved) in enumerate(built):
                sources = []
                # A prefix hit's read starts past token 0, where no staging layout starts: it stays direct.
                packs = not req.first_token and (mode is PlanMode.PACK or (
                    mode is PlanMode.AUTO and self._auto_packs(moved, req.local_lens, req.remote_lens, cost)))
                for i, tpl in enumerate(self.templates):
                    k = j * num_sources + i
                    if seg[k] == seg[k + 1]:
                        continue
                    a, b = out[k], out[k + 1]
                    direct = SourcePlan(tpl.source_rank, loc[a:b], rem[a:b], length[a:b], ld, tpl.device_id)
                    sources.append(self._packed(direct, i, tpl, req, rec, moved) if packs else direct)
                plan = self._read_plan(sources, req.num_tokens, mode, req.first_token)
                fine = fine and rec.fit.holds(rec.head, plan.expected_bytes)  # type: ignore[attr-defined]
                plans.append(plan)
        it = iter(plans)
        plans = [next(it) if req.num_tokens > 0 else self._read_plan((), req.num_tokens, mode, req.first_token)
                 for req in reqs]
        return plans, fine and all(p.expected_bytes == 0 for p in plans if p.num_tokens <= 0)

    def _packed(self, direct: SourcePlan, index: int, tpl: SourceTemplate, req: _Request, rec: Recipe,
                moved: int) -> PackSourcePlan:
        """One source's pack plan: mapped from its direct rows the first time its structure is seen, from the
        structure's cached PackRecipe after."""
        pack = self._pack(rec, index, moved, req.local_lens, req.remote_lens)
        if pack is None:
            remote_ids = block_id_arrays("remote", req.remote, len(self._kinds))
            return to_pack(direct, tpl, remote_ids, moved)
        return pack.pack(direct, req.ids[:req.local_len], req.ids[req.local_len:], moved)


class _Request(NamedTuple):
    """One request as ``_parse`` read it: ``ids`` holds the local ids then the remote ones, each side's groups
    concatenated in group order (``local_len`` local); ``local`` and ``remote`` are the ids as given (what the
    exact checks and a first pack read)."""

    num_tokens: int
    first_token: int
    ids: np.ndarray
    local_len: int
    local_lens: tuple[int, ...]
    remote_lens: tuple[int, ...]
    local: object
    remote: object


_ARRAY = {np.ndarray}
_SEQUENCES = frozenset((list, tuple))
_INT64_1D = {(np.dtype(np.int64), 1)}


def _dtype_of(a: np.ndarray) -> tuple[np.dtype, int]:
    return a.dtype, a.ndim


_EMPTY = np.empty(0, dtype=np.int64)


def _token_count(num_tokens: object, name: str = "num_tokens") -> int:
    """A token count as an int; a PlanError naming it when it is not a non-negative integer."""
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, (int, np.integer)) or num_tokens < 0:
        raise PlanError(f"{name}={num_tokens!r} must be a non-negative integer", **{name: num_tokens})
    return int(num_tokens)


def _mode_of(src: SourcePlan | PackSourcePlan, mode: PlanMode) -> PlanMode:
    if isinstance(src, PackSourcePlan):
        return PlanMode.PACK
    return PlanMode.NAIVE if mode is PlanMode.NAIVE else PlanMode.COALESCED


def to_pack(direct: SourcePlan, tpl: SourceTemplate, remote_block_ids: Sequence[Sequence[int]],
            num_tokens: int) -> PackSourcePlan:
    """Pack form of one source's direct rows: the source's canonical staging of the request, and this
    rank's read ranges and scatter pieces against it (plan/stage_layout.py).

    The planner uses this for a shape's first request and a per-shape PackRecipe (plan/pack.py) from
    its second on; tests check that both give the same plan.

    Raises:
        PlanError: the rows reach bytes the source's layout does not stage (a bug on one side).
    """
    layout = stage_layout(tpl.geometry, tpl.tensor_addrs, remote_block_ids, num_tokens)
    return PackSourcePlan(direct, layout, map_rows(layout, direct.local_addr, direct.remote_addr, direct.length,
                                                   tpl.geometry.num_tensors))


def _resolved(name: str, desc: RankDescriptor, geometry: RankGeometry) -> object:
    """A descriptor field as the rank's geometry reads it: dtypes by their resolved name, the rest as sent."""
    if name in _DTYPE_FIELDS and hasattr(geometry, name):
        return getattr(geometry, name).value
    return getattr(desc, name)
