"""The controller's restart decisions, pure: why a group restarts (`classify_restart`),
what a change of Ray Train's controller state means (`interpret`, for every callback that
cares), and what the restart policy does about it (`decide`; `controller.RestartPolicy`
acts on the decision, as Ray Train's controller acts on its failure policy's decision).
Ray's states and errors are read through `ray_compat` only."""

from __future__ import annotations

import functools
import json
import re
import time
from dataclasses import dataclass, field, replace
from typing import Optional

from wildtrain import ray_compat
from wildtrain.elastic.signals import PeerFailed, PlannedRegrow, RunCannotContinue, UnhealthyNodes
from wildtrain.events import Event, NodeExcluded, from_dict


@dataclass(frozen=True)
class Restart:
    """Why the controller restarts a worker group (see `classify_restart`)."""

    kind: str  # "failure" or "resize"
    cause: str
    # wildtrain's own decision (a planned regrow, leaving out unhealthy nodes), not a fault
    # of the workers: not counted against elastic.max_failures.
    planned: bool
    events: list[Event] = field(default_factory=list)  # what the restart carries for MLflow
    # A restart cannot help (`RunCannotContinue`): the run ends with `cause`.
    fatal: bool = False


def worker_error_cause(per_worker: dict) -> str:
    """`rank N: <its exception's line>` of the first worker whose failure is its own (not a
    `PeerFailed`); "" when there is none."""
    for rank, failure in sorted(per_worker.items()):
        text = str(failure).strip()
        if not text or PeerFailed.MARKER in text:
            continue
        return f"rank {rank}: {text.splitlines()[-1][:500]}"
    return ""


@functools.lru_cache(maxsize=16)
def classify_restart(error: BaseException | None) -> Restart:
    """Why the controller is restarting the group, from its error: Ray's summary of the
    workers' exceptions (truncated), and each worker's own traceback text, whole. Cached
    by the error's identity: the controller's callbacks each ask, and get one answer."""
    text = str(error).strip() if error is not None else ""
    per_worker = "\n".join(str(failure) for failure in ray_compat.worker_failures(error).values())
    if PlannedRegrow.__name__ in text + per_worker:
        return Restart("resize", "room for more workers", planned=True)
    fatal = re.search(rf"^{re.escape(RunCannotContinue.MARKER)} (\".*\")$", text + "\n" + per_worker, re.MULTILINE)
    if fatal:
        return Restart("failure", json.loads(fatal[1]), planned=False, fatal=True)
    # Every rank raises UnhealthyNodes with the same results (`train.monitor.Monitor`): one rank's are logged.
    found = [
        json.loads(m) for m in re.findall(rf"^{re.escape(UnhealthyNodes.MARKER)} (\{{.*\}})$", per_worker, re.MULTILINE)
    ]
    if found:
        nodes = sorted({node for f in found for node in f["nodes"]})
        at = time.time()
        excluded = [
            NodeExcluded(at, node, f"node {node} failed the pre-flight health check; left out of the run")
            for node in nodes
        ]
        checks = [from_dict(check) for check in found[0]["checks"]]
        return Restart(
            "failure",
            f"health check failed on node(s) {', '.join(nodes)}; left out of the run",
            planned=True,
            events=checks + excluded,
        )
    cause = worker_error_cause(ray_compat.worker_failures(error))
    return Restart("failure", cause or (text.splitlines()[0][:500] if text else ""), planned=False)


@dataclass(frozen=True)
class Transition:
    """What one change of the controller's state means (`interpret`). `kind`:

    - "start": the controller starts a group of `workers` (SCHEDULING);
    - "running": a group runs (RUNNING; PREEMPTING, while it drains);
    - "failure": a running group failed (RESTARTING); `restart` says why. While the cluster
      lacks room, the controller re-enters RESTARTING, with the same error, at every turn
      of its loop (`again`): the failure is the first entry's;
    - "resize": a running group stops to restart at another size: a planned regrow
      (RESTARTING, `restart` says so), or Ray's own resize (RESIZING, no `restart`: off in
      wildtrain, where growing is the workers' decision);
    - "start_failed": the start of a group of `workers` failed (RESCHEDULING); `timed_out`
      if its workers found no room in time;
    - "waiting": the controller has no group and waits for a scaling decision
      (INITIALIZING, or RESCHEDULING again);
    - "finish": shutting down, or done.
    """

    kind: str
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
    def interruption(self) -> Optional[str]:
        """What the run's timeline records: "failure" or "resize"; None when no group stopped
        or failed to start."""
        return {"failure": "failure", "start_failed": "failure", "resize": "resize"}.get(self.kind)


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
        return Transition("running")
    if name == "RESIZING":
        return Transition("resize", workers=current.workers)
    if name == "SCHEDULING":
        return Transition("start", workers=current.workers)
    if name not in _WAITING_STATES:
        return Transition("finish")
    again = previous.name == name and previous.error is error
    if name == "RESTARTING":
        restart = classify_restart(error)
        # Like Ray's own policy, only workers' failures count; a group that could not
        # start in time is the capacity wait's business.
        return Transition(
            restart.kind,
            restart,
            error,
            lost_process=ray_compat.lost_a_worker_process(error),
            counted=ray_compat.counts_as_failure(error) and not restart.planned,
            again=again,
        )
    if name == "RESCHEDULING" and previous.name == "SCHEDULING":
        return Transition(
            "start_failed",
            classify_restart(error),
            error,
            workers=previous.workers,
            timed_out=ray_compat.start_timed_out(error),
        )
    return Transition("waiting", again=again)


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
    its size. After a node dies, Ray's resource view still counts it for up to ~30 s, so the
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
    if t.kind == "running":
        waited_s = None if capacity.no_room_since is None else now - capacity.no_room_since
        return RestartDecision(budget, capacity.running(), waited_s)
    if t.kind == "start":
        return RestartDecision(budget, capacity.attempt(now))
    if t.kind == "finish" or (t.kind == "resize" and t.restart is None):
        return RestartDecision(budget, capacity)
    capacity = capacity.waiting(now)
    if t.kind == "start_failed":
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
