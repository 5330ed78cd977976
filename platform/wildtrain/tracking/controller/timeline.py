"""The elastic timeline of a run: interruptions (failures, planned resizes) and the
recoveries that follow them, split into their parts. The controller's one place for them
(`elastic.controller.ControllerEvents` feeds it): it builds the restart path's from the
controller's state changes and the workers' first reports after a restart, and takes the
in-process path's as the workers report them (`train.generations` measures those), so both
reach every consumer as the same typed entries. Pure bookkeeping.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from wildtrain.controller_events import Entry, Interruption, Noted, Recovery, RecoveryPath
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

    def interrupted(self, kind: type[Interrupted], at: float, cause: str = "") -> Optional[Interruption]:
        """The entry of `kind` (`Failure`, `Resize`) for a new interruption of the worker group;
        None while one is already being recovered from, since a second before the group
        recovered belongs to the same outage."""
        if self.pending is not None:
            return None
        self.pending = kind(at, self.world_size, self.last_step, cause, list(self.nodes))
        self.events.append(self.pending)
        return Interruption(self.pending, RecoveryPath.RESTART)

    def reported(self, report: WorkerReport) -> tuple[Entry, ...]:
        """Note a report; its entries: the restart's recovery it completes, if it is the first
        after an interruption of the group, then its events in the order the workers made them."""
        self.world_size = report.world_size
        entries: list[Entry] = []
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
            entries.append(Recovery(recovery, RecoveryPath.RESTART))
        entries += [self._took(event) for event in report.events]
        self.last_step = report.step
        return tuple(entries)

    def _took(self, event: Event) -> Entry:
        """A worker's event as an entry: an interruption or a recovery is an in-process
        generation's (the group itself went on)."""
        if isinstance(event, Interrupted):
            self.events.append(event)
            return Interruption(event, RecoveryPath.IN_PROCESS)
        if isinstance(event, Recovered):
            self.events.append(event)
            return Recovery(event, RecoveryPath.IN_PROCESS)
        return Noted(event)
