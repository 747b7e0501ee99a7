"""The coordinator <-> rank process messages: tagged Structs that round-trip and decode strictly."""

from __future__ import annotations

import multiprocessing as mp

import msgspec
import pytest

from hybrid_transfer.bench import messages as m
from hybrid_transfer.bench.coordinator import RankProcess
from hybrid_transfer.bench.spec import Device
from hybrid_transfer.bench.stats import ConsumerRun, PlanTiming, ProducerServe, RequestTiming
from hybrid_transfer.bench.worker import HANDLERS
from hybrid_transfer.errors import BenchError
from hybrid_transfer.plan.rank import RankDescriptor
from hybrid_transfer.plan.types import PlanMode
from hybrid_transfer.verify import RequestLayout

LAYOUT = RequestLayout(block_ids=((3, 4), (7,), (8,)), num_tokens=17)
DESCRIPTOR = RankDescriptor(tp_size=2, tp_rank=1, block_size=32, kernel_block_size=16, kv_dtype="bfloat16",
                            ssm_dtype="float32", conv_layout="DS", ssm_order="HVK", page_bytes=4096,
                            num_blocks=9, tensor_addrs=(1 << 40, 1 << 41))
SETUP = m.RankSetup(preset="qwen3.5-0.8b", kv_dtype=None, is_prefill=True, tp_size=2, tp_rank=1, num_blocks=64,
                    device=Device.CPU, gpu=0, torch_threads=1, engine_id="prefill-abc", incarnation=5,
                    mode=PlanMode.PACK)
TIMING = RequestTiming("r0", 1.0, 1.5, 2.0, 2.5, 1000, 12, 0.01, packed_sources=1)

COMMANDS = [
    m.Setup(SETUP),
    m.SetEngineAddresses(["tcp://127.0.0.1:5000", "tcp://127.0.0.1:5001"]),
    m.Fill([LAYOUT], [11]),
    m.Hold(["r0"], [LAYOUT]),
    m.Hold(["r0"], [LAYOUT], [2**63 - 1]),
    m.Serve(["r0", "r1"]),
    m.Stop(),
    m.OpenConsumer(PlanMode.COALESCED, "tcp://127.0.0.1:5000", [DESCRIPTOR], 60.0),
    m.CloseConsumer(),
    m.RunEngine([m.EngineItem("r0", b"\x00ticket", ((1, 2), (3,)), 17)], 4, 123.25),
    m.PlanTimes([((1, 2), (3,))], [((5, 6), (7,))], 17, PlanMode.NAIVE),
    m.Poison(),
    m.Verify([LAYOUT], [11]),
    m.CeilingOpen(2, 4096, 7),
    m.CeilingAddSources([m.CeilingSource(0, b"meta", 1 << 40, 4096, 0, 7)]),
    m.RunCeiling(["r0"], {0: 100, 1: 200}, 2, 5.5),
    m.CeilingVerify(1, {0: 100}),
    m.CopyOpen([m.CopySourceSpec(0, 100, 0, 7), m.CopySourceSpec(1, 200, 1, 8)]),
    m.RunCopy(["r0"], {0: 100, 1: 200}, 2, 5.5),
    m.CopyVerify(1, {0: 100}),
    m.Shutdown(),
]
REPLIES = [
    m.Done(),
    m.Failed("ConfigError", "bad"),
    m.Started("tcp://127.0.0.1:5000", DESCRIPTOR),
    m.Held([b"t0", b"t1"], [0.001, 0.002]),
    m.CeilingBuffer(b"meta", 1 << 40, 0),
    m.Ran(ConsumerRun(0, (TIMING,), 0.5)),
    m.Served(ProducerServe(1, {"r0": 3.0}, 0.25, (0.001,))),
    m.Planned(PlanTiming(0, (0.001,), (12,), (12,))),
]


def test_every_command_class_is_in_the_union_and_listed_here():
    in_union = set(m.AnyCommand.__args__)
    assert in_union == set(m.Command.__subclasses__())
    assert {type(c) for c in COMMANDS} == in_union


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: type(c).__name__)
def test_commands_round_trip(cmd):
    assert m.decode_command(m.encode(cmd)) == cmd


@pytest.mark.parametrize("reply", REPLIES, ids=lambda r: type(r).__name__)
def test_replies_round_trip(reply):
    assert set(m.AnyReply.__args__) == set(m.Reply.__subclasses__())
    if isinstance(reply, m.Failed):
        with pytest.raises(BenchError, match="ConfigError: bad"):
            m.decode_reply(m.encode(reply), m.Done, "decode 0")
    else:
        assert m.decode_reply(m.encode(reply), type(reply), "decode 0") == reply


def test_every_answered_command_has_a_handler():
    answered = set(m.AnyCommand.__args__) - {m.Stop, m.Shutdown}
    assert set(HANDLERS) == answered


def _raw(obj) -> bytes:
    return msgspec.msgpack.encode(obj)


@pytest.mark.parametrize("raw, words", [
    ({"command": "Fill", "layouts": [], "seeds": [], "extra": 1}, "extra"),  # unknown field
    ({"command": "Fill", "layouts": []}, "seeds"),  # missing field
    ({"command": "CeilingOpen", "slots": "2", "slot_bytes": 1, "seed": 0}, "slots"),  # no str -> int coercion
    ({"command": "Launch"}, "Launch"),  # unknown tag
    ({"command": "OpenConsumer", "mode": "fastest", "address": "a", "producer_descriptors": [],
      "timeout_s": 1.0}, "mode"),
    (["Fill", [], []], "array"),  # positional arguments are not a command
])
def test_commands_decode_strictly(raw, words):
    with pytest.raises(msgspec.ValidationError, match=words):
        m.decode_command(_raw(raw))


def test_a_reply_of_another_type_is_refused_by_name():
    with pytest.raises(BenchError, match="expected a Held reply, got Done") as info:
        m.decode_reply(m.encode(m.Done()), m.Held, "prefill 1")
    assert info.value.where == "prefill 1"
    with pytest.raises(BenchError, match="undecodable reply"):
        m.decode_reply(_raw({"reply": "Done", "x": 1}), m.Done, "prefill 1")


def test_a_rank_process_answers_bad_commands_with_failed_and_keeps_serving():
    """A real spawned rank: undecodable bytes and a command it cannot run come back as typed failures."""
    proc = RankProcess(mp.get_context("spawn"), "decode 0")
    try:
        proc.conn.send_bytes(_raw({"command": "Fill", "layouts": [], "seeds": [], "extra": 1}))
        with pytest.raises(BenchError, match="undecodable command.*extra") as info:
            proc.recv(m.Done, timeout_s=120)
        assert info.value.remote_type == "ValidationError"
        with pytest.raises(BenchError, match="decode 0: AttributeError"):  # no cache before Setup
            proc.call(m.Poison(), m.Done)
        assert proc.call(m.CloseConsumer(), m.Done) == m.Done()  # still serving
    finally:
        proc.close()
    assert proc.process.exitcode == 0  # Shutdown ended the loop; no kill was needed
