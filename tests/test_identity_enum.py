"""The identity-hashed Enum (hybrid_transfer/identity_enum.py): only the hash differs from Enum."""

import pickle

import msgspec
import pytest

from hybrid_transfer.engine.agent import XferState
from hybrid_transfer.engine.lifecycle.state import TERMINAL, FailureCause, HoldState, ReadState
from hybrid_transfer.engine.peer_record import PeerStage
from hybrid_transfer.engine.peers import LinkState
from hybrid_transfer.identity_enum import IdentityEnum
from hybrid_transfer.layout.model import DType, LayerKind
from hybrid_transfer.plan.types import PlanMode

HOT = (XferState, ReadState, FailureCause, HoldState, PeerStage, LinkState, PlanMode, LayerKind, DType)


@pytest.mark.parametrize("kind", HOT, ids=lambda k: k.__name__)
def test_hot_enums_hash_by_identity_and_keep_enum_behaviour(kind):
    assert issubclass(kind, IdentityEnum)
    for member in kind:
        assert hash(member) == object.__hash__(member)
        assert kind(member.value) is member
        assert kind[member.name] is member
        assert pickle.loads(pickle.dumps(member)) is member
        assert msgspec.json.decode(msgspec.json.encode(member), type=kind) is member
    assert {m: m.value for m in kind} == {m: m.value for m in list(kind)}


def test_sets_of_members_still_answer_membership():
    assert ReadState.DONE in TERMINAL and ReadState.READING not in TERMINAL
    assert HoldState.FREED in TERMINAL


def test_members_of_different_enums_with_equal_values_stay_apart():
    class A(IdentityEnum):
        X = "x"

    class B(IdentityEnum):
        X = "x"

    assert A.X != B.X
    assert len({A.X, B.X}) == 2
