"""This worker's membership in its worker group, one interface for both recovery paths, so
that an attempt (train/attempt.py) and the loop (train/loop.py) never ask which one runs.

- `Membership`: across failures, the groups this worker trains in (`form`), whether a
  failure lost a member that the survivors go on without (`lost_member`), and the run's end
  (`leave`).
- `Group`: one of those groups, as one attempt trains in it: its rank and size, where its
  reports go and whether the controller took them, what it restores from, how its steps
  commit, and the events and metrics of its membership.

Two implementations: the restart path's (`RestartMembership`: the worker group Ray Train
started is the only group; any failure ends it on every rank, and Ray restarts it from the
checkpoint), and the in-process path's (`InProcessMembership`, elastic.in_process: the
generations of `in_process.Member`, re-formed without a lost member from the state the
members mirror, `generations`). Where the restart path has nothing to do, its
implementation does nothing.
"""

from __future__ import annotations

import abc
import time
from typing import Callable, Optional, Protocol, Union

import ray.train
import torch.distributed as dist

from wildtrain import ray_compat
from wildtrain.checkpoint.async_save import AsyncSaver
from wildtrain.checkpoint.save_process import SaveProcess
from wildtrain.elastic.relay import RELAY
from wildtrain.events import Event, Formed, Interrupted
from wildtrain.train import checkpointing
from wildtrain.train.generations import (
    InProcess,
    Leftovers,
    PeerCommits,
    Unreported,
    agree_on_restore,
    interrupted_by_loss,
)
from wildtrain.train.in_process import Member
from wildtrain.train.state import TrainState
from wildtrain.train.step import StepMetrics


class Commits(Protocol):
    """The steps an attempt committed: those a failure of its group never costs, and what an
    attempt dropped at them leaves the next one (only a membership that goes on without a
    lost member drops an attempt: `Membership.lost_member`)."""

    committed: int

    def commit(self, engine, state: TrainState, window: StepMetrics, flush: bool) -> None: ...

    def flush(self) -> None: ...

    def failure(
        self,
        error: BaseException,
        failed_at: float,
        state: TrainState,
        world_size: int,
        nodes: list[str],
        left: Optional[Leftovers],
    ) -> Interrupted:
        """The interruption of the attempt at `state`, which lost a member to `error` at `failed_at`."""

    def leftovers(
        self,
        interruption: Interrupted,
        unreported: Unreported,
        known_good: list[tuple[str, str]],
        saving: Union[AsyncSaver, SaveProcess, None],
    ) -> Leftovers:
        """What the next group needs of the attempt, dropped after `interruption`."""


class Group(abc.ABC):
    """The group one attempt trains in, as this worker belongs to it."""

    rank: int
    world_size: int
    # What the attempt before this one left, as every rank agreed: None where it restores
    # from the checkpoint (the restart path always does).
    left: Optional[Leftovers]
    joined: bool  # started on a lost member's placement slot, not by Ray Train (chaos.fail_joiner fails it)
    short_of_members: bool  # fewer members than Ray placed the group for
    spares_waiting: Optional[Callable[[], int]]  # the joiners ready to take a lost member's place
    joiners_waiting: Optional[Callable[[], bool]]  # whether workers wait to join at the next log step

    @abc.abstractmethod
    def send(self, report: dict) -> None:
        """Hand the controller a report."""

    @abc.abstractmethod
    def reports_collected(self) -> bool:
        """Whether the controller took every report this rank sent."""

    @abc.abstractmethod
    def held_by_peers(self) -> Optional[checkpointing.HeldByPeers]:
        """Collectively, the state the members kept, to restore from; None: from the checkpoint."""

    @abc.abstractmethod
    def commits(self, state: TrainState, nodes: list[str]) -> Commits:
        """How the attempt restored at `state` on `nodes` commits its steps."""

    @abc.abstractmethod
    def formed(self, step: int, nodes: list[str]) -> list[Event]:
        """The events of this group's forming, by the worker (the controller records a restart's)."""

    @abc.abstractmethod
    def recovered(self, restored_at: float, restored_step: int) -> list[Event]:
        """At the first step of an attempt that restored from `left`: the interruption it recovered from, and how."""

    @abc.abstractmethod
    def metrics(self) -> dict[str, int]:
        """This rank's metrics of the membership, for each closed window."""


class Membership(abc.ABC):
    # Where a rank's own failure is told to its peers (`collectives.PeerWatch`); None: the
    # store Ray Train's group rendezvoused through.
    peer_store: Optional[dist.Store] = None

    @abc.abstractmethod
    def form(self, left: Optional[Leftovers]) -> Group:
        """The next group this worker trains in, given what its last attempt left."""

    @abc.abstractmethod
    def lost_member(self, error: BaseException, peer_failure: Callable[[], Optional[str]]) -> bool:
        """After `error` in the group's training: whether a member is gone and the others go on
        in the next group (True), or the error stands and ends the worker group (False)."""

    @abc.abstractmethod
    def leave(self) -> None:
        """The run is at its end."""


class Trained:
    """The restart path's commits: a step is as committed as it gets once trained (a failure
    restarts the group from the checkpoint). No peer keeps its state: an attempt dropped
    leaves none, and the next group restores from the checkpoint."""

    def __init__(self, state: TrainState) -> None:
        self._state = state
        self.restored_step = state.step

    @property
    def committed(self) -> int:
        return self._state.step

    def commit(self, engine, state: TrainState, window: StepMetrics, flush: bool) -> None:
        pass

    def flush(self) -> None:
        pass

    def failure(
        self,
        error: BaseException,
        failed_at: float,
        state: TrainState,
        world_size: int,
        nodes: list[str],
        left: Optional[Leftovers],
    ) -> Interrupted:
        stepped = state.step > self.restored_step
        return interrupted_by_loss(error, failed_at, stepped, state, world_size, nodes, left)

    def leftovers(
        self,
        interruption: Interrupted,
        unreported: Unreported,
        known_good: list[tuple[str, str]],
        saving: Union[AsyncSaver, SaveProcess, None],
    ) -> Leftovers:
        return Leftovers.dropped({}, interruption, unreported, known_good, saving)


class RayTrainGroup(Group):
    """The worker group Ray Train started: its ranks, its reports (`ray.train.report`)."""

    left = None
    joined = short_of_members = False
    spares_waiting = joiners_waiting = None

    def __init__(self) -> None:
        context = ray.train.get_context()
        self.rank, self.world_size = context.get_world_rank(), context.get_world_size()

    def send(self, report: dict) -> None:
        ray.train.report(report)

    def reports_collected(self) -> bool:
        return ray_compat.reports_collected()

    def held_by_peers(self) -> None:
        return None

    def commits(self, state: TrainState, nodes: list[str]) -> Commits:
        return Trained(state)

    def formed(self, step: int, nodes: list[str]) -> list[Event]:
        return []

    def recovered(self, restored_at: float, restored_step: int) -> list[Event]:
        return []

    def metrics(self) -> dict[str, int]:
        return {}


class RestartMembership(Membership):
    """The restart path: Ray Train's worker group is this worker's one group, and any failure
    ends it on every rank (`collectives.failing_together`); Ray restarts it from the checkpoint."""

    def form(self, left: Optional[Leftovers]) -> Group:
        return RayTrainGroup()

    def lost_member(self, error: BaseException, peer_failure: Callable[[], Optional[str]]) -> bool:
        return False

    def leave(self) -> None:
        pass


class InProcessGroup(Group):
    """One generation of an in-process group: its rank and size, reports past Ray's barrier
    (a joiner's through its relay), peer commits, and the spares and joiners waiting."""

    def __init__(self, in_process: InProcess) -> None:
        self.in_process = in_process
        member, generation = in_process.member, in_process.generation
        self.rank, self.world_size = generation.rank, generation.world_size
        self.left, self.joined = in_process.left, member.joined
        self.short_of_members = self.world_size < member.group_size
        self.spares_waiting, self.joiners_waiting = member.spares_waiting, member.joiners_waiting

    def send(self, report: dict) -> None:
        # A joiner is no Ray Train worker: it reports through its relay (`elastic.relay`).
        if self.joined:
            RELAY.put(report)
        else:
            ray_compat.report_without_barrier(report)

    def reports_collected(self) -> bool:
        if self.joined:
            return RELAY.empty() if self.rank == 0 else True
        return ray_compat.reports_collected()

    def held_by_peers(self) -> Optional[checkpointing.HeldByPeers]:
        if self.left is None:
            return None
        return checkpointing.gather_from_peers(self.in_process.member.mirrors, self.left.states, self.world_size)

    def commits(self, state: TrainState, nodes: list[str]) -> Commits:
        return PeerCommits(self.in_process, state, nodes)

    def formed(self, step: int, nodes: list[str]) -> list[Event]:
        return [Formed(time.time(), self.in_process.generation.number, step, list(nodes))]

    def recovered(self, restored_at: float, restored_step: int) -> list[Event]:
        if self.left is None or self.left.interruption is None:
            return []
        return self.in_process.recovered(restored_at, restored_step)

    def metrics(self) -> dict[str, int]:
        return {"spares": self.in_process.member.spares_waiting()} if self.rank == 0 else {}


class InProcessMembership(Membership):
    """elastic.in_process: the generations of `member`, each formed at a re-form or a join
    and restored from the members' mirrors where any rank's last attempt trained."""

    def __init__(self, member: Member) -> None:
        self.member = member
        # A rank's own failure goes through the driver's store: Ray's lives in rank 0's
        # process, which the generations outlive.
        self.peer_store = member.store

    def form(self, left: Optional[Leftovers]) -> Group:
        generation = self.member.form()
        # Peers or the checkpoint, as every rank does; shared leftovers let any rank's report stand in for rank 0's.
        return InProcessGroup(InProcess(self.member, generation, agree_on_restore(left)))

    def lost_member(self, error: BaseException, peer_failure: Callable[[], Optional[str]]) -> bool:
        return self.member.lost_member(error, peer_failure)

    def leave(self) -> None:
        self.member.leave()
