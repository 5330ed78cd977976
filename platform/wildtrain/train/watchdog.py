"""Hang detection that works on gloo/CPU as on NCCL: a thread beside training that fails the
attempt when the worker makes no progress within the bound of what it is doing.

A rank stuck in a collective (a peer stopped, a NIC gone quiet) waits forever or for the
backend's own timeout (30 min by default). The watchdog instead writes every thread's Python
stack to `<dump folder>/<time>-rank<r>.txt` (and stderr), then ends the worker process, which
the group recovers from as from any worker's death: a restart from the last committed
checkpoint, or with elastic.in_process a re-form of the others without it. The controller
attaches the dumps to the MLflow run (`tracking.controller.mlflow_run`).

What counts as too long depends on what the worker is doing, so the watchdog has three bounds:
from the worker's start to its first optimizer step (`monitor.startup_timeout_s`: restore,
resharding, compilation), between steps (`monitor.hang_timeout_s`),
and during a wait the code declares with `waiting(what, up_to_s)` (a save that must commit),
whose own bound replaces the hang timeout for as long as it lasts.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass, replace
from typing import Callable

from wildtrain import storage
from wildtrain.config import StorageConfig
from wildtrain.layout import hang_dump_name

HANG_EXIT_CODE = 86


def thread_stacks() -> str:
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        parts.append(f"--- thread {names.get(ident, ident)} ---\n{''.join(traceback.format_stack(frame))}")
    return "\n".join(parts)


@dataclass(frozen=True)
class Bound:
    """How long the worker may go without progress in what it is doing now."""

    since: float  # time.monotonic() when it began
    timeout_s: float  # 0: no bound
    report: Callable[[float], str]  # the hang report's first line, given the seconds stalled

    def overdue(self, now: float) -> bool:
        return self.timeout_s > 0 and now - self.since > self.timeout_s


class HangWatchdog:
    """Created when the worker starts, in start-up mode: `progress(step)` after each optimizer
    step switches it to the hang timeout; `waiting(...)` covers a wait with its own bound.
    `exit` ends the process (tests pass their own); the watchdog stops by itself once the
    thread that created it (the training function's) has ended, however it ended."""

    def __init__(
        self,
        timeout_s: float,
        startup_timeout_s: float,
        dump_folder: str,
        rank: int,
        config: StorageConfig,
        exit: Callable[[int], object] = os._exit,
    ) -> None:
        self.timeout_s = timeout_s
        self.dump_folder = dump_folder
        self.rank = rank
        self.config = config
        self.exit = exit
        self.step = 0
        self._bound = Bound(
            time.monotonic(),
            startup_timeout_s,
            lambda stalled: (
                f"rank {rank}: no optimizer step for {stalled:.0f} s since the worker started "
                f"(monitor.startup_timeout_s={startup_timeout_s:g})"
            ),
        )
        self._owner = threading.current_thread()
        self._stop = threading.Event()
        bounds = [t for t in (timeout_s, startup_timeout_s) if t > 0]
        if bounds:
            self._poll_s = min(5.0, min(bounds) / 4)
            threading.Thread(target=self._watch, name="wildtrain-hang-watchdog", daemon=True).start()

    def progress(self, step: int) -> None:
        self.step = step
        self._bound = Bound(
            time.monotonic(),
            self.timeout_s,
            lambda stalled: (
                f"rank {self.rank}: no optimizer step for {stalled:.0f} s after step {step} "
                f"(monitor.hang_timeout_s={self.timeout_s:g})"
            ),
        )

    @contextlib.contextmanager
    def waiting(self, what: str, up_to_s: float):
        """A wait that may legitimately outlast the hang timeout, bounded by its own `up_to_s`.
        The code that waits gives up after `up_to_s`; the hang timeout on top is the time it
        gets to act on that (as any step gets), so only a wait stuck past its own bound fires.
        Its end counts as progress: the bound that was in force starts over."""
        outer = self._bound
        bound_s = up_to_s + self.timeout_s if self.timeout_s > 0 else 0.0  # hang_timeout_s=0: no watch
        self._bound = Bound(
            time.monotonic(),
            bound_s,
            lambda stalled: (
                f"rank {self.rank}: {what} still not done after {stalled:.0f} s (after step {self.step}); "
                f"its bound is {up_to_s:g} s plus monitor.hang_timeout_s={self.timeout_s:g}"
            ),
        )
        try:
            yield
        finally:
            self._bound = replace(outer, since=time.monotonic())

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(self._poll_s) and self._owner.is_alive():
            bound, now = self._bound, time.monotonic()
            if bound.overdue(now):
                self._fire(bound.report(now - bound.since))
                return

    def _fire(self, reason: str) -> None:
        report = f"{reason}; stacks:\n{thread_stacks()}"
        print(report, file=sys.stderr, flush=True)
        try:
            storage.write_text(storage.join(self.dump_folder, hang_dump_name(self.rank)), report, self.config)
        finally:
            self.exit(HANG_EXIT_CODE)  # os._exit: the main thread is stuck in C, nothing else ends it
