"""Reports of a joiner that is its generation's rank 0 (issue 24).

Ray Train collects reports only from the workers it started. Once the last of them is lost
from an in-process group, only joiners train, and the joiner that is rank 0 reports for the
group through this queue in its own process: the controller takes them from its actor
(`joiners.Joiner.take_reports`) and hands them to Ray's report consolidation as a lost
worker's (`survivors.KeepSurvivors`). Every joiner keeps its last few reports here whatever
its rank, so that the one that becomes rank 0 still has those its predecessor may have
taken with it."""

from __future__ import annotations

import collections
import threading

# A few report rounds: more than a dead reporter can have left uncollected (Ray's queue holds one).
KEPT_REPORTS = 4


class ReportRelay:
    def __init__(self, keep: int = KEPT_REPORTS) -> None:
        self._reports: collections.deque[dict] = collections.deque(maxlen=keep)
        self._lock = threading.Lock()

    def put(self, metrics: dict) -> None:
        with self._lock:
            self._reports.append(metrics)

    def take(self) -> list[dict]:
        with self._lock:
            taken = list(self._reports)
            self._reports.clear()
        return taken

    def empty(self) -> bool:
        """Whether the controller took every report put here (`ray_compat.reports_collected`'s
        counterpart: a save commits once the report that carries it is collected)."""
        with self._lock:
            return not self._reports


# The joiner's process's relay: one joiner per process (a `Joiner` actor).
RELAY = ReportRelay()
