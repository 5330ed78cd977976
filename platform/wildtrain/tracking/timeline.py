"""The elastic timeline of a run: interruptions (failures, planned resizes) and the
recoveries that follow them, split into their parts. Pure bookkeeping; the MLflow
callback feeds it controller events and workers' first reports after a (re)start.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional


@dataclass(frozen=True)
class Restart:
    """Why the controller restarts a worker group (see `elastic.classify_restart`)."""

    kind: str  # "failure" or "resize"
    cause: str
    # wildtrain's own decision (a planned regrow, leaving out unhealthy nodes), not a fault
    # of the workers: not counted against elastic.max_failures.
    planned: bool
    events: list[dict] = field(default_factory=list)  # what the restart carries for MLflow
    # A restart cannot help (`elastic.RunCannotContinue`): the run ends with `cause`.
    fatal: bool = False


@dataclass
class Interruption:
    kind: str  # "failure" or "resize"
    at: float  # wall-clock time the controller learned of it
    world_size: int  # size of the group that was interrupted
    last_step: int  # newest step reported before it
    cause: str = ""
    nodes: list[str] = field(default_factory=list)


@dataclass
class Recovery:
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


@dataclass
class Timeline:
    world_size: int = 0
    last_step: int = 0
    nodes: list[str] = field(default_factory=list)
    pending: Optional[Interruption] = None
    events: list[dict] = field(default_factory=list)

    def group_started(self, nodes: list[str]) -> None:
        self.nodes = nodes
        self.world_size = len(nodes)

    def interrupted(self, kind: str, at: float, cause: str = "") -> Optional[dict]:
        """The event for a new interruption; None while one is already being recovered
        from, since a second before the group recovered belongs to the same outage."""
        if self.pending is not None:
            return None
        self.pending = Interruption(kind, at, self.world_size, self.last_step, cause, list(self.nodes))
        self.events.append({"event": kind, **asdict(self.pending)})
        return self.events[-1]

    def reported(self, metrics: dict) -> Optional[Recovery]:
        """Note a report; the recovery it completes, if it is the first after an interruption."""
        self.world_size = int(metrics.get("world_size", self.world_size))
        recovery = None
        if "restored_step" in metrics and self.pending is not None:
            p = self.pending
            recovery = Recovery(
                kind=p.kind,
                world_size_before=p.world_size,
                world_size_after=self.world_size,
                restart_s=metrics["attempt_started_at"] - p.at,
                restore_s=metrics["restore_s"],
                reshard_s=metrics["reshard_s"],
                recovery_s=metrics["first_step_at"] - p.at,
                restored_step=int(metrics["restored_step"]),
                steps_lost=max(0, p.last_step - int(metrics["restored_step"])),
            )
            self.events.append({"event": "recovered", **asdict(recovery)})
            self.pending = None
        self.last_step = int(metrics["step"])
        return recovery
