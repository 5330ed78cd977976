"""Where a finished step stands in the run, which is all a component needs to say whether
the step is due for it. The loop asks its components in the order it runs, each from its
own config (as levanter's hooks and torchtitan's checkpointer say when they are due):
`validation.due`, `reporting.ReportCadence`, `GrowthCheck.due`, `checkpointing.due`. The
decisions are pure, so the loop's cadence is tested without workers."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class At:
    step: int
    first: bool  # the attempt's first step: the controller times the recovery from its report
    last: bool  # the run's last step: it validates and saves, and its save must commit

    @classmethod
    def of(cls, step: int, restored_step: int, steps: int) -> "At":
        return cls(step, first=step == restored_step + 1, last=step == steps)


def every(step: int, n: int) -> bool:
    """Whether `step` falls on a cadence of `n` steps; 0: never."""
    return n > 0 and step % n == 0
