"""A helper of the bench scripts (most import it), no benchmark: lines stamped as they go.

What every bench script prints as it goes (setup, each mode, each save), each line with the
seconds since the script started: a long silence reads as a hang."""

from __future__ import annotations

import time

STARTED = time.perf_counter()


def say(message: str) -> None:
    """`message` after the seconds since the script started, flushed at once: a pipe (a log
    file, a CI job) would otherwise hold it back until the buffer fills."""
    print(f"[{time.perf_counter() - STARTED:6.1f} s] {message}", flush=True)
