"""What an error in a worker group's training is (`failures.classify`): one decision for the
restart path's fail-fast and the in-process membership's question whether a member is gone."""

import pytest
import torch.distributed as dist

from wildtrain.elastic.membership import RedundancyLost
from wildtrain.elastic.rendezvous import RendezvousFailed
from wildtrain.elastic.signals import FinalCheckpointFailed, MembersJoining, PlannedRegrow, UnhealthyNodes
from wildtrain.train.failures import FailureKind, Superseded, classify
from wildtrain.train.in_process import LeftOut


@pytest.mark.parametrize(
    "error",
    [
        PlannedRegrow("room for more"),
        UnhealthyNodes(["n1"], []),
        FinalCheckpointFailed(8, "none"),
        RedundancyLost("no rank holds partition 1"),
        MembersJoining("workers ask to join"),
    ],
)
def test_what_every_rank_raises_at_once_is_nobody_s_failure_even_beside_a_peer_s(error):
    assert classify(error, None) is FailureKind.TOGETHER
    assert classify(error, "rank 1: boom") is FailureKind.TOGETHER


def test_a_newer_generation_while_the_groups_form_is_formed_whatever_a_peer_said():
    assert classify(Superseded("gen 2 superseded"), None) is FailureKind.SUPERSEDED
    assert classify(Superseded("gen 2 superseded"), "rank 1: boom") is FailureKind.SUPERSEDED


def test_an_error_a_peer_explains_is_the_peer_s():
    assert classify(RuntimeError("Connection closed by peer"), "rank 1: ValueError: bad") is FailureKind.PEER
    assert classify(ValueError("bad"), "rank 1: ValueError: bad") is FailureKind.PEER


def test_only_a_collective_s_failure_nobody_explains_can_be_a_member_s_death():
    assert classify(RuntimeError("Connection closed by peer"), None) is FailureKind.COLLECTIVE
    assert classify(dist.DistNetworkError("connection reset"), None) is FailureKind.COLLECTIVE


@pytest.mark.parametrize(
    "error",
    [
        ValueError("a bug"),
        KeyError("a bug"),
        # The fallback of a re-form that failed or overran its bound: never taken for a member's death.
        RendezvousFailed("the owner failed"),
        LeftOut("w1 was left out of generation 3"),
    ],
)
def test_wildtrain_s_own_signals_and_bugs_are_the_rank_s_own(error):
    assert classify(error, None) is FailureKind.OWN


def test_the_caller_names_what_every_rank_raises_together():
    assert classify(PlannedRegrow("room for more"), None, together=()) is FailureKind.OWN
