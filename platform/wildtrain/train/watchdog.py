"""Hang detection that works on gloo/CPU as on NCCL: a thread beside training that fails the
attempt when no optimizer step has finished for `timeout_s`.

A rank stuck in a collective (a peer stopped, a NIC gone quiet) waits forever or for the
backend's own timeout (30 min by default). The watchdog instead writes every thread's Python
stack to `<dump folder>/<time>-rank<r>.txt` (and stderr), then ends the worker process, so Ray
Train sees the group fail and the elastic machinery restarts it from the last committed
checkpoint. The controller attaches the dumps to the MLflow run (`tracking.mlflow_run`).
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
import traceback

from wildtrain import storage
from wildtrain.config import StorageConfig

HANG_EXIT_CODE = 86
_DUMP_NAME = re.compile(r"-rank(\d+)\.txt$")


def dump_name(rank: int) -> str:
    return f"{time.strftime('%Y%m%d-%H%M%S')}-rank{rank}.txt"


def rank_of_dump(name: str) -> int | None:
    found = _DUMP_NAME.search(name)
    return int(found.group(1)) if found else None


def thread_stacks() -> str:
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        parts.append(f"--- thread {names.get(ident, ident)} ---\n{''.join(traceback.format_stack(frame))}")
    return "\n".join(parts)


class HangWatchdog:
    def __init__(self, timeout_s: float, dump_folder: str, rank: int, config: StorageConfig) -> None:
        self.timeout_s = timeout_s
        self.dump_folder = dump_folder
        self.rank = rank
        self.config = config
        self.last_progress = time.monotonic()
        self.step = 0
        self._stop = threading.Event()
        if timeout_s > 0:
            threading.Thread(target=self._watch, name="wildtrain-hang-watchdog", daemon=True).start()

    def progress(self, step: int) -> None:
        self.step = step
        self.last_progress = time.monotonic()

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(min(5.0, self.timeout_s / 4)):
            stalled = time.monotonic() - self.last_progress
            if stalled > self.timeout_s:
                report = (f"rank {self.rank}: no optimizer step for {stalled:.0f} s after step {self.step} "
                          f"(monitor.hang_timeout_s={self.timeout_s:g}); stacks:\n{thread_stacks()}")
                print(report, file=sys.stderr, flush=True)
                name = dump_name(self.rank)
                try:
                    storage.write_text(storage.join(self.dump_folder, name), report, self.config)
                finally:
                    os._exit(HANG_EXIT_CODE)  # the main thread is stuck in C: nothing else ends it
