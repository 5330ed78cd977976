"""The loop of a worker's groups (`loop.train_generations`) behind its membership
(train/membership.py): a lost member re-forms in-process, and every error of a re-form (the
rendezvous's owner failed, no generation within the bound, no step whole on the survivors)
ends the loop unmasked, so that Ray Train restarts the worker group from the checkpoint, as
on the restart path, where every error does. Stand-ins for the attempt and the membership:
what the loop decides, without processes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import pytest

from wildtrain.elastic.membership import RedundancyLost
from wildtrain.elastic.rendezvous import RendezvousFailed
from wildtrain.elastic.signals import MembersJoining
from wildtrain.train import loop
from wildtrain.train.failures import FailureKind, Superseded, classify
from wildtrain.train.generations import Leftovers, Unreported
from wildtrain.train.membership import RayTrainGroup, RestartMembership, Trained
from wildtrain.train.state import TrainState


@dataclass
class StandInGroup:
    number: int
    left: Optional[Leftovers]


@dataclass
class StandInMembership:
    """Forms groups 1, 2, ...: `forms[n]` raises where set, as `train[n]` does in its attempt.
    A collective's failure that nobody explains is a lost member, as the owner's verdict would say."""

    forms: dict[int, BaseException] = field(default_factory=dict)
    train: dict[int, BaseException] = field(default_factory=dict)
    formed: list[int] = field(default_factory=list)
    left: list[Optional[Leftovers]] = field(default_factory=list)
    peer_store = None
    verdict: Optional[BaseException] = None  # what the owner's verdict raises, if anything
    ended: bool = False

    def form(self, left):
        number = len(self.formed) + 1
        self.formed.append(number)
        self.left.append(left)
        if number in self.forms:
            raise self.forms[number]
        return StandInGroup(number, left)

    def lost_member(self, error: BaseException, peer_failure: Callable[[], Optional[str]]) -> bool:
        kind = classify(error, peer_failure())
        if kind is FailureKind.COLLECTIVE and self.verdict is not None:
            raise self.verdict
        return kind in (FailureKind.SUPERSEDED, FailureKind.COLLECTIVE)

    def leave(self) -> None:
        self.ended = True


LEFT = Leftovers.joiner(None)


class StandInAttempt:
    def __init__(self, inputs, device, group: StandInGroup) -> None:
        self.group = group

    def abandon(self, error, failed_at, left):
        return LEFT

    def hand_over(self):
        return LEFT


@pytest.fixture
def run(monkeypatch):
    def run(membership: StandInMembership) -> None:
        def train(attempt: StandInAttempt) -> None:
            error = membership.train.get(attempt.group.number)
            if error is not None:
                raise error

        monkeypatch.setattr(loop, "Attempt", StandInAttempt)
        monkeypatch.setattr(loop, "train", train)
        loop.train_generations(None, None, membership, None, lambda: None)

    return run


def test_a_lost_member_re_forms_with_what_the_attempt_left_and_the_run_ends_in_the_next_group(run):
    membership = StandInMembership(train={1: RuntimeError("Connection closed by peer")})
    run(membership)
    assert membership.formed == [1, 2] and membership.left == [None, LEFT] and membership.ended


def test_joiners_take_the_state_over_and_a_group_superseded_while_it_formed_is_formed_anew(run):
    membership = StandInMembership(forms={2: Superseded("gen 2 superseded")}, train={1: MembersJoining("join")})
    run(membership)
    assert membership.formed == [1, 2, 3] and membership.ended


@pytest.mark.parametrize(
    "staged",
    [
        StandInMembership(forms={2: RendezvousFailed("the owner failed: falling back to a restart")}),
        StandInMembership(forms={2: RendezvousFailed("no generation after 1 within 60 s")}),
        StandInMembership(verdict=RendezvousFailed("the owner failed while the survivors waited for its verdict")),
        StandInMembership(train={2: RedundancyLost("no rank of the new group holds partition 1")}),
    ],
    ids=["owner-failed-at-the-re-form", "re-form-over-its-bound", "owner-failed-at-the-verdict", "redundancy-lost"],
)
def test_any_error_of_a_re_form_ends_the_loop_for_ray_to_restart_the_group_from_the_checkpoint(run, staged):
    staged.train[1] = RuntimeError("Connection closed by peer")  # a member lost in the first group
    with pytest.raises((RendezvousFailed, RedundancyLost)):
        run(staged)
    assert not staged.ended
    assert len(staged.formed) <= 2, "no third generation: the group's restart takes over"


def test_on_the_restart_path_every_error_ends_the_group():
    assert not RestartMembership().lost_member(RuntimeError("Connection closed by peer"), lambda: None)
    assert not RestartMembership().lost_member(Superseded("never raised on this path"), lambda: None)


def test_the_restart_path_s_group_commits_each_step_as_it_trains_and_records_nothing_itself():
    state = TrainState(step=4, world_size=2)
    commits = Trained(state)
    commits.commit(None, state, None, flush=False)
    commits.flush()
    state.step = 5
    assert commits.committed == 5
    # What an attempt dropped leaves holds no state: no peer kept one, the checkpoint restores.
    interruption = commits.failure(RuntimeError("lost"), 9.0, state, 2, ["n1"], None)
    assert (interruption.at, interruption.last_step) == (9.0, 5)
    unreported = Unreported([{"step": 5}], [interruption], ["step_4"], {})
    left = commits.leftovers(interruption, unreported, [("runs/r", "step_4")], saving=None)
    assert left.states == {} and left.interruption is interruption
    assert (left.windows, left.committed, left.known_good) == ([{"step": 5}], ["step_4"], [("runs/r", "step_4")])
    group = RayTrainGroup.__new__(RayTrainGroup)  # no Ray Train context here: only what needs none
    assert group.left is None and not group.joined and not group.short_of_members
    assert group.spares_waiting is None and group.joiners_waiting is None
    assert group.held_by_peers() is None
    assert group.formed(4, ["n1"]) == [] and group.recovered(0.0, 4) == [] and group.metrics() == {}
