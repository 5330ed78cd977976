"""The controller's restart decisions, pure: what a change of Ray Train's controller state
means (`interpret`, once per change, for every consumer of `controller.ControllerEvents`), why a
group restarts (`classify_restart`), and what the restart policy does about it (`decide`;
`controller.RestartPolicy` acts on the decision, as Ray Train's controller acts on its failure
policy's decision). Ray's states and errors are read through `ray_compat` only, and only by
`seen`: the rest takes what it read (`StateSeen`), with no Ray type."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Optional

from wildtrain import ray_compat
from wildtrain.controller_events import Restart, RestartKind, RestartReason, Transition, TransitionKind
from wildtrain.elastic.signals import PeerFailed, PlannedRegrow, RunCannotContinue, UnhealthyNodes
from wildtrain.events import NodeExcluded


@dataclass(frozen=True)
class StateSeen:
    """What a state of Ray Train's controller holds, as `seen` reads it."""

    name: str  # INITIALIZING, SCHEDULING, RUNNING, RESTARTING, ...
    workers: Optional[int] = None  # the group size Ray decided on (SCHEDULING, RESIZING)
    # The failure the state holds (RESTARTING, RESCHEDULING, ERRORED); its identity tells a
    # new failure from one seen again.
    error: Optional[BaseException] = field(default=None, compare=False, repr=False)
    # Each failed worker's exception, by rank, as it raised it (a worker group's failure).
    failures: dict[int, BaseException] = field(default_factory=dict)
    by_workers: bool = False  # the workers' own failure, which Ray's failure policy counts
    lost_process: bool = False  # a worker's process (so perhaps its node) was lost
    start_timed_out: bool = False  # a group's start found no room in time
    summary: str = ""  # the first line of the error's text


def seen(state) -> StateSeen:
    """A state as `after_controller_state_update` hands it to callbacks."""
    read = ray_compat.controller_state(state)
    error = read.error
    text = str(error).strip() if error is not None else ""
    return StateSeen(
        read.name,
        read.workers,
        error,
        ray_compat.worker_failures(error),
        by_workers=ray_compat.counts_as_failure(error),
        lost_process=ray_compat.lost_a_worker_process(error),
        start_timed_out=ray_compat.start_timed_out(error),
        summary=text.splitlines()[0][:500] if text else "",
    )


def worker_error_cause(per_worker: dict[int, BaseException]) -> str:
    """`rank N: <its exception's last line>` of the first worker whose failure is its own
    (not a `PeerFailed`); "" when there is none."""
    for rank, failure in sorted(per_worker.items()):
        text = str(failure).strip()
        if not text or isinstance(failure, PeerFailed):
            continue
        return f"rank {rank}: {text.splitlines()[-1][:500]}"
    return ""


def classify_restart(state: StateSeen) -> Restart:
    """Why the controller is restarting the group, from the error `state` holds: each worker's
    exception as it raised it, read by its type."""
    failures = [failure for _, failure in sorted(state.failures.items())]
    if any(isinstance(failure, PlannedRegrow) for failure in failures):
        return Restart(RestartReason.REGROW, "room for more workers")
    fatal = next((failure for failure in failures if isinstance(failure, RunCannotContinue)), None)
    if fatal is not None:
        return Restart(RestartReason.CANNOT_CONTINUE, fatal.message)
    unhealthy = [failure for failure in failures if isinstance(failure, UnhealthyNodes)]
    if unhealthy:
        nodes = sorted({node for failure in unhealthy for node in failure.nodes})
        at = time.time()
        excluded = [
            NodeExcluded(at, node, f"node {node} failed the pre-flight health check; left out of the run")
            for node in nodes
        ]
        # Every rank raises UnhealthyNodes with the same results (`train.monitor.Monitor`): one rank's are logged.
        return Restart(
            RestartReason.UNHEALTHY_NODES,
            f"health check failed on node(s) {', '.join(nodes)}; left out of the run",
            events=[*unhealthy[0].checks, *excluded],
        )
    return Restart(RestartReason.WORKERS_FAILED, worker_error_cause(state.failures) or state.summary)


# A restart's transition: of the same kind.
_RESTART_TRANSITIONS = {RestartKind.FAILURE: TransitionKind.FAILURE, RestartKind.RESIZE: TransitionKind.RESIZE}


# Controller states in which a worker group exists and runs (or drains), and those in which
# the controller has none and waits for a scaling decision that can start one.
_GROUP_STATES = ("RUNNING", "PREEMPTING")
_WAITING_STATES = ("INITIALIZING", "RESTARTING", "RESCHEDULING")
# Every state of Ray Train's controller (2.60); those not named above either start a group
# (SCHEDULING), resize one (RESIZING), or end the run.
CONTROLLER_STATES = (
    _GROUP_STATES + _WAITING_STATES + ("SCHEDULING", "RESIZING", "SHUTTING_DOWN", "ERRORED", "FINISHED", "ABORTED")
)


def interpret(previous: StateSeen, current: StateSeen) -> Transition:
    """What the change from `previous` to `current` means."""
    name, error = current.name, current.error
    if name in _GROUP_STATES:
        return Transition(TransitionKind.RUNNING)
    if name == "RESIZING":
        return Transition(TransitionKind.RESIZE, workers=current.workers)
    if name == "SCHEDULING":
        return Transition(TransitionKind.START, workers=current.workers)
    if name not in _WAITING_STATES:
        return Transition(TransitionKind.FINISH)
    again = previous.name == name and previous.error is error
    if name == "RESTARTING":
        restart = classify_restart(current)
        # Like Ray's own policy, only workers' failures count; a group that could not
        # start in time is the capacity wait's business.
        return Transition(
            _RESTART_TRANSITIONS[restart.kind],
            restart,
            error,
            lost_process=current.lost_process,
            counted=current.by_workers and not restart.planned,
            again=again,
        )
    if name == "RESCHEDULING" and previous.name == "SCHEDULING":
        return Transition(
            TransitionKind.START_FAILED,
            classify_restart(current),
            error,
            workers=previous.workers,
            timed_out=current.start_timed_out,
        )
    return Transition(TransitionKind.WAITING, again=again)


@dataclass(frozen=True)
class FailureBudget:
    """The failures counted against elastic.max_failures (-1: no limit). A failure is known
    by its error: while the cluster lacks capacity, the controller re-enters its RESTARTING
    state, with the same error, at every turn of its loop."""

    max_failures: int
    failures: int = 0
    last_error: Optional[BaseException] = field(default=None, compare=False, repr=False)

    def is_new(self, error: BaseException) -> bool:
        return error is not self.last_error

    def after(self, error: BaseException, counts: bool) -> "FailureBudget":
        if not self.is_new(error):
            return self
        return replace(self, failures=self.failures + int(counts), last_error=error)

    @property
    def exceeded(self) -> bool:
        return 0 <= self.max_failures < self.failures


@dataclass(frozen=True)
class CapacityClock:
    """How long the controller has gone without capacity for a worker group, the time that
    elastic.capacity_wait_s bounds.

    It runs from the moment no group runs until one runs again (a start that succeeds, however
    slowly, ends the wait): while Ray's scaling policy sees room for fewer than min_workers,
    and through start attempts that failed. One kind of failed attempt is not counted: one
    for more than min_workers workers that timed out waiting for room, the first time at
    its size. After a node dies, Ray's resource view still counts it for a while, so the
    first attempt may be sized for a group that cannot fit while a smaller one can; its
    time says nothing about the capacity for min_workers. A second timed-out attempt at the
    same size counts (the view is not merely stale), so the wait stays bounded."""

    min_workers: int
    waiting_since: Optional[float] = None  # time.monotonic(); None while a group runs
    attempt_started: Optional[float] = None  # the start attempt in flight, if any
    forgiven_sizes: frozenset[int] = frozenset()  # sizes whose timed-out attempt was not counted
    # Since when the wait is for room (a counted failed attempt, or no group to attempt),
    # not a restart going its usual way: goodput's WAITING.
    no_room_since: Optional[float] = None

    def running(self) -> "CapacityClock":
        return CapacityClock(self.min_workers)

    def no_room(self, now: float) -> "CapacityClock":
        clock = self.waiting(now)
        return clock if clock.no_room_since is not None else replace(clock, no_room_since=clock.waiting_since)

    def waiting(self, now: float) -> "CapacityClock":
        return self if self.waiting_since is not None else replace(self, waiting_since=now)

    def attempt(self, now: float) -> "CapacityClock":
        return replace(self.waiting(now), attempt_started=now)

    def attempt_failed(self, now: float, size: int, timed_out: bool) -> "CapacityClock":
        clock = replace(self.waiting(now), attempt_started=None)
        if timed_out and size > self.min_workers and size not in self.forgiven_sizes:
            return replace(
                clock,
                waiting_since=clock.waiting_since + (now - self.attempt_started),
                forgiven_sizes=self.forgiven_sizes | {size},
            )
        if clock.no_room_since is None:
            clock = replace(clock, no_room_since=self.attempt_started)
        return clock

    def waited_s(self, now: float) -> float:
        return 0.0 if self.waiting_since is None else now - self.waiting_since


@dataclass(frozen=True)
class RestartDecision:
    """What the restart policy does after a change of the controller's state, in this order."""

    budget: FailureBudget
    capacity: CapacityClock
    waited_s: Optional[float] = None  # a wait for room ended: record it (`Waiting`)
    exclude: frozenset[str] = frozenset()  # nodes to leave out of the run
    end: Optional[str] = None  # the run ends with this error
    await_lost_nodes: bool = False  # until Ray marks the failed group's lost nodes dead
    # Refresh Ray's resource view, so the next group is sized for what is alive; `paced`:
    # at a turn of the controller's loop, which does not pause by itself.
    refresh: bool = False
    paced: bool = False
    # After the steps above: end the run if no group has run for capacity_wait_s (`CapacityClock`).
    bounded: bool = False


def decide(t: Transition, budget: FailureBudget, capacity: CapacityClock, now: float) -> RestartDecision:
    """The restart policy (`controller.RestartPolicy` says what it is for) for transition
    `t` at time.monotonic() `now`."""
    if t.kind is TransitionKind.RUNNING:
        waited_s = None if capacity.no_room_since is None else now - capacity.no_room_since
        return RestartDecision(budget, capacity.running(), waited_s)
    if t.kind is TransitionKind.START:
        return RestartDecision(budget, capacity.attempt(now))
    if t.kind is TransitionKind.FINISH or (t.kind is TransitionKind.RESIZE and t.restart is None):
        return RestartDecision(budget, capacity)
    capacity = capacity.waiting(now)
    if t.kind is TransitionKind.START_FAILED:
        # Too big a group for a stale view, most often: let the next decision see what is alive.
        return RestartDecision(budget, capacity.attempt_failed(now, t.workers, t.timed_out), refresh=True, bounded=True)
    if t.restart is not None and budget.is_new(t.error):
        return _after_failure(t, budget, capacity)
    # Another turn of the controller's loop.
    return RestartDecision(
        budget, capacity.no_room(now) if t.again else capacity, refresh=True, paced=True, bounded=True
    )


def _after_failure(t: Transition, budget: FailureBudget, capacity: CapacityClock) -> RestartDecision:
    """Once per failure of a running group: leave out the nodes its health check failed,
    count it, and size the restart for the nodes that are alive."""
    exclude = frozenset(e.node for e in t.restart.events if isinstance(e, NodeExcluded))
    if t.restart.fatal:
        return RestartDecision(budget, capacity, exclude=exclude, end=t.restart.cause)
    budget = budget.after(t.error, counts=t.counted)
    if budget.exceeded:
        return RestartDecision(
            budget,
            capacity,
            exclude=exclude,
            end=(
                f"elastic.max_failures: {budget.failures} failures, more than the {budget.max_failures} "
                f"allowed; the last: {t.restart.cause[:300]}"
            ),
        )
    return RestartDecision(
        budget, capacity, exclude=exclude, await_lost_nodes=t.lost_process, refresh=True, bounded=True
    )
