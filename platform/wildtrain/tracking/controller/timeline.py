"""The elastic timeline of a run: interruptions (failures, planned resizes) and the
recoveries that follow them, split into their parts. Pure bookkeeping; the MLflow
callback feeds it controller events and workers' first reports after a (re)start.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from wildtrain.events import Event, Interrupted, Recovered
from wildtrain.worker_report import WorkerReport


@dataclass
class Timeline:
    world_size: int = 0
    last_step: int = 0
    nodes: list[str] = field(default_factory=list)
    pending: Optional[Interrupted] = None
    events: list[Event] = field(default_factory=list)

    def group_started(self, nodes: list[str]) -> None:
        self.nodes = nodes
        self.world_size = len(nodes)

    def interrupted(self, kind: type[Interrupted], at: float, cause: str = "") -> Optional[Interrupted]:
        """The event of `kind` (`Failure`, `Resize`) for a new interruption; None while one is
        already being recovered from, since a second before the group recovered belongs to
        the same outage."""
        if self.pending is not None:
            return None
        self.pending = kind(at, self.world_size, self.last_step, cause, list(self.nodes))
        self.events.append(self.pending)
        return self.pending

    def reported(self, report: WorkerReport) -> Optional[Recovered]:
        """Note a report; the recovery it completes, if it is the first after an interruption."""
        self.world_size = report.world_size
        recovery = None
        startup = report.startup
        if startup is not None and self.pending is not None:
            p = self.pending
            recovery = Recovered(
                at=startup.first_step_at,
                kind=p.KIND,
                world_size_before=p.world_size,
                world_size_after=self.world_size,
                restart_s=startup.attempt_started_at - p.at,
                restore_s=startup.restore_s,
                reshard_s=startup.reshard_s,
                recovery_s=startup.first_step_at - p.at,
                restored_step=startup.restored_step,
                steps_lost=max(0, p.last_step - startup.restored_step),
            )
            self.events.append(recovery)
            self.pending = None
        self.last_step = report.step
        return recovery
