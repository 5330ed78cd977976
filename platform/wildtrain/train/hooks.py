"""A per-step hook: a callable every training worker calls after each optimizer step, named by
an import path that the driver hands to every worker it starts (joiners and spares too).
wildtrain itself sets none; tests and benchmarks pace their drills with one
(tests/helpers/pacing.py), so that no such setting sits in the run's config.

The path is `module:factory`, with optional parameters as a query string:
`tests.helpers.pacing:pace?min_step_s=0.5&short_step_s=4` imports `tests.helpers.pacing` and
calls `pace(min_step_s="0.5", short_step_s="4")` once per attempt; what it returns is the hook.
The module must be importable where the workers run (Ray puts the driver's working directory
on their path)."""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Optional, Protocol
from urllib.parse import parse_qsl

from wildtrain.config import ConfigError

# The variable naming the hook: read by the driver, which passes it on to its workers'
# environment (`worker_env`), and by each worker.
STEP_HOOK = "WILDTRAIN_STEP_HOOK"


@dataclass(frozen=True)
class StepDone:
    """What a hook learns of the step a rank just trained."""

    step: int
    rank: int
    # When the step began (time.perf_counter in this process).
    started: float
    # The group trains short of the members it was formed with, or of its spares (elastic.spares).
    short: bool


class StepHook(Protocol):
    def __call__(self, done: StepDone) -> None: ...


def load(spec: str) -> StepHook:
    """The hook `spec` (`module:factory?key=value&...`) names, made."""
    target, _, query = spec.partition("?")
    module, _, factory = target.partition(":")
    if not module or not factory:
        raise ConfigError(f"{STEP_HOOK}={spec}: expected module:factory, optionally ?key=value&...")
    try:
        params = dict(parse_qsl(query, keep_blank_values=True, strict_parsing=True)) if query else {}
    except ValueError:
        raise ConfigError(f"{STEP_HOOK}={spec}: its parameters are not key=value&...") from None
    return getattr(importlib.import_module(module), factory)(**params)


def from_env() -> Optional[StepHook]:
    """This process's hook ($WILDTRAIN_STEP_HOOK), if one is set."""
    spec = os.environ.get(STEP_HOOK)
    return load(spec) if spec else None


def worker_env(spec: Optional[str] = None) -> dict[str, str]:
    """The workers' environment that hands them the hook `spec` (by default the driver's
    $WILDTRAIN_STEP_HOOK; none: empty), loaded here first, so that a wrong path fails the
    driver, not every attempt of every worker."""
    spec = spec or os.environ.get(STEP_HOOK)
    if not spec:
        return {}
    load(spec)
    return {STEP_HOOK: spec}


def trains_short(short_of_members: bool, spares_ready: Optional[int], spares_wanted: int) -> bool:
    """Whether a group trains short: formed smaller than its group (in-process), or with fewer
    ready spares than elastic.spares asks for (`spares_ready`: None outside in-process groups)."""
    return short_of_members or (spares_ready is not None and spares_ready < spares_wanted)
