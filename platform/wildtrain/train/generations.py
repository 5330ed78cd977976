"""What an in-process attempt (elastic.in_process) is given: its member and generation, and
what the attempt dropped before it left (`Leftovers`); and the recovery it records."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

from wildtrain.checkpoint.save_process import SaveProcess
from wildtrain.elastic.in_process import Generation, Member
from wildtrain.events import Event, Interrupted, Recovered
from wildtrain.train.state import TrainState


@dataclass(frozen=True)
class Leftovers:
    """What an attempt dropped by an in-process re-form hands the next one: the state of its
    last committed steps, what its reports had not carried yet, and its save process (idle,
    its imports done). A joiner's holds only a save process, spawned before it asked to join."""

    states: dict[int, TrainState]  # this rank's last committed steps
    windows: list[dict]  # resolved metrics windows
    events: list[Event]
    committed: list[str]  # checkpoints committed since the last report
    known_good: list[tuple[str, str]]
    # The interruption the next attempt recovers from: a member's loss (`Failure`) or the
    # joiners' arrival (`Resize`); None for a joiner, whose members record it.
    interruption: Optional[Interrupted]
    save_process: Optional[SaveProcess] = None

    @classmethod
    def joiner(cls, save_process: Optional[SaveProcess]) -> "Leftovers":
        return cls(states={}, windows=[], events=[], committed=[], known_good=[], interruption=None,
                   save_process=save_process)


@dataclass(frozen=True)
class InProcess:
    """An attempt of elastic.in_process: its member, the generation it trains in, and what the
    attempt before it left (None: the worker group's first, which restores a checkpoint; a
    joiner's: the state comes from the members)."""

    member: Member
    generation: Generation
    left: Optional[Leftovers]


def recovered(interruption: Interrupted, formed_at: float, restored_at: float, restored_step: int, world_size: int,
              now: Optional[float] = None) -> Recovered:
    """The recovery from `interruption` of an attempt re-formed in-process whose generation formed at
    `formed_at`, whose state was rebuilt from its peers by `restored_at` at `restored_step`, and
    whose first step is done `now`: for the run's timeline and goodput, as a restarted group's
    (`tracking.controller.timeline`)."""
    now = time.time() if now is None else now
    return Recovered(now, interruption.KIND, interruption.world_size, world_size,
                     restart_s=formed_at - interruption.at, restore_s=restored_at - formed_at, reshard_s=0.0,
                     recovery_s=now - interruption.at, restored_step=restored_step,
                     steps_lost=max(0, interruption.last_step - restored_step))
