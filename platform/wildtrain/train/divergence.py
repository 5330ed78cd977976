"""When a run's loss has diverged: the early-stop rule of `early_stop.*`. Pure, so it is
tested without workers; the loop applies it at log steps, where the loss is already the
mean over ranks, so every rank reaches the same verdict without a collective of its own."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Verdict:
    best: float  # the lowest finite loss so far, this one included
    reason: Optional[str]  # why to stop; None: train on


def judge_loss(loss: float, best: float, factor: float) -> Verdict:
    """Diverged: `loss` is NaN or infinite, or above `factor` times the best loss so far."""
    if not math.isfinite(loss):
        return Verdict(best, f"loss is {loss}")
    if math.isfinite(best) and loss > factor * best:
        return Verdict(best, f"loss {loss:.4g} is above {factor:g} x the best {best:.4g}")
    return Verdict(min(best, loss), None)
