"""A worker group below its largest size looks for room to grow at log steps."""

from __future__ import annotations

import time
from enum import Enum
from typing import Callable, Optional

from wildtrain.elastic.nodes import excluded_nodes, has_room_for_another_worker
from wildtrain.train import collectives
from wildtrain.train.schedule import At


class Growth(Enum):
    NONE = 0
    RESTART = 1  # checkpoint, and Ray Train restarts the group larger
    JOIN = 2  # workers wait to join this in-process group: hand the state over to them


class GrowthCheck:
    """While the group is below max size, rank 0 looks for room for another worker at most
    every `interval_s` (on a node not left out of the run), and every rank learns the answer
    at the same step: each rank calls `due` at the same steps.

    `joiners` (in-process generations, elastic.in_process): whether workers started on the
    placement slots of lost members ask to join, looked for at every log step. While such a
    slot is open (`awaiting_joiners`) the group grows only by them: the room a returning
    node brings is Ray's to place that slot on, and a restart would take it first."""

    def __init__(
        self,
        below_max: bool,
        rank: int,
        per_worker: dict,
        interval_s: float,
        run_name: str,
        data_cpus: float,
        joiners: Optional[Callable[[], bool]] = None,
        awaiting_joiners: bool = False,
    ) -> None:
        self.below_max = below_max
        self.rank = rank
        self.per_worker = per_worker
        self.data_cpus = data_cpus
        self.interval_s = interval_s
        self.run_name = run_name
        self.joiners = joiners
        self.awaiting_joiners = awaiting_joiners
        self.next_look = time.monotonic() + interval_s

    def due(self, at: At, logs: bool) -> Growth:
        """How to grow after `at`: looked for at log steps only, whose report decision
        synchronizes the ranks anyway, and never at the run's last."""
        if not logs or at.last or not self.below_max:
            return Growth.NONE
        return Growth(collectives.broadcast_int(self._look().value if self.rank == 0 else 0))

    def _look(self) -> Growth:
        if self.joiners is not None and self.joiners():
            return Growth.JOIN
        if self.awaiting_joiners or time.monotonic() < self.next_look:
            return Growth.NONE
        self.next_look = time.monotonic() + self.interval_s
        if has_room_for_another_worker(self.per_worker, excluded_nodes(self.run_name), self.data_cpus):
            return Growth.RESTART
        return Growth.NONE
