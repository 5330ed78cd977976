"""Goodput: how much of a run's wall time, over its whole life (every submission, attempt
and resize), went into training progress that was kept, and where the rest went.

`account` is a pure function over typed events. They come from the run's elastic timeline
(`tracking.controller.timeline`: interruptions, and recoveries with their restored step and restore
and reshard times), the driver (each submission starting and stopping), the controller
(waits for capacity) and the training loop's reports (windows of consecutive steps with
their data-wait and checkpoint-stall parts). `reports.runs` builds them from MLflow.

A window's steps are not productive just because they ran: a window whose steps took far
longer than the run's usual at its world size was held up (a report blocked on a stopped
server, a stopped rank, a throttled node), and its time beyond the usual is STALLED.
"""

from __future__ import annotations

import bisect
import collections
import statistics
from dataclasses import dataclass
from typing import Sequence, Union

PRODUCTIVE = "productive"
STARTUP = "startup"
WAITING = "waiting"
RESTORE = "restore"
LOST = "lost"
CHECKPOINT_STALL = "checkpoint_stall"
DATA_WAIT = "data_wait"
REPORT_WAIT = "report_wait"
EVAL = "eval"
STALLED = "stalled"
STOPPED = "stopped"
UNREPORTED = "unreported"
BADPUT_CAUSES = (
    STARTUP,
    WAITING,
    RESTORE,
    LOST,
    CHECKPOINT_STALL,
    DATA_WAIT,
    REPORT_WAIT,
    EVAL,
    STALLED,
    STOPPED,
    UNREPORTED,
)

# An instant that several intervals claim (clocks of different hosts disagree, an outage
# reported twice) counts once, for the first claimant here: badput before productive, so
# goodput is never overstated.
_PRECEDENCE = (LOST, RESTORE, WAITING, CHECKPOINT_STALL, DATA_WAIT, REPORT_WAIT, EVAL, STALLED, PRODUCTIVE)

# A window stalled when its steps took more than this many times the median step of the
# run's windows at its world size; judged only once there are enough windows for a median
# to mean the usual. Normal jitter, and a step or two slower after a restart, stay below.
STALL_FACTOR = 3.0
STALL_MIN_WINDOWS = 3

# Times are counted in whole ticks of 1/1024 s: every part is then a float the sum of the
# parts reproduces exactly, with no rounding however many segments a long run has.
_TICKS_PER_S = 1024


@dataclass(frozen=True)
class RunStarted:
    """The driver started: the run's first submission, or a resubmission of it."""

    at: float


@dataclass(frozen=True)
class RunStopped:
    """The driver ended (finished, failed or cancelled); nothing runs until a resubmission."""

    at: float


@dataclass(frozen=True)
class CapacityWait:
    """The cluster could not hold the smallest allowed worker group."""

    start: float
    end: float


@dataclass(frozen=True)
class AttemptStarted:
    """A worker group's training function started, then restored `restored_step`'s
    checkpoint (0: none) in `restore_s`, converting it in `reshard_s`."""

    at: float
    restored_step: int
    restore_s: float = 0.0
    reshard_s: float = 0.0


@dataclass(frozen=True)
class GroupStopped:
    """The controller learned that the worker group stopped: kind "failure" or "resize"."""

    at: float
    kind: str


@dataclass(frozen=True)
class Steps:
    """Optimizer steps `first`..`last` (inclusive), run back to back over [start, end):
    one metrics window of the training loop at `world_size` (0: not known). `data_wait_s`,
    `checkpoint_stall_s`, `report_wait_s` and `eval_s` are the window's totals of those parts
    (blocked handing a report to the controller; scoring the validation set)."""

    first: int
    last: int
    start: float
    end: float
    data_wait_s: float = 0.0
    checkpoint_stall_s: float = 0.0
    world_size: int = 0
    report_wait_s: float = 0.0
    eval_s: float = 0.0

    @property
    def step_s(self) -> float:
        """Time per step besides data wait, checkpoint stall, report wait and validation."""
        waits = self.data_wait_s + self.checkpoint_stall_s + self.report_wait_s + self.eval_s
        return max(0.0, self.end - self.start - waits) / (self.last - self.first + 1)


# Goodput's own inputs, named apart from the run's events (`wildtrain.events`) that
# `reports.runs.goodput_events` turns into them: a `Waiting` into a `CapacityWait`, a
# `Failure` or `Resize` into a `GroupStopped`.
GoodputEvent = Union[RunStarted, RunStopped, CapacityWait, AttemptStarted, GroupStopped, Steps]
_POINT_EVENTS = (GroupStopped, RunStopped, RunStarted, AttemptStarted)


@dataclass(frozen=True)
class Goodput:
    wall_s: float
    productive_s: float
    badput_s: dict[str, float]  # every cause in BADPUT_CAUSES, zeros included

    @property
    def goodput(self) -> float:
        return self.productive_s / self.wall_s if self.wall_s > 0 else 0.0


def account(events: Sequence[GoodputEvent], now: float) -> Goodput:
    """Split the wall time from the first `RunStarted` to `now` into productive time and
    badput by cause. The parts add up to `wall_s` exactly (times are taken to 1/1024 s).

    Each instant gets exactly one cause:

    1. Intervals claim time, and where they overlap the first of LOST, RESTORE, WAITING,
       CHECKPOINT_STALL, DATA_WAIT, REPORT_WAIT, EVAL, PRODUCTIVE wins:
       - a `Steps` window: its steps that were later redone are LOST (its tail: the newest
         steps); the rest is DATA_WAIT then REPORT_WAIT at its start, EVAL then
         CHECKPOINT_STALL at its end, STALLED before those (see `stalled_s`) and PRODUCTIVE
         between, each part scaled to the steps kept. Parts larger than the window (clock noise) are cut to fit it. A
         step
         is redone when an attempt that starts at or after the window's end restored an
         older step, or a window that starts at or after its end runs it again.
       - RESTORE for `restore_s + reshard_s` from an `AttemptStarted`;
       - WAITING for a `CapacityWait`.
    2. Unclaimed time takes the cause of the latest event before it: STARTUP after a
       `RunStarted`, `AttemptStarted` or `GroupStopped`; STOPPED after a `RunStopped`.
       After a `Steps` window it depends on what comes next: LOST before a failure (the
       step in flight and the time to notice it), STARTUP before a resize or a stop
       (handing the group over), UNREPORTED before anything else (between report windows;
       after the newest report of a run still going, or one whose driver died unrecorded).
       Events at the same time apply in the order window end, interruption, stop, start,
       attempt.
    """
    bounds, causes = _partition(events, now)
    ticks = collections.Counter()
    for a, b, cause in zip(bounds, bounds[1:], causes):
        ticks[cause] += b - a
    return Goodput(
        wall_s=(bounds[-1] - bounds[0]) / _TICKS_PER_S,
        productive_s=ticks[PRODUCTIVE] / _TICKS_PER_S,
        badput_s={cause: ticks[cause] / _TICKS_PER_S for cause in BADPUT_CAUSES},
    )


def goodput_over_time(events: Sequence[GoodputEvent], now: float, times: Sequence[float]) -> list[float]:
    """Goodput of the run from its start to each of `times` (clipped to the run), as known
    at `now`: steps redone later already count as lost where they ran."""
    bounds, causes = _partition(events, now)
    productive = [0]
    for a, b, cause in zip(bounds, bounds[1:], causes):
        productive.append(productive[-1] + (b - a if cause == PRODUCTIVE else 0))
    origin, end = bounds[0], bounds[-1]
    curve = []
    for t in times:
        tick = min(max(_tick(t), origin), end)
        i = bisect.bisect_right(bounds, tick) - 1
        done = productive[i] + (tick - bounds[i] if i < len(causes) and causes[i] == PRODUCTIVE else 0)
        curve.append(done / (tick - origin) if tick > origin else 0.0)
    return curve


def _tick(t: float) -> int:
    return round(t * _TICKS_PER_S)


def _partition(events: Sequence[GoodputEvent], now: float) -> tuple[list[int], list[str]]:
    """Ascending tick boundaries from the run's start to `now`, and the cause of each
    segment between two of them (see `account`)."""
    starts = [e.at for e in events if isinstance(e, RunStarted)]
    if not starts:
        raise ValueError("goodput counts from the run's start: the events hold no RunStarted")
    origin, end = _tick(min(starts)), _tick(now)
    if end < origin:
        raise ValueError(f"now ({now}) is before the run started ({min(starts)})")
    for e in events:
        _check(e)

    claims = _claims(events)
    phases = _phases(events)
    bounds = sorted(
        {origin, end}
        | {t for s, e, _ in claims for t in (s, e) if origin < t < end}
        | {t for t, _, _ in phases if origin < t < end}
    )
    deltas = sorted([(s, 1, cause) for s, _, cause in claims] + [(e, -1, cause) for _, e, cause in claims])
    active = collections.Counter()
    causes: list[str] = []
    next_delta = next_phase = 0
    phase = STARTUP
    for a in bounds[:-1]:
        while next_delta < len(deltas) and deltas[next_delta][0] <= a:
            _, change, cause = deltas[next_delta]
            active[cause] += change
            next_delta += 1
        while next_phase < len(phases) and phases[next_phase][0] <= a:
            phase = phases[next_phase][2]
            next_phase += 1
        causes.append(next((cause for cause in _PRECEDENCE if active[cause] > 0), phase))
    return bounds, causes


def _check(e: GoodputEvent) -> None:
    if isinstance(e, Steps) and (
        e.last < e.first or e.end < e.start or min(e.data_wait_s, e.checkpoint_stall_s, e.report_wait_s, e.eval_s) < 0
    ):
        raise ValueError(f"{e}: needs first <= last, start <= end and parts >= 0")
    if isinstance(e, CapacityWait) and e.end < e.start:
        raise ValueError(f"{e}: ends before it starts")
    if isinstance(e, AttemptStarted) and min(e.restore_s, e.reshard_s) < 0:
        raise ValueError(f"{e}: negative restore or reshard time")


def _claims(events: Sequence[GoodputEvent]) -> list[tuple[int, int, str]]:
    """(start, end, cause) of every non-empty interval the events claim."""
    claims = []
    for e in events:
        if isinstance(e, CapacityWait):
            claims.append((_tick(e.start), _tick(e.end), WAITING))
        elif isinstance(e, AttemptStarted):
            claims.append((_tick(e.at), _tick(e.at + e.restore_s + e.reshard_s), RESTORE))

    # Anything that starts at or after a window's end and resumes at or below one of its
    # steps shows that step redone: suffix minima of the resumed-from step by start time.
    markers = sorted(
        [(_tick(e.at), e.restored_step) for e in events if isinstance(e, AttemptStarted)]
        + [(_tick(e.start), e.first - 1) for e in events if isinstance(e, Steps)]
    )
    marker_ticks = [t for t, _ in markers]
    kept_below = [float("inf")] * (len(markers) + 1)
    for i in range(len(markers) - 1, -1, -1):
        kept_below[i] = min(kept_below[i + 1], markers[i][1])

    windows = [e for e in events if isinstance(e, Steps)]
    for e, held_up_s in zip(windows, stalled_s(windows)):
        start, end = _tick(e.start), _tick(e.end)
        redone_from = kept_below[bisect.bisect_left(marker_ticks, end)]
        n = e.last - e.first + 1
        kept_steps = n - min(n, max(0, e.last - max(redone_from, e.first - 1)))
        kept = (end - start) * kept_steps // n
        data_wait = min(kept, round(e.data_wait_s * _TICKS_PER_S * kept_steps / n))
        report_wait = min(kept - data_wait, round(e.report_wait_s * _TICKS_PER_S * kept_steps / n))
        waited = data_wait + report_wait
        stall = min(kept - waited, round(e.checkpoint_stall_s * _TICKS_PER_S * kept_steps / n))
        evaluating = min(kept - waited - stall, round(e.eval_s * _TICKS_PER_S * kept_steps / n))
        tail = stall + evaluating
        held_up = min(kept - waited - tail, round(held_up_s * _TICKS_PER_S * kept_steps / n))
        claims += [
            (start, start + data_wait, DATA_WAIT),
            (start + data_wait, start + waited, REPORT_WAIT),
            (start + waited, start + kept - tail - held_up, PRODUCTIVE),
            (start + kept - tail - held_up, start + kept - tail, STALLED),
            (start + kept - tail, start + kept - stall, EVAL),
            (start + kept - stall, start + kept, CHECKPOINT_STALL),
            (start + kept, end, LOST),
        ]
    return [claim for claim in claims if claim[1] > claim[0]]


def stalled_s(windows: Sequence[Steps]) -> list[float]:
    """Per window, the time its steps were held up: beyond the median step of the windows
    at its world size, when its steps took more than STALL_FACTOR times that median."""
    by_size = collections.defaultdict(list)
    for w in windows:
        by_size[w.world_size].append(w.step_s)
    usual = {size: statistics.median(times) for size, times in by_size.items() if len(times) >= STALL_MIN_WINDOWS}
    stalled = []
    for w in windows:
        median = usual.get(w.world_size)
        held_up = median is not None and w.step_s > STALL_FACTOR * median
        stalled.append((w.step_s - median) * (w.last - w.first + 1) if held_up else 0.0)
    return stalled


# Ties at one instant: a window that ends as the group is interrupted ends first; a stop
# and a resubmission at the same instant leave the run started.
_PHASE_ORDER = {Steps: 0, GroupStopped: 1, RunStopped: 2, RunStarted: 3, AttemptStarted: 4}


def _phases(events: Sequence[GoodputEvent]) -> list[tuple[int, int, str]]:
    """(tick, tie order, cause) from which unclaimed time takes `cause`, ascending."""
    # What follows a window decides the cause of the unclaimed time after it.
    followers = sorted(
        [(_tick(e.start), UNREPORTED) for e in events if isinstance(e, Steps)]
        + [(_tick(e.at), _after_steps_before(e)) for e in events if isinstance(e, _POINT_EVENTS)]
    )
    follower_ticks = [t for t, _ in followers]
    phases = []
    for e in events:
        if isinstance(e, Steps):
            end = _tick(e.end)
            i = bisect.bisect_left(follower_ticks, end)
            phases.append((end, _PHASE_ORDER[Steps], followers[i][1] if i < len(followers) else UNREPORTED))
        elif isinstance(e, _POINT_EVENTS):
            phases.append((_tick(e.at), _PHASE_ORDER[type(e)], STOPPED if isinstance(e, RunStopped) else STARTUP))
    return sorted(phases)


def _after_steps_before(e: GoodputEvent) -> str:
    if isinstance(e, GroupStopped):
        return LOST if e.kind == "failure" else STARTUP
    return STARTUP if isinstance(e, RunStopped) else UNREPORTED
