"""Waiting on an event, never on a fixed sleep."""

from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")


def wait_for(
    condition: Callable[[], T], what: str = "the condition", timeout_s: float = 10.0, every_s: float = 0.2
) -> T:
    """`condition()`'s first true value, looked for every `every_s`; TimeoutError naming
    `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout_s:g} s")
        time.sleep(every_s)
    return value
