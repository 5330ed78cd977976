"""What an in-process attempt (elastic.in_process) is given: its member and generation, and
what the attempt dropped before it left (`Leftovers`), restored from as all ranks agree
(`agree_on_restore`); the steps it commits (`PeerCommits`); and the recovery it records."""

from __future__ import annotations

import dataclasses
import enum
import time
from dataclasses import dataclass
from typing import Optional, Sequence, Union

from wildtrain.checkpoint.async_save import AsyncSaver
from wildtrain.checkpoint.save_process import SaveProcess
from wildtrain.events import Event, Failure, Interrupted, Recovered
from wildtrain.train import collectives
from wildtrain.train.in_process import Generation, Member
from wildtrain.train.state import TrainState
from wildtrain.train.step import StepMetrics

_SHARED = ("windows", "events", "committed", "known_good", "interruption")  # `Leftovers.of_rank`


@dataclass(frozen=True)
class Leftovers:
    """What an attempt dropped by an in-process re-form hands the next one: the state of its
    last committed steps, what its reports had not carried yet, and how it saved: its saver
    at a hand-over to joiners (a save in flight still commits), else its save process (idle,
    its imports done). A joiner's holds only a save process, spawned before it asked to join."""

    states: dict[int, TrainState]  # this rank's last committed steps
    windows: list[dict]  # resolved metrics windows
    events: list[Event]
    committed: list[str]  # checkpoints committed since the last report
    known_good: list[tuple[str, str]]
    # The interruption the next attempt recovers from: a member's loss (`Failure`) or the
    # joiners' arrival (`Resize`); None for a joiner, until its generation shares rank 0's.
    interruption: Optional[Interrupted]
    saving: Union[AsyncSaver, SaveProcess, None] = None

    def of_rank(self, source: int) -> Leftovers:
        """These with rank `source`'s windows, events, commits, known-good checkpoints and
        interruption, on every rank of the next generation (a collective at its start). A joiner
        has none of them, and the controller logs rank 0's reports: where rank 0's node takes one
        before the controller collected it, the next rank's report stands in, and must carry the same."""
        return dataclasses.replace(
            self, **collectives.broadcast_object({name: getattr(self, name) for name in _SHARED}, src=source)
        )

    def without_saves_in_flight(self) -> Leftovers:
        """These, where a member was lost before the next attempt took them: a save in flight
        is abandoned (the lost member's part may never come), its process kept where idle."""
        if not isinstance(self.saving, AsyncSaver):
            return self
        return dataclasses.replace(self, saving=self.saving.close_keeping_process(timeout_s=0))

    @classmethod
    def dropped(
        cls,
        states: dict[int, TrainState],
        interruption: Interrupted,
        unreported: Unreported,
        known_good: list[tuple[str, str]],
        saving: Union[AsyncSaver, SaveProcess, None],
    ) -> "Leftovers":
        """What an attempt dropped at the states `states` leaves, with what its reports had not carried."""
        return cls(
            states=states,
            windows=unreported.windows,
            events=unreported.events,
            committed=unreported.committed,
            known_good=known_good,
            interruption=interruption,
            saving=saving,
        )

    @classmethod
    def joiner(cls, save_process: Optional[SaveProcess]) -> "Leftovers":
        return cls(
            states={}, windows=[], events=[], committed=[], known_good=[], interruption=None, saving=save_process
        )


class RestoreFrom(enum.Enum):
    CHECKPOINT = "checkpoint"
    PEERS = "peers"


@dataclass(frozen=True)
class RestorePlan:
    source: RestoreFrom
    shared_by: Optional[int]  # from peers: the rank whose unreported windows, events and commits every rank carries


def plan_restore(trained: Sequence[bool]) -> RestorePlan:
    """How every rank of a new generation restores, from whether each rank's last attempt in
    this worker group trained (`trained[rank]`: it left the states of its committed steps):
    from the peers' mirrors where any did, sharing the lowest such rank's leftovers; from the
    checkpoint where none did (every first attempt died during start-up, or only joiners hold
    leftovers). One path for all: a rank that chose alone waited in collectives the others
    never entered."""
    source = next((rank for rank, did in enumerate(trained) if did), None)
    if source is None:
        return RestorePlan(RestoreFrom.CHECKPOINT, None)
    return RestorePlan(RestoreFrom.PEERS, source)


def agree_on_restore(left: Optional[Leftovers]) -> Optional[Leftovers]:
    """Collectively, at a generation's start: what this rank's attempt restores from, given
    what this rank's last attempt left (None: none, or none that trained). Leftovers: from the
    peers, with those `plan_restore` shares (a rank that left none takes a joiner's part);
    None, on every rank alike: from the checkpoint."""
    plan = plan_restore(collectives.all_gather_object(left is not None and bool(left.states)))
    if plan.source is RestoreFrom.PEERS:
        return (left or Leftovers.joiner(None)).of_rank(plan.shared_by)
    if left is not None and isinstance(left.saving, SaveProcess):
        left.saving.stop(timeout_s=0)  # a joiner's, spawned ahead: the checkpoint's attempt starts its own
    return None


@dataclass(frozen=True)
class Unreported:
    """What an attempt's reports have not carried yet: its resolved metrics windows, its
    events and the checkpoints committed since (with the checkpoint metrics of those saves)."""

    windows: list[dict]
    events: list[Event]
    committed: list[str]
    checkpoint_metrics: dict


@dataclass(frozen=True)
class InProcess:
    """An attempt of elastic.in_process: its member, the generation it trains in, and what the
    attempt before it left (None: the worker group's first, which restores a checkpoint; a
    joiner's: the state comes from the members)."""

    member: Member
    generation: Generation
    left: Optional[Leftovers]

    def recovered(self, restored_at: float, restored_step: int) -> list[Event]:
        """The interruption this re-formed attempt recovered from, and its recovery, at its first step."""
        interruption = self.left.interruption
        done = recovered(
            interruption, self.generation.formed_at, restored_at, restored_step, self.generation.world_size
        )
        return [interruption, done]


class PeerCommits:
    """The steps an in-process attempt committed. A step's ZeRO partitions are mirrored on the
    ring successors (elastic.peer_state) while the next step trains: its commit starts sending
    this rank's partition, and the next step's commit waits for that exchange and then settles
    its window's loss over the ranks, a collective no rank enters before its exchange is done.
    Once it returns, every mirror of the step before is in place, and that step and its loss
    survive any one rank's death (`committed`). A death costs at most the step in flight and
    the one whose mirrors were still on their way: what it drops with them (their windows,
    validation, save) is done again with them, and the windows closed since the last
    committed step wait in `Attempt.report` until their step commits. A step that saves (its
    report lets its save commit), ends the run or takes joiners in commits at once
    (`commit(flush=True)`), and a divergence's report commits the last step (`flush`)."""

    def __init__(self, in_process: InProcess, state: TrainState, nodes: list[str]) -> None:
        self.mirrors = in_process.member.mirrors
        self.mirrors.use_layout(in_process.generation.number, in_process.generation.world_size, nodes)
        self.restored_step = state.step
        self.states = {state.step: dataclasses.replace(state)}
        self.committed = state.step  # every mirror of it is in place on every rank
        self._pending: Optional[int] = None  # the step whose exchange is on its way, if any

    def commit(self, engine, state: TrainState, window: StepMetrics, flush: bool = False) -> None:
        """Start mirroring the step just done, and commit the one before it (with `flush`, this
        one too): the collective that settles the open window's loss goes only once this
        rank's exchange before it is done."""
        self.mirrors.exchange(engine, state.step)  # waits for the last step's exchange first
        if flush:
            self.mirrors.settle()
        window.settle()
        settled = state.step if flush else self._pending
        if settled is not None:
            self.committed = settled
        self._pending = None if flush else state.step
        self.states[state.step] = dataclasses.replace(state)
        for old in sorted(self.states)[: -self.mirrors.keep_steps]:
            del self.states[old]

    def flush(self) -> None:
        """Commit the last step now (a collective: every rank flushes at the same step)."""
        if self._pending is None:
            return
        self.mirrors.settle()
        collectives.all_ranks(True)  # no rank leaves before every rank's exchange is done
        self.committed, self._pending = self._pending, None

    def failure(
        self,
        error: BaseException,
        failed_at: float,
        state: TrainState,
        world_size: int,
        nodes: list[str],
        left: Optional[Leftovers],
    ) -> Interrupted:
        """The interruption of an attempt that lost a member to `error` at `failed_at`. A step
        trained but not committed yet is trained again: lost, in the failure's accounting."""
        stepped = max(self.states) > self.restored_step
        return interrupted_by_loss(error, failed_at, stepped, state, world_size, nodes, left)

    def leftovers(
        self,
        interruption: Interrupted,
        unreported: Unreported,
        known_good: list[tuple[str, str]],
        saving: Union[AsyncSaver, SaveProcess, None],
    ) -> Leftovers:
        """What the next generation needs of this attempt, dropped at its last committed step."""
        self.mirrors.forget_after(max(self.states))
        return Leftovers.dropped(dict(self.states), interruption, unreported, known_good, saving)


def interrupted_by_loss(
    error: BaseException,
    failed_at: float,
    stepped: bool,
    state: TrainState,
    world_size: int,
    nodes: list[str],
    left: Optional[Leftovers],
) -> Interrupted:
    """The interruption of an attempt at `state` that lost a member to `error` at `failed_at`:
    `left`'s where it never `stepped` past its restore (the same outage), else a new `Failure`."""
    if stepped or left is None or left.interruption is None:
        return Failure(
            failed_at,
            world_size,
            state.step,
            f"a member left the group of {world_size}: {str(error).splitlines()[0][:200]}",
            nodes,
        )
    return left.interruption


def recovered(
    interruption: Interrupted,
    formed_at: float,
    restored_at: float,
    restored_step: int,
    world_size: int,
    now: Optional[float] = None,
) -> Recovered:
    """The recovery from `interruption` of an attempt re-formed in-process whose generation formed at
    `formed_at`, whose state was rebuilt from its peers by `restored_at` at `restored_step`, and
    whose first step is done `now`: for the run's timeline and goodput, as a restarted group's
    (`tracking.controller.timeline`)."""
    now = time.time() if now is None else now
    return Recovered(
        now,
        interruption.KIND,
        interruption.world_size,
        world_size,
        restart_s=formed_at - interruption.at,
        restore_s=restored_at - formed_at,
        reshard_s=0.0,
        recovery_s=now - interruption.at,
        restored_step=restored_step,
        steps_lost=max(0, interruption.last_step - restored_step),
    )
