"""A worker group below its largest size looks for room to grow at report steps."""

from __future__ import annotations

import time

from typing import Callable, Optional

from wildtrain.elastic.nodes import excluded_nodes, has_room_for_another_worker
from wildtrain.train import collectives
from wildtrain.train.schedule import At


class GrowthCheck:
    """While the group is below max size, rank 0 looks for room for another worker at most
    every `interval_s` (on a node not left out of the run), and every rank learns the answer
    at the same step: each rank calls `due` at the same steps. `slot_back` (in-process
    generations): whether a lost member's slot of the group's placement is back, which is
    room too."""

    def __init__(self, below_max: bool, rank: int, per_worker: dict, interval_s: float, run_name: str,
                 data_cpus: float, slot_back: Optional[Callable[[], bool]] = None) -> None:
        self.below_max = below_max
        self.rank = rank
        self.per_worker = per_worker
        self.data_cpus = data_cpus
        self.interval_s = interval_s
        self.run_name = run_name
        self.slot_back = slot_back
        self.next_look = time.monotonic() + interval_s

    def due(self, at: At, logs: bool) -> bool:
        """Whether to checkpoint and restart larger after `at`: looked for at log steps only,
        whose report decision synchronizes the ranks anyway, and never at the run's last."""
        return logs and not at.last and self._room_now()

    def _room_now(self) -> bool:
        if not self.below_max:
            return False
        room = False
        if self.rank == 0 and time.monotonic() >= self.next_look:
            self.next_look = time.monotonic() + self.interval_s
            room = ((self.slot_back is not None and self.slot_back())
                    or has_room_for_another_worker(self.per_worker, excluded_nodes(self.run_name), self.data_cpus))
        return collectives.broadcast_flag(room)
