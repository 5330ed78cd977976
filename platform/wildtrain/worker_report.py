"""What a worker tells the controller: one `WorkerReport` per `ray.train.report`, built by
the training loop (`train/loop.py`) and read by the controller's callbacks (the MLflow
run and its elastic timeline, conversions ahead of a resize, evaluations, progress lines).

Ray Train carries a report's metrics as a dict, pickled from the worker to the controller:
`to_dict` makes that dict and `from_dict` reads it back, failing on a key it does not
know or one that is missing, so that a key renamed on one side stops the run at its
first report rather than going unread on the other. The dict keeps the flat keys it has
always had: `checkpoint/*` and an attempt's start-up times beside `step`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional, Sequence

from wildtrain.events import Event


@dataclass(frozen=True)
class Startup:
    """Where an attempt's start-up went, in its first report: the controller splits the
    recovery it completes into its parts (`tracking.controller.timeline`), and bench/startup.py the
    start-up. `*_at` are wall-clock times (time.time()) on the worker."""

    restored_step: int  # the step of the checkpoint the attempt restored (0: none)
    restore_s: float  # finding, downloading and loading it, besides converting it
    reshard_s: float  # converting it to the universal format (a checkpoint of another world size)
    engine_build_s: float
    worker_started_at: float  # the worker's process started
    attempt_started_at: float  # the training function started
    health_checked_at: float
    restored_at: float
    first_step_at: float


_STARTUP_KEYS = tuple(f.name for f in dataclasses.fields(Startup))
CHECKPOINT_PREFIX = "checkpoint/"
_REQUIRED = ("step", "tokens_seen", "world_size", "windows", "events", "committed_checkpoints")
# Every window holds these besides its metrics: the controller logs each at its own step and time.
_WINDOW_KEYS = ("step", "at")


@dataclass(frozen=True)
class WorkerReport:
    """One rank's report: where training is, the metrics of the log steps since its previous
    report, what happened meanwhile, and the saves that ended."""

    step: int
    tokens_seen: int
    world_size: int
    # The metrics of each log step's window since the previous report, by name, oldest
    # first (`StepMetrics.resolve`); each holds its `step` and `at` (when it closed).
    windows: tuple[dict, ...] = ()
    events: tuple[Event, ...] = ()  # the workers' own: health, stragglers, checkpoints, early stop
    # `checkpoint/<metric>` of the saves that ended since the previous report (`save_policy.metrics`).
    checkpoint: dict[str, float] = field(default_factory=dict)
    committed_checkpoints: tuple[str, ...] = ()  # "<store URI>/<checkpoint name>" of each committed copy
    startup: Optional[Startup] = None  # in an attempt's first report only

    def __post_init__(self) -> None:
        for key in self.checkpoint:
            if not key.startswith(CHECKPOINT_PREFIX):
                raise ValueError(f"worker report: checkpoint metric {key!r} is not named {CHECKPOINT_PREFIX}*")
        for i, window in enumerate(self.windows):
            for key in _WINDOW_KEYS:
                if key not in window:
                    raise ValueError(f"worker report: windows[{i}] has no {key!r}")
        for event in self.events:
            if not isinstance(event, Event):
                raise ValueError(f"worker report: 'events' holds {event!r}, not an event")

    def to_dict(self) -> dict:
        """The metrics dict `ray.train.report` carries."""
        return (
            {
                "step": self.step,
                "tokens_seen": self.tokens_seen,
                "world_size": self.world_size,
                "windows": list(self.windows),
                "events": list(self.events),
            }
            | self.checkpoint
            | {"committed_checkpoints": list(self.committed_checkpoints)}
            | (dataclasses.asdict(self.startup) if self.startup is not None else {})
        )

    @classmethod
    def from_dict(cls, metrics: dict) -> "WorkerReport":
        """The report `to_dict` made; a key missing or not known fails, naming it."""
        unknown = sorted(
            key
            for key in metrics
            if key not in _REQUIRED and key not in _STARTUP_KEYS and not key.startswith(CHECKPOINT_PREFIX)
        )
        if unknown:
            raise ValueError(f"worker report: unknown key {unknown[0]!r}" + _others(unknown))
        missing = [key for key in _REQUIRED if key not in metrics]
        if missing:
            raise ValueError(f"worker report: no {missing[0]!r}" + _others(missing))
        startup = None
        if any(key in metrics for key in _STARTUP_KEYS):  # all of them, or none
            missing = [key for key in _STARTUP_KEYS if key not in metrics]
            if missing:
                raise ValueError(f"worker report: start-up times without {missing[0]!r}" + _others(missing))
            startup = Startup(**{key: metrics[key] for key in _STARTUP_KEYS})
        return cls(
            step=metrics["step"],
            tokens_seen=metrics["tokens_seen"],
            world_size=metrics["world_size"],
            windows=tuple(metrics["windows"]),
            events=tuple(metrics["events"]),
            checkpoint={key: value for key, value in metrics.items() if key.startswith(CHECKPOINT_PREFIX)},
            committed_checkpoints=tuple(metrics["committed_checkpoints"]),
            startup=startup,
        )


def _others(keys: Sequence[str]) -> str:
    return f" (and {', '.join(repr(k) for k in keys[1:])})" if len(keys) > 1 else ""


def rank_zero(metrics: Sequence[dict]) -> WorkerReport:
    """Rank 0's report among a report's, one per rank (a controller callback's `metrics`):
    the controller logs and acts on rank 0's."""
    return WorkerReport.from_dict(metrics[0])
