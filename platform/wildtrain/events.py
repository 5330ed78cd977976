"""What happened to a run besides its metrics: one frozen dataclass per kind of event.

Workers, the Ray Train controller and the driver make them; `tracking.controller.mlflow_run` stores
each as a JSON artifact (`to_dict`) and reads them back (`from_dict`); goodput and the
cluster card read their types. The dict form is `{"event": KIND, **fields}`, so every
record MLflow already holds reads back the same.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar


@dataclass(frozen=True)
class Event:
    KIND: ClassVar[str]
    at: float  # wall-clock time it happened

    def summary(self) -> str:
        """One line for the log: why, for the kinds a user may have to act on."""
        return getattr(self, "reason", "")

    def to_dict(self) -> dict:
        return {"event": self.KIND, **dataclasses.asdict(self)}


_KINDS: dict[str, type[Event]] = {}


def _kind(name: str):
    def register(cls: type[Event]) -> type[Event]:
        cls.KIND = name
        _KINDS[name] = cls
        return cls

    return register


def from_dict(record: dict) -> Event:
    """The event a `to_dict` record holds; keys it does not know are ignored, so a record
    written with more fields (a later version) still reads."""
    kind = record.get("event")
    if kind not in _KINDS:
        raise ValueError(f"unknown event kind {kind!r} (known: {', '.join(sorted(_KINDS))})")
    cls = _KINDS[kind]
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{key: value for key, value in record.items() if key in names})


# The driver: a submission's start and end, and what it changed about the data.


@_kind("started")
@dataclass(frozen=True)
class Started(Event):
    pass


@_kind("stopped")
@dataclass(frozen=True)
class Stopped(Event):
    status: str  # the run's MLflow status: FINISHED, FAILED, KILLED


@_kind("moved")
@dataclass(frozen=True)
class Moved(Event):
    """`wildtrain move`: the run continues on another cluster from its newest checkpoint."""

    from_cluster: str
    to_cluster: str
    step: int | None  # the newest committed checkpoint moved; None: none yet
    bytes_copied: int

    def summary(self) -> str:
        return f"moved from {self.from_cluster} to {self.to_cluster} at step {self.step}"


@_kind("stopped_early")
@dataclass(frozen=True)
class StoppedEarly(Event):
    """The early-stop rule ended the run (`early_stop.*`): its loss diverged."""

    step: int
    reason: str

    def summary(self) -> str:
        return f"stopped early at step {self.step}: {self.reason}"


@_kind("data_order_changed")
@dataclass(frozen=True)
class DataOrderChanged(Event):
    changes: list[str]
    reason: str


@_kind("shard_skipped")
@dataclass(frozen=True)
class ShardSkipped(Event):
    shard: str


# The controller: interruptions of the worker group, recoveries, capacity waits, exclusions.


@dataclass(frozen=True)
class Interrupted(Event):
    """The worker group stopped after `last_step` at `world_size` (`at`: when the
    controller learned of it)."""

    world_size: int
    last_step: int
    cause: str = ""
    nodes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        return self.cause


@_kind("failure")
@dataclass(frozen=True)
class Failure(Interrupted):
    pass


@_kind("resize")
@dataclass(frozen=True)
class Resize(Interrupted):
    pass


@_kind("recovered")
@dataclass(frozen=True)
class Recovered(Event):
    """The first step after an interruption of `kind` ("failure", "resize") is done (`at`)."""

    kind: str
    world_size_before: int
    world_size_after: int
    # Interruption known → new worker group's training function entered.
    restart_s: float
    restore_s: float
    reshard_s: float
    # Interruption known → first optimizer step done at the new size.
    recovery_s: float
    restored_step: int
    # Steps done before the interruption that the restored checkpoint did not hold (a lower
    # bound when steps between reports are not seen).
    steps_lost: int


@_kind("waiting")
@dataclass(frozen=True)
class Waiting(Event):
    """From `start` to `end` (= `at`) the cluster could not hold elastic.min_workers workers."""

    start: float
    end: float

    def summary(self) -> str:
        return f"no room for the smallest worker group for {self.end - self.start:.1f} s"


@_kind("node_excluded")
@dataclass(frozen=True)
class NodeExcluded(Event):
    node: str
    reason: str


@_kind("hang")
@dataclass(frozen=True)
class Hang(Event):
    dumps: list[str]  # artifact paths of the stacks the ranks' watchdogs wrote
    silent_ranks: list[dict]  # rank, node, pid of ranks that wrote none
    reason: str


# The workers: health checks, stragglers, checkpoints, regrows, in-process generations.


@_kind("formed")
@dataclass(frozen=True)
class Formed(Event):
    """A generation of an in-process group (elastic.in_process) formed: rank r ran on
    `nodes[r]`, from `step` on."""

    generation: int
    step: int
    nodes: list[str]

    def summary(self) -> str:
        return f"generation {self.generation} of {len(self.nodes)} ranks formed at step {self.step}"


@_kind("health")
@dataclass(frozen=True)
class HealthCheck(Event):
    check: str  # "matmul" (per rank) or "allreduce" (the group: rank -1)
    rank: int
    node: str
    passed: bool
    detail: str

    def summary(self) -> str:
        return f"{self.check} on node {self.node}: {self.detail}"


@_kind("straggler")
@dataclass(frozen=True)
class Straggler(Event):
    step: int
    rank: int
    node: str
    factor: float
    intervals: int
    reason: str


@_kind("straggler_check_off")
@dataclass(frozen=True)
class StragglerCheckOff(Event):
    """The run's ranks' busy times cannot show a straggler (`tracking.worker.stragglers.cannot_observe`):
    no check runs, rather than one that never flags."""

    reason: str


@_kind("shm_too_small")
@dataclass(frozen=True)
class ShmTooSmall(Event):
    """checkpoint.background=process asked for, but a node's /dev/shm has too little room for
    its ranks' host copies (`checkpoint.shm`): they save in a thread instead."""

    node: str
    ranks: list[int]
    free: int | None  # bytes free in /dev/shm
    needed: int  # bytes the save process's host copies need there
    reason: str


@_kind("checkpoint_fallback")
@dataclass(frozen=True)
class CheckpointFallback(Event):
    """A committed checkpoint the restore passed over, and why."""

    store: str
    checkpoint: str
    step: int
    reason: str


@dataclass(frozen=True)
class CheckpointNotSaved(Event):
    """A save that did not commit to every store; `failure` names the kind of fault."""

    step: int
    checkpoint: str
    reason: str
    failure: str = ""
    disk_full: str = ""


@_kind("checkpoint_failed")
@dataclass(frozen=True)
class CheckpointFailed(CheckpointNotSaved):
    pass


@_kind("checkpoint_skipped")
@dataclass(frozen=True)
class CheckpointSkipped(CheckpointNotSaved):
    pass


@_kind("checkpoint_partial")
@dataclass(frozen=True)
class CheckpointPartial(CheckpointNotSaved):
    """Committed in some of the run's stores, not all."""


@_kind("regrow_postponed")
@dataclass(frozen=True)
class RegrowPostponed(Event):
    step: int
    reason: str


# The controller's evaluations beside training (`eval.*`); they never stop the run.


@_kind("eval_failed")
@dataclass(frozen=True)
class EvalFailed(Event):
    """The evaluation of step `step`'s checkpoint gave no metrics for `tasks` (all of them
    when the evaluation itself failed: the export, the task's process, eval.timeout_s)."""

    step: int
    tasks: list[str]
    reason: str

    def summary(self) -> str:
        return f"evaluating step {self.step} on {', '.join(self.tasks)} failed: {self.reason}"


@_kind("eval_skipped")
@dataclass(frozen=True)
class EvalSkipped(Event):
    """Step `step`'s checkpoint was due for evaluation, but a newer one came due before the
    evaluation in flight ended: only the newest waits (`elastic.controller.EvalQueue`)."""

    step: int
    reason: str

    def summary(self) -> str:
        return f"step {self.step}'s checkpoint is not evaluated: {self.reason}"


# The tracking client: MLflow did not answer.


@_kind("tracking_outage")
@dataclass(frozen=True)
class TrackingOutage(Event):
    start: float
    end: float
    seconds: float
    error: str  # the last failure
    resolved: bool

    def summary(self) -> str:
        return (
            f"MLflow did not answer for {self.seconds:.1f} s "
            f"({'recovered' if self.resolved else 'still down'}; {self.error})"
        )
