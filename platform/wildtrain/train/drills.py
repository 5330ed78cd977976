"""The chaos.* drills an attempt runs (off by default): a slow rank, and a rank or a joiner
that fails once per run; and the per-step hook (train/hooks.py) that tests pace drills with."""

from __future__ import annotations

import time
from typing import Callable, Optional

import torch

from wildtrain import storage
from wildtrain.config import ChaosConfig, StorageConfig
from wildtrain.train import hooks


class Drills:
    """This rank's drills in one attempt. `chaos_failed`: the run's marker that a drill's
    failure fired, where `storage_config` reaches it; `joiner`: the rank joined an in-process
    group (its attempts' first steps are where chaos.fail_joiner fails); `slowed`: the monitor
    found the rank slowed by chaos.slow_*, whose every training forward pass through `model`
    then sleeps chaos.slow_step_s; `short_of_members`: an in-process generation smaller than
    its group was formed; `spares_waiting`: an in-process group's count of ready spares, of
    `spares_wanted` (elastic.spares)."""

    def __init__(
        self,
        chaos: ChaosConfig,
        rank: int,
        restored_step: int,
        *,
        chaos_failed: str,
        storage_config: StorageConfig,
        joiner: bool,
        slowed: bool,
        model: torch.nn.Module,
        short_of_members: bool,
        spares_wanted: int,
        spares_waiting: Optional[Callable[[], int]] = None,
    ) -> None:
        self.rank, self.chaos_failed, self.storage_config = rank, chaos_failed, storage_config
        self.fails_as_joiner = joiner and chaos.fail_joiner
        if slowed and chaos.slow_step_s > 0:
            model.register_forward_pre_hook(slow_forward(chaos.slow_step_s))
        self.fails_at_step = chaos.fail_at_step if rank == chaos.fail_rank else 0
        if self.fails_as_joiner:
            self.fails_at_step = restored_step + 1  # its first step here
        self.short_of_members, self.spares_wanted, self.spares_waiting = short_of_members, spares_wanted, spares_waiting
        self.step_hook = hooks.from_env()

    def before_step(self, step: int) -> None:
        """Raise mid-step where this rank's drill fails `step`, the first time the run gets
        there (the marker `chaos_failed`): the restarted group passes it."""
        if step != self.fails_at_step:
            return
        if storage.read_text(self.chaos_failed, self.storage_config) is None:
            storage.write_text(self.chaos_failed, f"rank {self.rank}, step {step}", self.storage_config)
            drill = "chaos.fail_joiner" if self.fails_as_joiner else "chaos.fail_rank"
            raise RuntimeError(f"chaos drill: rank {self.rank} fails in step {step} ({drill})")

    def after_step(self, step: int, started: float) -> None:
        """Call the step hook, if one is set, on `step`, begun at `started` (perf_counter)."""
        if self.step_hook is None:
            return
        wanted = self.spares_wanted
        spares_ready = self.spares_waiting() if self.spares_waiting is not None and wanted else None
        short = hooks.trains_short(self.short_of_members, spares_ready, wanted)
        self.step_hook(hooks.StepDone(step, self.rank, started, short))


def slow_forward(seconds: float) -> Callable[[torch.nn.Module, tuple], None]:
    """A forward pre-hook that sleeps `seconds` in training mode: a straggler's delay, counted
    as the step's forward time, where validation (in eval mode) keeps its own. Kept out of any
    compiled graph, so that it sleeps at every call."""

    @torch.compiler.disable
    def sleep(module: torch.nn.Module, args: tuple) -> None:
        if module.training:
            time.sleep(seconds)

    return sleep
