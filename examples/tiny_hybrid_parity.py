"""End-to-end proof: a tiny hybrid model decodes the same tokens and logits after its cache crossed NIXL.

A tiny Qwen3.5-shaped model in plain PyTorch (seeded random weights): GDN layers (a short causal
conv over [Q | K | V], then the gated delta rule recurrence) with a full-attention layer every
fourth layer. For each (prefill TP P, decode TP D) and attention layout:

  1. P prefill processes each run the prompt's first N-1 tokens through the reference code and
     write their shard of the KV and GDN state into a real prefill cache, placed by the TP
     sharding rule (KV heads; conv Q, K and V each sharded on its own; ssm value heads), through
     the cache's typed views. Each holds the request (rank 0 draws the nonce, every rank shares it).
  2. D decode processes read the ticket with real Producer / Consumer engines over NIXL.
  3. Each decode rank copies its shard out of its blocks; decode rank 0 gets all D of them,
     rebuilds the full KV and state by the same rule and greedy-decodes from the last prompt
     token with the same reference code.

The TP split is storage only (no sharded compute), so the tokens and the logits of every step
must equal a single-process run bit for bit. Two negative controls show that the check can fail:
a consumer expecting the prompt length N instead of N-1 is refused before any read, and the
state after N tokens sent under a ticket that claims N-1 changes the logits of the first step.

Run from the repository root (`bash scripts/setup.sh` creates .venv):
  .venv/bin/python examples/tiny_hybrid_parity.py [--short] [--pairs 1:1,2:4,4:2] [--layouts interleaved,split]
                                                  [--mode coalesced|naive|pack|auto]
Exit status 0 only when every comparison holds and both controls fail the way they must.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import multiprocessing as mp
import os
import sys
import time
import uuid
from dataclasses import dataclass, field

try:
    import torch

    from hybrid_transfer.layout import CacheOptions, KVLayout, LayerKind, model_from_config

    for _module in ("zmq", "nixl"):  # imported by the rank processes
        if importlib.util.find_spec(_module) is None:
            raise ModuleNotFoundError(name=_module)
except ModuleNotFoundError as exc:  # a Python without the project's packages (not .venv's)
    sys.exit(f"{exc.name} is not installed for {sys.executable}; run: "
             "bash scripts/setup.sh && .venv/bin/python examples/tiny_hybrid_parity.py")

# The model as config.json fields: 8 layers (layers 3 and 7 full attention, 6 GDN), 2 KV heads
# (replicated at TP 4), 4 key / 8 value heads, conv kernel 4 (3 stored positions per channel).
CONFIG = {
    "num_hidden_layers": 8,
    "full_attention_interval": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "linear_num_key_heads": 4,
    "linear_num_value_heads": 8,
    "linear_key_head_dim": 4,
    "linear_value_head_dim": 4,
    "linear_conv_kernel_dim": 4,
    "mamba_ssm_dtype": "float32",
    "dtype": "bfloat16",
}
MODEL = model_from_config(CONFIG, name="tiny-hybrid-parity")
HIDDEN, VOCAB, NUM_Q_HEADS, WEIGHT_SEED = 32, 97, 4, 1234
# Output projection gains, so that GDN and attention layers both move the residual stream and the
# greedy tokens vary (with unit gains the attention layers dominate and one token repeats).
GDN_OUT_GAIN, ATTENTION_OUT_GAIN = 30.0, 0.2
KV_DTYPE, CONV_DTYPE, SSM_DTYPE = torch.bfloat16, torch.bfloat16, torch.float32  # as the cache stores them

PROMPT_TOKENS = 41  # N: the prefill side moves N-1 = 40, the decode side computes token 40 itself (docs/n-minus-1.md)
DECODE_STEPS = 32
# The decode side uses twice the prefill block size, in two kernel blocks per logical block,
# so tokens map between different block sizes and logical ids expand to kernel ids.
PREFILL_BLOCKS = dict(num_blocks=16)
DECODE_OPTIONS = dict(block_size=32, kernel_block_size=16)
DECODE_BLOCKS = dict(num_blocks=12)

log = logging.getLogger("tiny_hybrid_parity")


# ---- the reference model ----------------------------------------------------------------
def _weights() -> dict[str, torch.Tensor]:
    """Seeded random weights: every process builds the same ones."""
    gen = torch.Generator().manual_seed(WEIGHT_SEED)
    m = MODEL
    nv, dv = m.linear_num_value_heads, m.linear_value_head_dim

    def rand(*shape, scale=None):
        return torch.randn(*shape, generator=gen) * (scale if scale is not None else shape[0] ** -0.5)

    w = {"embed": rand(VOCAB, HIDDEN, scale=1.0)}
    for layer, kind in enumerate(m.layer_kinds):
        p = f"{layer}."
        if kind is LayerKind.ATTENTION:
            w[p + "q"] = rand(HIDDEN, NUM_Q_HEADS * m.head_dim)
            w[p + "k"] = rand(HIDDEN, m.num_kv_heads * m.head_dim)
            w[p + "v"] = rand(HIDDEN, m.num_kv_heads * m.head_dim)
            w[p + "o"] = rand(NUM_Q_HEADS * m.head_dim, HIDDEN) * ATTENTION_OUT_GAIN
        else:
            w[p + "qkv"] = rand(HIDDEN, m.conv_dim)
            w[p + "conv"] = rand(m.conv_dim, m.linear_conv_kernel_dim, scale=0.5)
            w[p + "z"] = rand(HIDDEN, nv * dv)
            w[p + "a"] = rand(HIDDEN, nv)
            w[p + "b"] = rand(HIDDEN, nv)
            w[p + "a_log"] = rand(nv, scale=0.5)
            w[p + "dt_bias"] = rand(nv, scale=0.5)
            w[p + "o"] = rand(nv * dv, HIDDEN) * GDN_OUT_GAIN
    return w


@dataclass
class State:
    """Everything decoding needs after ``position`` tokens, in the dtypes the cache stores."""

    position: int
    k: dict[int, torch.Tensor] = field(default_factory=dict)  # attention layer -> [kv_heads, tokens, head_dim]
    v: dict[int, torch.Tensor] = field(default_factory=dict)
    conv: dict[int, torch.Tensor] = field(default_factory=dict)  # GDN layer -> [conv_dim, w-1], channels [Q|K|V]
    ssm: dict[int, torch.Tensor] = field(default_factory=dict)  # GDN layer -> [nv, dv, dk]


def empty_state() -> State:
    m = MODEL
    s = State(0)
    for layer in m.attention_layers:
        s.k[layer] = torch.zeros(m.num_kv_heads, 0, m.head_dim, dtype=KV_DTYPE)
        s.v[layer] = torch.zeros(m.num_kv_heads, 0, m.head_dim, dtype=KV_DTYPE)
    for layer in m.gdn_layers:
        s.conv[layer] = torch.zeros(m.conv_dim, m.conv_window, dtype=CONV_DTYPE)
        s.ssm[layer] = torch.zeros(m.linear_num_value_heads, m.linear_value_head_dim, m.linear_key_head_dim,
                                   dtype=SSM_DTYPE)
    return s


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _attention(w: dict, layer: int, x: torch.Tensor, s: State) -> torch.Tensor:
    m = MODEL
    hd, kvh = m.head_dim, m.num_kv_heads
    q = (x @ w[f"{layer}.q"]).view(NUM_Q_HEADS, hd)
    s.k[layer] = torch.cat([s.k[layer], (x @ w[f"{layer}.k"]).view(kvh, 1, hd).to(KV_DTYPE)], dim=1)
    s.v[layer] = torch.cat([s.v[layer], (x @ w[f"{layer}.v"]).view(kvh, 1, hd).to(KV_DTYPE)], dim=1)
    group = NUM_Q_HEADS // kvh  # grouped-query attention: query head i reads KV head i // group
    k = s.k[layer].float().repeat_interleave(group, dim=0)  # [q_heads, tokens, hd]
    v = s.v[layer].float().repeat_interleave(group, dim=0)
    probs = torch.softmax((k @ q.unsqueeze(-1)).squeeze(-1) * hd**-0.5, dim=-1)  # [q_heads, tokens]
    return (probs.unsqueeze(1) @ v).reshape(-1) @ w[f"{layer}.o"]


def _gdn(w: dict, layer: int, x: torch.Tensor, s: State) -> torch.Tensor:
    m = MODEL
    nk, nv, dk, dv = m.linear_num_key_heads, m.linear_num_value_heads, m.linear_key_head_dim, m.linear_value_head_dim
    # Short causal conv over [Q | K | V]: the stored w-1 inputs, then this token's.
    window = torch.cat([s.conv[layer].float(), (x @ w[f"{layer}.qkv"]).unsqueeze(-1)], dim=1)  # [conv_dim, w]
    s.conv[layer] = window[:, 1:].to(CONV_DTYPE)
    mixed = torch.nn.functional.silu((window * w[f"{layer}.conv"]).sum(-1))
    q, k, v = mixed.split([nk * dk, nk * dk, nv * dv])
    rep = nv // nk  # value head j reads key head j // rep
    q = torch.nn.functional.normalize(q.view(nk, dk), dim=-1).repeat_interleave(rep, 0) * dk**-0.5
    k = torch.nn.functional.normalize(k.view(nk, dk), dim=-1).repeat_interleave(rep, 0)
    v = v.view(nv, dv)
    # Gated delta rule, one [dv, dk] matrix per value head: decay, then move the memory toward v along k.
    decay = torch.exp(-torch.exp(w[f"{layer}.a_log"]) * torch.nn.functional.softplus(x @ w[f"{layer}.a"]
                                                                                     + w[f"{layer}.dt_bias"]))
    beta = torch.sigmoid(x @ w[f"{layer}.b"])
    h = s.ssm[layer] * decay.view(nv, 1, 1)
    delta = (v - (h @ k.unsqueeze(-1)).squeeze(-1)) * beta.unsqueeze(-1)  # [nv, dv]
    h = h + delta.unsqueeze(-1) * k.unsqueeze(1)
    s.ssm[layer] = h.to(SSM_DTYPE)
    out = (h @ q.unsqueeze(-1)).squeeze(-1).reshape(-1)  # [nv * dv]
    return (out * torch.nn.functional.silu(x @ w[f"{layer}.z"])) @ w[f"{layer}.o"]


def step(w: dict, token: int, s: State) -> torch.Tensor:
    """One token through every layer, updating ``s``; the next-token logits [VOCAB]."""
    x = w["embed"][token]
    for layer, kind in enumerate(MODEL.layer_kinds):
        mix = _attention if kind is LayerKind.ATTENTION else _gdn
        x = x + mix(w, layer, _rms(x), s)
    s.position += 1
    return _rms(x) @ w["embed"].T


def prefill(w: dict, tokens: list[int]) -> State:
    s = empty_state()
    for t in tokens:
        step(w, t, s)
    return s


def greedy_decode(w: dict, s: State, first_token: int, steps: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and the logits of every step [steps, VOCAB], starting from ``first_token``."""
    tokens, logits, token = [], [], first_token
    for _ in range(steps):
        out = step(w, token, s)
        token = int(torch.argmax(out))
        tokens.append(token)
        logits.append(out)
    return tokens, torch.stack(logits)


def make_prompt(n: int) -> list[int]:
    gen = torch.Generator().manual_seed(7)
    return torch.randint(0, VOCAB, (n,), generator=gen).tolist()


# ---- the TP sharding rule (docs/sharding.md), written out apart from the library's geometry ----
# (so the transfer is checked against the rule itself, not against the library's reading of it)
def kv_heads_of(tp: int, rank: int) -> range:
    """KV heads of ``rank``: an even split, or one head replicated tp / K times when tp > K (docs/sharding.md#kv-heads)."""
    k = MODEL.num_kv_heads
    if tp <= k:
        return range(rank * k // tp, (rank + 1) * k // tp)
    return range(rank * k // tp, rank * k // tp + 1)


def conv_rows_of(tp: int, rank: int) -> list[int]:
    """Global conv channels of ``rank`` in stored order [Q_r | K_r | V_r]: Q, K and V each split on its own
    (docs/sharding.md#conv-channels)."""
    m = MODEL
    qk, vd = m.linear_num_key_heads * m.linear_key_head_dim, m.linear_num_value_heads * m.linear_value_head_dim
    q = list(range(rank * qk // tp, (rank + 1) * qk // tp))
    v = list(range(rank * vd // tp, (rank + 1) * vd // tp))
    return q + [qk + c for c in q] + [2 * qk + c for c in v]


def value_heads_of(tp: int, rank: int) -> range:
    """Recurrent-state value heads of ``rank`` (docs/sharding.md#value-heads)."""
    nv = MODEL.linear_num_value_heads
    return range(rank * nv // tp, (rank + 1) * nv // tp)


# ---- a state's shard inside a rank's cache (typed views only) ------------------------------
def _token_slots(geometry, block_ids, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(kernel block id, position inside it) of tokens [0, num_tokens) of a request's attention blocks."""
    from hybrid_transfer import kernel_block_ids

    kernel_ids = torch.tensor(kernel_block_ids(block_ids, geometry.kernel_ratio), dtype=torch.int64)
    t = torch.arange(num_tokens)
    return kernel_ids[t // geometry.kernel_block_size], t % geometry.kernel_block_size


def write_shard(cache, state: State, block_ids, num_tokens: int) -> None:
    """Place this rank's shard of ``state`` (KV of tokens [0, num_tokens)) into the request's blocks."""
    g = cache.geometry
    heads = list(kv_heads_of(g.tp_size, g.tp_rank))
    rows, value_heads = conv_rows_of(g.tp_size, g.tp_rank), list(value_heads_of(g.tp_size, g.tp_rank))
    for group, ids in zip(g.tensor_map.groups, block_ids, strict=True):
        for layer in group.layers:
            if group.kind is LayerKind.ATTENTION:
                kid, pos = _token_slots(g, ids, num_tokens)
                # k / v: [num_kernel_blocks, heads_local, kernel_block_size, head_dim] whatever the layout;
                # [tokens, heads_local, head_dim] at (kernel block, :, position)
                cache.k(layer)[kid, :, pos] = state.k[layer][heads, :num_tokens].transpose(0, 1)
                cache.v(layer)[kid, :, pos] = state.v[layer][heads, :num_tokens].transpose(0, 1)
            else:
                cache.conv(layer)[ids[0]] = state.conv[layer][rows]
                cache.ssm(layer)[ids[0]] = state.ssm[layer][value_heads]


def read_shard(cache, block_ids, num_tokens: int) -> dict:
    """This rank's shard of the request, copied out of its blocks (same views, same rule)."""
    g = cache.geometry
    shard = {"tp_size": g.tp_size, "tp_rank": g.tp_rank, "num_tokens": num_tokens, "k": {}, "v": {}, "conv": {},
             "ssm": {}}
    for group, ids in zip(g.tensor_map.groups, block_ids, strict=True):
        for layer in group.layers:
            if group.kind is LayerKind.ATTENTION:
                kid, pos = _token_slots(g, ids, num_tokens)
                shard["k"][layer] = cache.k(layer)[kid, :, pos].transpose(0, 1).clone()
                shard["v"][layer] = cache.v(layer)[kid, :, pos].transpose(0, 1).clone()
            else:
                shard["conv"][layer] = cache.conv(layer)[ids[0]].clone()
                shard["ssm"][layer] = cache.ssm(layer)[ids[0]].clone()
    return shard


def rebuild(shards: list[dict]) -> State:
    """The full state from every decode rank's shard (docs/sharding.md#rebuild); every element must be
    covered, and replicated KV heads must agree."""
    m = MODEL
    n = shards[0]["num_tokens"]
    s = State(n)
    covered: dict[tuple[str, int], torch.Tensor] = {}

    def put(kind: str, layer: int, full: torch.Tensor, index, part: torch.Tensor) -> None:
        seen = covered.setdefault((kind, layer), torch.zeros(full.shape[0], dtype=torch.bool))
        index_t = torch.as_tensor(list(index), dtype=torch.int64)
        again = seen[index_t]
        if again.any() and not torch.equal(full[index_t][again], part[again]):
            raise AssertionError(f"replicas of {kind} layer {layer} disagree")
        full[index_t] = part
        seen[index_t] = True

    for layer in m.attention_layers:
        s.k[layer] = torch.empty(m.num_kv_heads, n, m.head_dim, dtype=KV_DTYPE)
        s.v[layer] = torch.empty(m.num_kv_heads, n, m.head_dim, dtype=KV_DTYPE)
    for layer in m.gdn_layers:
        s.conv[layer] = torch.empty(m.conv_dim, m.conv_window, dtype=CONV_DTYPE)
        s.ssm[layer] = torch.empty(m.linear_num_value_heads, m.linear_value_head_dim, m.linear_key_head_dim,
                                   dtype=SSM_DTYPE)
    for shard in shards:
        tp, rank = shard["tp_size"], shard["tp_rank"]
        for layer in m.attention_layers:
            put("k", layer, s.k[layer], kv_heads_of(tp, rank), shard["k"][layer])
            put("v", layer, s.v[layer], kv_heads_of(tp, rank), shard["v"][layer])
        for layer in m.gdn_layers:
            put("conv", layer, s.conv[layer], conv_rows_of(tp, rank), shard["conv"][layer])
            put("ssm", layer, s.ssm[layer], value_heads_of(tp, rank), shard["ssm"][layer])
    missing = [key for key, seen in covered.items() if not seen.all()]
    if missing or len(covered) != 2 * len(m.attention_layers) + 2 * len(m.gdn_layers):
        raise AssertionError(f"the shards do not cover the whole state: {missing}")
    return s


# ---- worker processes: each hosts engine ranks and keeps polling them ----------------------
def _options(layout: str, **fields) -> CacheOptions:
    return CacheOptions(kv_layout=KVLayout(layout), **fields)


def _geometry(layout: str, tp: int, rank: int, side: str):
    from hybrid_transfer import RankGeometry

    return RankGeometry(MODEL, tp, rank, _options(layout, **(DECODE_OPTIONS if side == "decode" else {})))


def _engine_config(mode: str):
    from hybrid_transfer import EngineConfig
    from hybrid_transfer.plan import PlanMode

    # A staging pool of 1 MiB holds any request of this model many times over.
    return EngineConfig(mode=PlanMode(mode), staging_bytes=1 << 20)


class _Host:
    """The ranks of one worker process: producers are polled (so they serve reads and free), consumers read."""

    def __init__(self):
        self.weights = _weights()
        self.ranks: dict[str, object] = {}
        self.results: dict[str, dict] = {}
        self.freed: dict[str, set] = {}

    def poll_all(self) -> None:
        from hybrid_transfer import Producer

        for key, engine in self.ranks.items():
            if isinstance(engine, Producer):
                self.freed[key].update(engine.poll())
            else:
                for result in engine.poll():
                    self.results[key][result.request_id] = result

    def create_producer(self, key, layout, tp, rank, engine_id, incarnation, mode):
        from hybrid_transfer import HybridCache, Producer

        cache = HybridCache.allocate(_geometry(layout, tp, rank, "prefill"), **PREFILL_BLOCKS)
        self.ranks[key] = Producer(cache, _engine_config(mode), engine_id=engine_id, incarnation=incarnation)
        self.freed[key] = set()
        return self.ranks[key].address

    def set_addresses(self, key, addresses):
        self.ranks[key].set_engine_addresses(addresses)  # every rank's side channel, index == tp_rank

    def prefill_and_hold(self, key, request_id, prompt, state_tokens, ticket_tokens, block_ids, nonce):
        """Run the reference prefill over ``state_tokens`` tokens, write this rank's shard, hold the blocks."""
        from hybrid_transfer.engine import encode_ticket

        producer = self.ranks[key]
        state = prefill(self.weights, prompt[:state_tokens])
        write_shard(producer.cache, state, block_ids, ticket_tokens)
        return encode_ticket(producer.hold(request_id, block_ids, ticket_tokens, nonce=nonce))

    def create_consumer(self, key, layout, tp, rank, engine_id, mode):
        from hybrid_transfer import Consumer, HybridCache
        from hybrid_transfer.verify import poison

        cache = HybridCache.allocate(_geometry(layout, tp, rank, "decode"), **DECODE_BLOCKS)
        poison(cache)  # so "nothing was written" can be checked byte by byte
        self.ranks[key] = Consumer(cache, _engine_config(mode), engine_id=engine_id)
        self.results[key] = {}

    def start_read(self, key, ticket_bytes, local_ids, expected_state_position):
        """None when the read started; (error type, message, reads posted, bytes touched) when refused."""
        from hybrid_transfer import HybridTransferError
        from hybrid_transfer.engine import decode_ticket

        consumer = self.ranks[key]
        try:
            consumer.start_read(decode_ticket(ticket_bytes), local_ids, expected_state_position=expected_state_position)
        except HybridTransferError as exc:
            touched = any(bool((t != 0xA5).any()) for t in consumer.cache.tensors)
            return type(exc).__name__, str(exc), consumer.stats.reads_posted, consumer.num_active, touched
        return None

    def wait_read(self, key, request_id, local_ids, num_tokens, timeout_s):
        """This rank's result and, when DONE, its shard of the request read back from its blocks."""
        deadline = time.monotonic() + timeout_s
        while request_id not in self.results[key] and time.monotonic() < deadline:
            self.poll_all()
            time.sleep(0.0005)
        result = self.results[key].pop(request_id, None)
        if result is None:
            return {"state": "timeout"}
        out = {"state": result.state.value, "num_bytes": result.num_bytes, "error": repr(result.error),
               "num_descriptors": result.num_descriptors, "num_packed_sources": result.num_packed_sources}
        if result.ok:
            out["shard"] = read_shard(self.ranks[key].cache, local_ids, num_tokens)
        return out

    def wait_freed(self, key, request_id, timeout_s):
        deadline = time.monotonic() + timeout_s
        while request_id not in self.freed[key] and time.monotonic() < deadline:
            self.poll_all()
            time.sleep(0.0005)
        return request_id in self.freed[key]

    def decode(self, shards, first_token, steps):
        """Decode rank 0: rebuild the full state from every decode rank's shard and decode greedily."""
        return greedy_decode(self.weights, rebuild(shards), first_token, steps)

    def close(self, key):
        engine = self.ranks.pop(key, None)
        if engine is not None:
            engine.close()


def worker_main(conn) -> None:
    """Command loop: run one command at a time, poll every hosted rank in between."""
    from hybrid_transfer import quiet_nixl_logging

    torch.set_num_threads(1)  # one thread everywhere: the same reductions in every process
    logging.basicConfig(level=os.environ.get("HT_EXAMPLE_LOG", "WARNING"))
    quiet_nixl_logging()
    host = _Host()
    try:
        while True:
            if conn.poll(0.002):
                message = conn.recv()
                if message is None:
                    break
                name, args = message
                try:
                    conn.send(("ok", getattr(host, name)(*args)))
                except Exception as exc:  # noqa: BLE001 - every failure goes back to the driver
                    conn.send(("err", f"{type(exc).__name__}: {exc}"))
            host.poll_all()
    finally:
        for key in list(host.ranks):
            host.close(key)
    # Every engine is closed: skip the interpreter's teardown of torch and UCX (seconds on a busy host).
    os._exit(0)


class Worker:
    def __init__(self, ctx, index: int):
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=worker_main, args=(child,), name=f"parity-worker-{index}", daemon=True)
        self.process.start()

    def call(self, name: str, *args, timeout_s: float = 120.0):
        self.conn.send((name, args))
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"{self.process.name}: {name} did not answer within {timeout_s} s")
        status, value = self.conn.recv()
        if status == "err":
            raise RuntimeError(f"{self.process.name}: {name}: {value}")
        return value

    def stop(self) -> None:
        """Ask the worker to close its ranks and exit; ``join`` waits for it."""
        if self.process.is_alive():
            self.conn.send(None)

    def join(self) -> None:
        self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.kill()


# ---- one transfer, driven from here --------------------------------------------------------
@dataclass
class Transfer:
    """The decode side's view of one request after its read: per-rank results and the decoded output."""

    states: list[str]
    num_bytes: list[int]
    num_descriptors: list[int] = field(default_factory=list)
    num_packed_sources: list[int] = field(default_factory=list)
    tokens: list[int] | None = None
    logits: torch.Tensor | None = None
    refusal: tuple | None = None


def _block_ids(layout: str, tp: int, side: str, num_tokens: int, seed: int):
    """Scattered block ids of one request on one engine (every rank of the engine uses the same ids)."""
    from hybrid_transfer.verify import make_request

    blocks = DECODE_BLOCKS if side == "decode" else PREFILL_BLOCKS
    extra = 1 if side == "decode" else 0  # a decode engine also allocates room for the tokens it generates
    request = make_request(_geometry(layout, tp, 0, side), num_tokens, blocks["num_blocks"], seed, 1.0, extra)
    return [list(ids) for ids in request.block_ids]


def transfer(workers, layout: str, p: int, d: int, prompt: list[int], *, state_tokens: int, ticket_tokens: int,
             expected_state_position: int, steps: int, mode: str) -> Transfer:
    """Prefill on workers [0, p), read on workers [p, p + d), decode on decode rank 0."""
    tag = uuid.uuid4().hex[:6]
    rid = f"req-{tag}"
    prefill_workers, decode_workers = workers[:p], workers[p : p + d]
    p_keys = [f"prefill-{tag}-{r}" for r in range(p)]
    d_keys = [f"decode-{tag}-{r}" for r in range(d)]
    incarnation = int.from_bytes(os.urandom(6), "little")
    try:
        addresses = [w.call("create_producer", k, layout, p, r, f"prefill-{tag}", incarnation, mode)
                     for r, (w, k) in enumerate(zip(prefill_workers, p_keys, strict=True))]
        if p > 1:
            for w, k in zip(prefill_workers, p_keys, strict=True):
                w.call("set_addresses", k, addresses)
        remote_ids = _block_ids(layout, p, "prefill", ticket_tokens, seed=p * 10 + d)
        local_ids = _block_ids(layout, d, "decode", ticket_tokens, seed=p * 10 + d + 1)
        from hybrid_transfer.engine import decode_ticket

        ticket = prefill_workers[0].call("prefill_and_hold", p_keys[0], rid, prompt, state_tokens, ticket_tokens,
                                         remote_ids, None)
        nonce = decode_ticket(ticket).nonce  # rank 0 draws the nonce; every other rank holds with it
        for w, k in zip(prefill_workers[1:], p_keys[1:], strict=True):
            if w.call("prefill_and_hold", k, rid, prompt, state_tokens, ticket_tokens, remote_ids, nonce) != ticket:
                raise AssertionError(f"prefill rank {k} issued a different ticket")
        for r, (w, k) in enumerate(zip(decode_workers, d_keys, strict=True)):
            w.call("create_consumer", k, layout, d, r, f"decode-{tag}", mode)
        refusals = [w.call("start_read", k, ticket, local_ids, expected_state_position)
                    for w, k in zip(decode_workers, d_keys, strict=True)]
        if any(refusals):
            return Transfer([], [], refusal=next(r for r in refusals if r))
        reads = [w.call("wait_read", k, rid, local_ids, ticket_tokens, 60.0)
                 for w, k in zip(decode_workers, d_keys, strict=True)]
        out = Transfer([r["state"] for r in reads], [r.get("num_bytes", 0) for r in reads],
                       [r.get("num_descriptors", 0) for r in reads], [r.get("num_packed_sources", 0) for r in reads])
        if all(r["state"] == "done" for r in reads):
            out.tokens, out.logits = decode_workers[0].call("decode", [r["shard"] for r in reads],
                                                            prompt[ticket_tokens], steps)
            for w, k in zip(prefill_workers, p_keys, strict=True):
                if not w.call("wait_freed", k, rid, 30.0):
                    raise AssertionError(f"prefill rank {k} never freed {rid}")
        else:
            log.error("reads did not finish: %s", reads)
        return out
    finally:
        for w, k in zip(prefill_workers + decode_workers, p_keys + d_keys, strict=True):
            w.call("close", k)


# ---- the report ------------------------------------------------------------------------------
def parse_pairs(text: str) -> list[tuple[int, int]]:
    try:
        pairs = [tuple(int(x) for x in item.split(":")) for item in text.split(",") if item]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--pairs {text!r}: expected P:D,P:D,...") from None
    if not pairs or any(len(pair) != 2 or min(pair) < 1 for pair in pairs):
        raise argparse.ArgumentTypeError(f"--pairs {text!r}: expected P:D,P:D,... with P, D >= 1")
    from hybrid_transfer import HybridTransferError, RankGeometry

    for tp in {tp for pair in pairs for tp in pair}:
        try:
            RankGeometry(MODEL, tp)
        except HybridTransferError as exc:
            raise argparse.ArgumentTypeError(f"--pairs {text!r}: {exc}") from None
    return pairs  # type: ignore[return-value]


def _diff(a: torch.Tensor, b: torch.Tensor) -> str:
    return f"max |diff| {float((a - b).abs().max()):.3g}"


def check_pair(workers, layout, p, d, prompt, ref_tokens, ref_logits, steps, mode) -> bool:
    n = len(prompt)
    t = transfer(workers, layout, p, d, prompt, state_tokens=n - 1, ticket_tokens=n - 1,
                 expected_state_position=n - 1, steps=steps, mode=mode)
    ok = t.tokens is not None and t.tokens == ref_tokens and torch.equal(t.logits, ref_logits)
    if t.tokens is None:
        detail = f"reads {t.states}" if t.refusal is None else f"refused: {t.refusal[:2]}"
    else:
        same_tokens = sum(a == b for a, b in zip(t.tokens, ref_tokens, strict=True))
        same_steps = sum(torch.equal(a, b) for a, b in zip(t.logits, ref_logits, strict=True))
        detail = (f"tokens {same_tokens}/{steps} equal, logits {same_steps}/{steps} steps bit-equal"
                  + ("" if ok else f" ({_diff(t.logits, ref_logits)})"))
    def per_rank(values):
        return "/".join(map(str, values))

    moved = f"bytes {per_rank(t.num_bytes)}, descriptors {per_rank(t.num_descriptors)}"
    if mode in ("pack", "auto"):
        moved += f", packed sources {per_rank(t.num_packed_sources)}"
    print(f"  {layout:<11} P{p} -> D{d}  per decode rank: {moved}\n    {detail}  {'PASS' if ok else 'FAIL'}",
          flush=True)
    return ok


def check_controls(workers, layout, prompt, ref_tokens, ref_logits, steps, mode) -> bool:
    n = len(prompt)
    print(f"negative controls ({layout}, P1 -> D1):", flush=True)
    t = transfer(workers, layout, 1, 1, prompt, state_tokens=n - 1, ticket_tokens=n - 1,
                 expected_state_position=n, steps=steps, mode=mode)
    refused = t.refusal is not None and t.refusal[0] == "StatePositionError" and t.refusal[2:] == (0, 0, False)
    what = (f"refused with {t.refusal[0]} ({t.refusal[1]}); READs posted {t.refusal[2]}, "
            f"requests active {t.refusal[3]}, local bytes touched {t.refusal[4]}") if t.refusal else f"not refused: {t}"
    print(f"  consumer expects the prompt length {n}, the ticket says {n - 1}: {what}  "
          f"{'PASS' if refused else 'FAIL'}", flush=True)

    t = transfer(workers, layout, 1, 1, prompt, state_tokens=n, ticket_tokens=n - 1, expected_state_position=n - 1,
                 steps=steps, mode=mode)
    differs = t.logits is not None and not torch.equal(t.logits[0], ref_logits[0])
    if t.logits is None:
        what = f"reads {t.states}"
    else:
        first_token = next((i for i, (a, b) in enumerate(zip(t.tokens, ref_tokens, strict=True)) if a != b), None)
        what = (f"read {t.states[0]}, step 0 logits {'differ' if differs else 'EQUAL'} ({_diff(t.logits[0], ref_logits[0])}), "
                f"first differing token at step {first_token}")
    print(f"  state after {n} tokens under a ticket for {n - 1}: {what}  {'PASS' if differs else 'FAIL'}", flush=True)
    return refused and differs



def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--pairs", type=parse_pairs, default="1:1,2:4,4:2",
                        help="prefill:decode TP pairs")
    parser.add_argument("--layouts", default="interleaved,split", help="attention layouts, comma separated")
    parser.add_argument("--short", action="store_true", help="CI version: 2:4 interleaved plus the negative controls")
    parser.add_argument("--mode", choices=["coalesced", "naive", "pack", "auto"], default="coalesced",
                        help="plan mode of every engine")
    parser.add_argument("--steps", type=int, default=DECODE_STEPS, help="greedy decode steps")
    parser.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS, help="prompt length N (N-1 move)")
    args = parser.parse_args(argv)
    if args.prompt_tokens < 2 or args.steps < 1:
        parser.error("--prompt-tokens must be at least 2 (the N-1 rule moves one token or more), --steps at least 1")
    pairs, layouts = args.pairs, [x for x in args.layouts.split(",") if x]
    known = [layout.value for layout in KVLayout]
    if not layouts or any(x not in known for x in layouts):
        parser.error(f"--layouts {args.layouts!r}: choose from {', '.join(known)}")
    if args.short:
        pairs, layouts = [(2, 4)], ["interleaved"]
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)

    weights = _weights()
    prompt = make_prompt(args.prompt_tokens)
    n = len(prompt)
    ref_tokens, ref_logits = greedy_decode(weights, prefill(weights, prompt[: n - 1]), prompt[n - 1], args.steps)
    m = MODEL
    print(f"tiny hybrid parity: {m.num_layers} layers ({len(m.attention_layers)} full attention, "
          f"{len(m.gdn_layers)} GDN), prompt N={n} tokens, the prefill side moves N-1={n - 1}, "
          f"{args.steps} greedy steps", flush=True)
    print(f"single-process reference tokens: {' '.join(map(str, ref_tokens))}", flush=True)

    # forkserver: torch and the engine are imported once, in the server, and every worker forks from it
    # (spawned workers would each import them again, seconds of CPU apiece). No thread exists in the
    # server when it forks: torch starts its pools on first use, NIXL its threads in an agent.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "hybrid_transfer.engine"])
    workers = [Worker(ctx, i) for i in range(max(p + d for p, d in pairs))]
    ok = True
    try:
        print(f"transfers in {args.mode} mode (every decode step's logits compared bit for bit with the reference):",
              flush=True)
        for layout in layouts:
            for p, d in pairs:
                ok &= check_pair(workers, layout, p, d, prompt, ref_tokens, ref_logits, args.steps, args.mode)
        ok &= check_controls(workers, layouts[0], prompt, ref_tokens, ref_logits, args.steps, args.mode)
    finally:
        for w in workers:  # all at once: each exit tears down torch and UCX
            w.stop()
        for w in workers:
            w.join()
    print("PARITY HOLDS" if ok else "PARITY BROKEN", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
