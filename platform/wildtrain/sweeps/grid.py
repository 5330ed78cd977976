"""A sweep's trials: the Cartesian product of `--grid key=v1,v2` over the sweep's common
overrides, each a normal run named by a stable hash of its resolved config. Pure apart
from reading conf/ (every trial's config is loaded and validated before anything starts)."""

from __future__ import annotations

import hashlib
import itertools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from wildtrain.config import Config, ConfigError, hashed_form, load_config, redact

# The sweep names its trials by their hash.
_RESERVED = ("run.name",)
# Keys that name or label a trial, or time its driver's lease, rather than change what it trains.
_NOT_HASHED = ("run.name", "run.tags", "run.lease_")


class GridError(ValueError):
    """A grid or sweep option that cannot run; the message names the option at fault."""


@dataclass(frozen=True)
class Trial:
    values: tuple[tuple[str, str], ...]  # (swept key, value), in the order of the --grid options
    hash: str
    run_name: str
    cfg: Config
    args: tuple[str, ...]  # the overrides of its `wildtrain train`, which load `cfg`

    @property
    def overrides(self) -> list[str]:
        return [f"{key}={value}" for key, value in self.values]

    def label(self) -> str:
        return " ".join(self.overrides)


@dataclass(frozen=True)
class SweepPlan:
    name: str
    keys: tuple[str, ...]
    overrides: tuple[str, ...]  # common to every trial, the sweep's own settings included
    trials: tuple[Trial, ...]


def parse_grid(specs: Sequence[str]) -> dict[str, list[str]]:
    """`["optim.lr=1e-3,3e-3", "model=tiny,125m"]` → {key: values}, in the given order."""
    grid: dict[str, list[str]] = {}
    for spec in specs:
        key, sep, values = spec.partition("=")
        if not sep or not key or not values:
            raise GridError(f"--grid {spec}: expected key=value1,value2,...")
        if key in _RESERVED:
            raise GridError(f"--grid {spec}: {key} is set by the sweep for each trial")
        if key in grid:
            raise GridError(f"--grid {spec}: {key} is swept twice")
        split = _split_values(values)
        if len(set(split)) != len(split) or "" in split:
            raise GridError(f"--grid {spec}: values must be distinct and non-empty")
        grid[key] = split
    if not grid:
        raise GridError("--grid: give at least one key=value1,value2,...")
    return grid


def _split_values(values: str) -> list[str]:
    """Split on commas outside brackets, so a value may be a list or a dict."""
    parts, depth, current = [], 0, ""
    for char in values:
        depth += char in "[{"
        depth -= char in "]}"
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    return parts + [current]


def trial_hash(cfg: Config) -> str:
    """Of the resolved config minus its name, labels and the credentials in its URIs: the
    same trial hashes the same in every sweep, on every machine and for every user, any
    change to what it trains changes it, and a trial rebuilt from its recorded (redacted)
    arguments hashes as it did, whichever names of moved keys it spells (`hashed_form`)."""
    flat = {key: value for key, value in hashed_form(cfg).items() if not key.startswith(_NOT_HASHED)}
    return hashlib.sha256(redact(json.dumps(flat, sort_keys=True, default=str)).encode()).hexdigest()[:10]


def steps_for_budget(tokens: int, global_batch_size: int, seq_len: int) -> int:
    """Optimizer steps that train on at least `tokens` tokens."""
    return max(1, math.ceil(tokens / (global_batch_size * seq_len)))


def plan_sweep(
    name: str,
    grid_specs: Sequence[str],
    overrides: Sequence[str],
    steps: Optional[int] = None,
    budget_tokens: Optional[int] = None,
    conf_dir: Optional[Path] = None,
) -> SweepPlan:
    """Every trial of the sweep, its config loaded and validated (a `ConfigError` names the
    key, prefixed with the trial). Trials are ordered with the first --grid key slowest.
    `budget_tokens` gives each trial the steps for that many tokens, so trials with other
    batch sizes or sequence lengths still compare at equal data."""
    if steps is not None and budget_tokens is not None:
        raise GridError("--steps and --budget-tokens: give one, not both")
    for value, option in ((steps, "--steps"), (budget_tokens, "--budget-tokens")):
        if value is not None and value <= 0:
            raise GridError(f"{option}: must be positive, got {value}")
    if not name or "/" in name or name.startswith("-"):
        raise GridError(f"sweep name {name!r}: expected a plain name")
    grid = parse_grid(grid_specs)
    for item in overrides:
        key = item.partition("=")[0]
        if key in grid:
            raise GridError(f"{item}: {key} is swept; set it with --grid only")
        if key in _RESERVED:
            raise GridError(f"{item}: {key} is set by the sweep for each trial")
    # Early stop first, so an override may still turn it off.
    common = ["early_stop.enabled=true", *overrides] + ([f"train.steps={steps}"] if steps is not None else [])
    trials = []
    for combination in itertools.product(*grid.values()):
        values = tuple(zip(grid, combination))
        trial_overrides = [*common, *(f"{key}={value}" for key, value in values)]
        cfg = _load(trial_overrides, values, conf_dir)
        if budget_tokens is not None:
            trial_overrides.append(
                f"train.steps={steps_for_budget(budget_tokens, cfg.train.global_batch_size, cfg.data.seq_len)}"
            )
            cfg = _load(trial_overrides, values, conf_dir)
        digest = trial_hash(cfg)
        cfg.run.name = f"{name}-{digest}"
        trials.append(Trial(values, digest, cfg.run.name, cfg, (*trial_overrides, f"run.name={cfg.run.name}")))
    if len({t.hash for t in trials}) != len(trials):
        raise GridError("--grid: two trials resolve to the same config (a value that changes nothing?)")
    return SweepPlan(name, tuple(grid), tuple(common), tuple(trials))


def _load(overrides: list[str], values: tuple[tuple[str, str], ...], conf_dir: Optional[Path]) -> Config:
    try:
        return load_config(overrides, conf_dir)
    except ConfigError as e:
        raise ConfigError(f"{e} (trial {' '.join(f'{k}={v}' for k, v in values)})") from None


def dry_run_text(plan: SweepPlan) -> str:
    lines = [f"sweep {plan.name}: {len(plan.trials)} trials over {', '.join(plan.keys)}"]
    lines += [
        f"  {trial.hash}  {trial.run_name}  {trial.label()}  (train.steps={trial.cfg.train.steps})"
        for trial in plan.trials
    ]
    return "\n".join(lines) + "\n"
