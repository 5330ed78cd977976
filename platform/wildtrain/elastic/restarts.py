"""The controller's restart decisions, pure: why a group restarts (`classify_restart`),
what a change of Ray Train's controller state means (`interpret`, for every callback that
cares), and what the restart policy does about it (`decide`; `controller.RestartPolicy`
acts on the decision, as Ray Train's controller acts on its failure policy's decision).
Ray's states and errors are read through `ray_compat` only."""

from __future__ import annotations

import enum
import functools
import time
from dataclasses import dataclass, field, replace
from typing import Optional

from wildtrain import ray_compat
from wildtrain.elastic.signals import PeerFailed, PlannedRegrow, RunCannotContinue, UnhealthyNodes
from wildtrain.events import Event, Failure, Interrupted, NodeExcluded, Resize


class RestartKind(enum.Enum):
    """Why a worker group stops: its workers failed, or it restarts at another size."""

    FAILURE = "failure"
    RESIZE = "resize"


@dataclass(frozen=True)
class Restart:
    """Why the controller restarts a worker group (see `classify_restart`)."""

    kind: RestartKind
    cause: str
    # wildtrain's own decision (a planned regrow, leaving out unhealthy nodes), not a fault
    # of the workers: not counted against elastic.max_failures.
    planned: bool
    events: list[Event] = field(default_factory=list)  # what the restart carries for MLflow
    # A restart cannot help (`RunCannotContinue`): the run ends with `cause`.
    fatal: bool = False


def worker_error_cause(per_worker: dict[int, BaseException]) -> str:
    """`rank N: <its exception's last line>` of the first worker whose failure is its own
    (not a `PeerFailed`); "" when there is none."""
    for rank, failure in sorted(per_worker.items()):
        text = str(failure).strip()
        if not text or isinstance(failure, PeerFailed):
            continue
        return f"rank {rank}: {text.splitlines()[-1][:500]}"
    return ""


@functools.lru_cache(maxsize=16)
def classify_restart(error: BaseException | None) -> Restart:
    """Why the controller is restarting the group, from its error: each worker's exception as
    it raised it (`ray_compat.worker_failures`), read by its type. Cached by the error's
    identity: the controller's callbacks each ask, and get one answer."""
    per_worker = ray_compat.worker_failures(error)
    failures = [failure for _, failure in sorted(per_worker.items())]
    if any(isinstance(failure, PlannedRegrow) for failure in failures):
        return Restart(RestartKind.RESIZE, "room for more workers", planned=True)
    fatal = next((failure for failure in failures if isinstance(failure, RunCannotContinue)), None)
    if fatal is not None:
        return Restart(RestartKind.FAILURE, fatal.message, planned=False, fatal=True)
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
            RestartKind.FAILURE,
            f"health check failed on node(s) {', '.join(nodes)}; left out of the run",
            planned=True,
            events=[*unhealthy[0].checks, *excluded],
        )
    text = str(error).strip() if error is not None else ""
    cause = worker_error_cause(per_worker)
    return Restart(RestartKind.FAILURE, cause or (text.splitlines()[0][:500] if text else ""), planned=False)


class TransitionKind(enum.Enum):
    """What a change of the controller's state means (see `Transition`)."""

    START = "start"
    RUNNING = "running"
    FAILURE = "failure"
    RESIZE = "resize"
    START_FAILED = "start_failed"
    WAITING = "waiting"
    FINISH = "finish"


@dataclass(frozen=True)
class Transition:
    """What one change of the controller's state means (`interpret`). `kind`:

    - START: the controller starts a group of `workers` (SCHEDULING);
    - RUNNING: a group runs (RUNNING; PREEMPTING, while it drains);
    - FAILURE: a running group failed (RESTARTING); `restart` says why. While the cluster
      lacks room, the controller re-enters RESTARTING, with the same error, at every turn
      of its loop (`again`): the failure is the first entry's;
    - RESIZE: a running group stops to restart at another size: a planned regrow
      (RESTARTING, `restart` says so), or Ray's own resize (RESIZING, no `restart`: off in
      wildtrain, where growing is the workers' decision);
    - START_FAILED: the start of a group of `workers` failed (RESCHEDULING); `timed_out`
      if its workers found no room in time;
    - WAITING: the controller has no group and waits for a scaling decision
      (INITIALIZING, or RESCHEDULING again);
    - FINISH: shutting down, or done.
    """

    kind: TransitionKind
    restart: Optional[Restart] = None
    # Ray's error; its identity tells a new failure from one seen again.
    error: Optional[BaseException] = field(default=None, compare=False, repr=False)
    workers: Optional[int] = None
    timed_out: bool = False
    lost_process: bool = False  # a worker's process (so perhaps its node) was lost
    counted: bool = False  # counted against elastic.max_failures: the workers' own failure, not planned
    # The state the controller was in, again: a turn of its loop that decided nothing, for want of room.
    again: bool = False

    @property
    def cause(self) -> str:
        return self.restart.cause if self.restart is not None else ""

    @property
    def events(self) -> list[Event]:
        """What the restart carries for MLflow (a failed health check's results, the nodes left out)."""
        return self.restart.events if self.restart is not None else []

    @property
    def interruption(self) -> Optional[type[Interrupted]]:
        """The event the run's timeline records (`Failure`, `Resize`); None when no group
        stopped or failed to start."""
        return _INTERRUPTIONS.get(self.kind)


_INTERRUPTIONS = {TransitionKind.FAILURE: Failure, TransitionKind.START_FAILED: Failure, TransitionKind.RESIZE: Resize}
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


def interpret(previous: ray_compat.ControllerState, current: ray_compat.ControllerState) -> Transition:
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
        restart = classify_restart(error)
        # Like Ray's own policy, only workers' failures count; a group that could not
        # start in time is the capacity wait's business.
        return Transition(
            _RESTART_TRANSITIONS[restart.kind],
            restart,
            error,
            lost_process=ray_compat.lost_a_worker_process(error),
            counted=ray_compat.counts_as_failure(error) and not restart.planned,
            again=again,
        )
    if name == "RESCHEDULING" and previous.name == "SCHEDULING":
        return Transition(
            TransitionKind.START_FAILED,
            classify_restart(error),
            error,
            workers=previous.workers,
            timed_out=ray_compat.start_timed_out(error),
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
