"""Straggler detection: which rank keeps the others waiting.

Every check interval the ranks' busy times (their forward time: backward and optimizer end
in collectives, where fast ranks wait for slow ones) are gathered; a rank whose time exceeds
the median by `factor` in `patience` consecutive intervals is flagged. Pure and stateful
only in its streak counts, so it is unit-tested without a cluster.

Under ZeRO-3 no check runs (`cannot_observe`): the forward gathers each layer's parameters
from every rank first, so it too ends in collectives where fast ranks wait for slow ones.
Timing the compute alone would mean timing inside DeepSpeed's parameter hooks, and even
there, on the device, a layer's kernels queue behind the wait for its all-gather.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Optional


def cannot_observe(zero_stage: int) -> Optional[str]:
    """Why busy times cannot show a straggler at this ZeRO stage; None where they can."""
    if zero_stage != 3:
        return None
    return (
        "straggler checks are off under ZeRO-3 (deepspeed.zero_stage=3): every layer's forward starts with an "
        "all-gather of its parameters, where fast ranks wait for the slowest, so every rank's busy time is the "
        "slowest one's and no rank would ever be flagged; a device already slow when a worker group starts "
        "still fails its health check (monitor.health_min_ratio)"
    )


@dataclass(frozen=True)
class Straggler:
    rank: int
    factor: float  # its busy time over the median of all ranks', in the latest interval
    intervals: int  # consecutive intervals it has been this slow


@dataclass
class StragglerDetector:
    factor: float = 1.5
    patience: int = 3
    _streaks: dict[int, int] = field(default_factory=dict)

    def observe(self, busy_s: list[float]) -> list[Straggler]:
        """Feed one interval's busy time per rank; the ranks flagged by it (each flagged once
        per streak, when the streak reaches `patience`)."""
        median = statistics.median(busy_s)
        flagged = []
        for rank, seconds in enumerate(busy_s):
            slow = median > 0 and seconds > self.factor * median
            self._streaks[rank] = self._streaks.get(rank, 0) + 1 if slow else 0
            if self._streaks[rank] == self.patience:
                flagged.append(Straggler(rank, seconds / median, self.patience))
        return flagged
