"""The pace of a drill on a slow machine, kept by wildtrain's per-step hook (train/hooks.py)
in every worker of a run: a least time per step, so that a drill that acts mid-run lands
mid-run on a fast machine too, and a longer one while an in-process group trains short of a
member or of a spare, so that a drill's joiner or spare, however slowly this machine starts
it, is in before the run ends. A pace changes no loss.

    BackgroundRun(cfg, pace=Pace(min_step_s=0.5))           # in this process
    env = os.environ | Pace(min_step_s=0.5).env()           # a `wildtrain train` of its own
    submit(Pace(min_step_s=0.5).on(cluster), overrides)     # a job on a cluster
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING
from urllib.parse import urlencode

from wildtrain.train.hooks import STEP_HOOK, StepDone

if TYPE_CHECKING:
    from wildtrain.clusters.registry import Cluster


@dataclass(frozen=True)
class Pace:
    # Every step of every rank takes at least this long (0: as long as it takes).
    min_step_s: float = 0.0
    # While the group trains short (`StepDone.short`), every step takes at least this long.
    short_step_s: float = 0.0

    def step_s(self, short: bool) -> float:
        """The least time of a step; the longer of the two while the group trains short."""
        return max(self.min_step_s, self.short_step_s) if short else self.min_step_s

    def __call__(self, done: StepDone) -> None:
        time.sleep(max(0.0, self.step_s(done.short) - (time.perf_counter() - done.started)))

    def spec(self) -> str:
        """The hook's import path with this pace (`driver.run`'s `step_hook`)."""
        return f"{__name__}:pace?{urlencode({'min_step_s': self.min_step_s, 'short_step_s': self.short_step_s})}"

    def env(self) -> dict[str, str]:
        """The environment that sets this pace for a driver in a process of its own."""
        return {STEP_HOOK: self.spec()}

    def on(self, cluster: Cluster) -> Cluster:
        """`cluster` with this pace in the environment of every job submitted to it (its hotfix)."""
        hotfix = replace(cluster.entry.hotfix, env={**cluster.entry.hotfix.env, **self.env()})
        return replace(cluster, entry=replace(cluster.entry, hotfix=hotfix))


def pace(min_step_s: str = "0", short_step_s: str = "0") -> Pace:
    """The hook of a `spec`: its parameters arrive as text."""
    return Pace(float(min_step_s), float(short_step_s))
