"""What happens to a run as the Ray Train controller sees it, typed and read once: what a change
of the controller's state means (`Transition`, read by `elastic.restarts.interpret`), the
run's elastic timeline entries (`Interruption`, `Recovery`: `Failure`, `Resize` and `Recovered`
with the recovery path they belong to, from `tracking.controller.timeline`, the one place the
controller builds or takes them), and the messages that `elastic.controller.ControllerEvents`
publishes to its consumers (`Consumer`), in the order of their `Stage`. Pure: no Ray, no MLflow.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import ClassVar, Optional, Sequence, Union

from wildtrain.events import Event, Failure, Interrupted, Recovered, Resize
from wildtrain.worker_report import WorkerReport


class RestartKind(enum.Enum):
    """Why a worker group stops: its workers failed, or it restarts at another size."""

    FAILURE = "failure"
    RESIZE = "resize"


class RestartReason(enum.Enum):
    """Which signal of the workers (`elastic.signals`) a restart answers, if any."""

    REGROW = "regrow"  # `PlannedRegrow`: room for more workers
    UNHEALTHY_NODES = "unhealthy_nodes"  # `UnhealthyNodes`: the health check failed nodes
    CANNOT_CONTINUE = "cannot_continue"  # `RunCannotContinue`: a restart cannot help
    WORKERS_FAILED = "workers_failed"  # no signal: the workers' own failure


@dataclass(frozen=True)
class Restart:
    """Why the controller restarts a worker group (`elastic.restarts.classify_restart`)."""

    reason: RestartReason
    cause: str
    events: list[Event] = field(default_factory=list)  # what the restart carries for the run's record

    @property
    def kind(self) -> RestartKind:
        return RestartKind.RESIZE if self.reason is RestartReason.REGROW else RestartKind.FAILURE

    @property
    def planned(self) -> bool:
        """wildtrain's own decision (a regrow, leaving out unhealthy nodes), not a fault of the
        workers: not counted against elastic.max_failures."""
        return self.reason in (RestartReason.REGROW, RestartReason.UNHEALTHY_NODES)

    @property
    def fatal(self) -> bool:
        """A restart cannot help: the run ends with `cause`."""
        return self.reason is RestartReason.CANNOT_CONTINUE


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
    """What one change of the controller's state means (`elastic.restarts.interpret`). `kind`:

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
        """What the restart carries for the run's record (a failed health check's results, the nodes left out)."""
        return self.restart.events if self.restart is not None else []

    @property
    def interruption(self) -> Optional[type[Interrupted]]:
        """The event the run's timeline records (`Failure`, `Resize`); None when no group
        stopped or failed to start."""
        return _INTERRUPTIONS.get(self.kind)


_INTERRUPTIONS = {TransitionKind.FAILURE: Failure, TransitionKind.START_FAILED: Failure, TransitionKind.RESIZE: Resize}


class RecoveryPath(enum.Enum):
    """Which way a run recovers from an interruption, and so who measured it."""

    # Ray Train restarts the worker group: the controller's timeline builds the events.
    RESTART = "restart"
    # The survivors re-form in-process (elastic.in_process): their rank 0 builds the events
    # (`train.generations`) and reports them; the controller's timeline takes them.
    IN_PROCESS = "in_process"


@dataclass(frozen=True)
class Interruption:
    """A timeline entry: the group (or, in-process, a generation) stopped."""

    event: Interrupted
    path: RecoveryPath


@dataclass(frozen=True)
class Recovery:
    """A timeline entry: the first step after an interruption is done."""

    event: Recovered
    path: RecoveryPath


@dataclass(frozen=True)
class Noted:
    """Any other event for the run's record: the workers', or one a restart carries."""

    event: Event


Entry = Union[Interruption, Recovery, Noted]


@dataclass(frozen=True)
class GroupStarted:
    """A worker group started: rank r on `nodes[r]`, in process `pids[r]`."""

    nodes: list[str]
    pids: list[int]


@dataclass(frozen=True)
class StateChanged:
    """The controller's state changed: what it means, and the entries it adds to the run's
    record, in order (a new outage's interruption; what a new failure carries)."""

    transition: Transition
    entries: tuple[Entry, ...] = ()


@dataclass(frozen=True)
class Reported:
    """Rank 0's report, and its entries in order: the restart's recovery it completes, then
    its own events as the workers made them."""

    report: WorkerReport
    entries: tuple[Entry, ...] = ()


class Stage(enum.IntEnum):
    """When a consumer hears of each message, lowest first."""

    SAY = 0  # the console's lines
    RECORD = 1  # the run's MLflow record
    # What the controller does next (the restart policy), which may end the run: by then
    # everything is said and recorded.
    ACT = 2


class Consumer:
    """What `elastic.controller.ControllerEvents` tells: one method per message, each a
    no-op unless a consumer cares. `stage` places it among the others."""

    stage: ClassVar[Stage]

    def group_started(self, started: GroupStarted) -> None:
        pass

    def state_changed(self, change: StateChanged) -> None:
        pass

    def reported(self, reported: Reported) -> None:
        pass

    def ended(self) -> None:
        """The run ended (finished, failed or aborted): nothing more comes."""


def in_stage_order(consumers: Sequence[Consumer]) -> list[Consumer]:
    """`consumers` by stage; within one, in the order given."""
    return sorted(consumers, key=lambda consumer: consumer.stage)
