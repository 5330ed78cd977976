"""ETTR under chaos: wildtrain's default config as worker nodes die on a schedule.

A tiny run on a local fake cluster (a head and two one-worker nodes, `bench/recovery.py`'s)
whose worker nodes die every `--kill-every-min` minutes from its submission and come back
`--return-after-min` later, on wildtrain's default config (issue 58's goal: ETTR at least
95 %, aiming at 97 %). Prints the run's effective training time ratio (goodput: productive
seconds over wall seconds, from its own accounting, `wildtrain report`), the badput by
cause, the interruptions that happened, and where the first attempt's start-up went
(`bench/startup.py`'s phases). Then, per run, where its time went by period: from the
submission and from each interruption to the first step after it, the first `--settle-s`
seconds of training after each, and the steady state between: the wall time, productive
time and badput by cause of each, with its steps and its data wait a step (rank 0's wait
for its batches, `time/data_wait_s` of its reports); and the data wait of the report windows
that start an epoch (Ray Data starts each epoch's reads when its first step asks for them)
against the others'.

The run must outlast the chaos schedule for every death to land: `--steps` is a step count,
not a duration; the table says how many deaths landed and how long the run took. The
default is sized for a 20-minute run with three deaths on a 2-core machine
(docs/benchmarks.md, goodput under chaos).

`--reference restart` adds a run of the restart path (elastic.in_process=false: every resize
restarts the group) beside the default's, one after the other on fresh services and
clusters; `--zero-stages` runs each at each ZeRO stage (deepspeed.zero_stage), `--override
KEY=VALUE` sets a config value in every run (under the restart path's own). Each death takes
the node of the rank `--victims` names next, in the newest in-process generation (rank 1, by
default, every time; `--victims 0 1` alternates: on two nodes, every second death leaves
only a joiner, which then reports for the group through the controller).

Usage: .venv/bin/python bench/ettr.py [--steps 15000] [--kill-every-min 5] [--return-after-min 1]
       [--reference restart] [--zero-stages 1 2 3] [--override KEY=VALUE ...] [--settle-s 30]
       [--ray-metrics on off] [--placement auto PACK STRICT_SPREAD NODE_BUNDLES] [--victims 0 1]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from progress import say
from recovery import (
    RESTART,
    WORKER_SLOT,
    add_worker_node,
    fake_cluster,
    rank_node,
    run_options,
    run_overrides,
    tiny_services,
)
from startup import start_up_phases

from tests.helpers.chaos import BackgroundRun
from wildtrain import services
from wildtrain.config import load_config
from wildtrain.config.system import PLACEMENT_STRATEGIES
from wildtrain.data.dataset import open_datasets
from wildtrain.events import Failure, Formed, Recovered, Resize
from wildtrain.tracking.record import read_events
from wildtrain.tracking.reports import goodput
from wildtrain.tracking.reports.goodput import BADPUT_CAUSES, GroupStopped, RunStarted, Steps
from wildtrain.tracking.reports.runs import fetch_run, goodput_events, report_run


def chaos(
    run: BackgroundRun, cluster, submitted: float, every_s: float, back_after_s: float, victim: Callable[[int], object]
) -> list[tuple[str, float]]:
    """Kill a worker node (`victim(deaths so far)`) every `every_s` from `submitted`, add one back
    `back_after_s` later, until the run ends; what was done, when."""
    done: list[tuple[str, float]] = []
    deaths = 0
    while run.thread.is_alive():
        kill_at = submitted + (deaths + 1) * every_s
        run.thread.join(max(0.0, kill_at - time.time()))
        if not run.thread.is_alive():
            break
        cluster.remove_node(victim(deaths))
        deaths += 1
        done.append(("node killed", time.time()))
        say(f"killed a worker node ({deaths}) at {time.time() - submitted:.0f} s")
        run.thread.join(max(0.0, kill_at + back_after_s - time.time()))
        add_worker_node(cluster)
        done.append(("node returned", time.time()))
        say(f"a worker node returned at {time.time() - submitted:.0f} s")
    return done


# The periods a run's time is cut into (`periods`), in the order they are printed.
START_UP = "submission → first step"
AFTER_START = "first {settle} s of training"
OUTAGE = "interruptions → first step after ({n})"
AFTER_OUTAGE = "first {settle} s of training after them"
STEADY = "steady state"
PERIODS = (START_UP, AFTER_START, OUTAGE, AFTER_OUTAGE, STEADY)
CUTS = (RunStarted, GroupStopped)  # the goodput events that begin a period: a submission, an interruption


@dataclass(frozen=True)
class Period:
    kind: str  # one of PERIODS
    start: float
    end: float


def periods(events: Sequence[goodput.GoodputEvent], now: float, settle_s: float) -> list[Period]:
    """The run's time from its first start to `now`, cut at each submission and interruption:
    from each to the first step window after it (START_UP from a submission, OUTAGE from an
    interruption), its next `settle_s` of training (AFTER_START, AFTER_OUTAGE), then STEADY until
    the next cut."""
    cuts = sorted((e.at, START_UP if isinstance(e, RunStarted) else OUTAGE) for e in events if isinstance(e, CUTS))
    starts = sorted(e.start for e in events if isinstance(e, Steps))
    cut: list[Period] = []
    for (at, kind), (until, _) in zip(cuts, [*cuts[1:], (now, None)]):
        trained = next((t for t in starts if t >= at), until)
        settled = min(until, trained + settle_s)
        after = AFTER_START if kind == START_UP else AFTER_OUTAGE
        cut += [Period(kind, at, min(trained, until)), Period(after, trained, settled), Period(STEADY, settled, until)]
    return [period for period in cut if period.end > period.start]


@dataclass(frozen=True)
class Spent:
    """Where one kind of period's time went: its wall time, productive time and badput by
    cause (`goodput.account`'s, over those periods only), the steps whose windows began in it
    and their data wait as reported."""

    wall_s: float
    productive_s: float
    badput_s: dict[str, float]
    steps: int
    reported_data_wait_s: float


def spent_by_period(events: Sequence[goodput.GoodputEvent], now: float, settle_s: float) -> dict[str, Spent]:
    """`account`'s split of the run's time, summed per kind of `periods`: an instant's cause is
    the whole run's (accounting to a period's end less accounting to its start)."""
    cut = periods(events, now, settle_s)
    at = {t: goodput.account(events, t) for p in cut for t in (p.start, p.end)}
    windows = [e for e in events if isinstance(e, Steps)]
    spent = {}
    for kind in PERIODS:
        mine = [p for p in cut if p.kind == kind]
        if not mine:
            continue
        inside = [w for w in windows if any(p.start <= w.start < p.end for p in mine)]
        spent[kind] = Spent(
            wall_s=sum(at[p.end].wall_s - at[p.start].wall_s for p in mine),
            productive_s=sum(at[p.end].productive_s - at[p.start].productive_s for p in mine),
            badput_s={
                cause: sum(at[p.end].badput_s[cause] - at[p.start].badput_s[cause] for p in mine)
                for cause in BADPUT_CAUSES
            },
            steps=sum(w.last - w.first + 1 for w in inside),
            reported_data_wait_s=sum(w.data_wait_s for w in inside),
        )
    return spent


def where_table(spent: dict[str, Spent], settle_s: float, interruptions: int) -> str:
    """`spent` as a table: a row per kind of period, the causes that took any time as columns."""
    causes = [c for c in BADPUT_CAUSES if any(s.badput_s[c] > 0.05 for s in spent.values())]
    header = ["period", "wall (s)", "productive (s)", *(f"{c} (s)" for c in causes), "steps", "data wait a step (ms)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for kind, s in spent.items():
        cells = [
            kind.format(settle=f"{settle_s:g}", n=interruptions),
            f"{s.wall_s:.1f}",
            f"{s.productive_s:.1f}",
            *(f"{s.badput_s[c]:.1f}" for c in causes),
            str(s.steps),
            f"{1000 * s.reported_data_wait_s / s.steps:.1f}" if s.steps else "-",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def first_steps_data_wait(events: Sequence[goodput.GoodputEvent]) -> list[float]:
    """Rank 0's data wait in the first step window after the run's start and each interruption."""
    windows = sorted((e for e in events if isinstance(e, Steps)), key=lambda w: w.start)
    cuts = sorted(e.at for e in events if isinstance(e, CUTS))
    # A submission is two cuts, MLflow's run start and the driver's: each first window counts once.
    firsts = dict.fromkeys(w for w in (next((w for w in windows if w.start >= at), None) for at in cuts) if w)
    return [w.data_wait_s / (w.last - w.first + 1) for w in firsts]


def epoch_data_wait(events: Sequence[goodput.GoodputEvent], steps_per_epoch: int) -> dict[bool, tuple[int, int, float]]:
    """Rank 0's data wait as reported, split by whether a step window holds an epoch's first step
    (step s reads the data at position s - 1): per split, (windows, steps, seconds)."""
    split = {True: (0, 0, 0.0), False: (0, 0, 0.0)}
    for w in (e for e in events if isinstance(e, Steps)):
        starts_epoch = (w.first - 2) // steps_per_epoch < (w.last - 1) // steps_per_epoch
        windows, steps, seconds = split[starts_epoch]
        split[starts_epoch] = (windows + 1, steps + w.last - w.first + 1, seconds + w.data_wait_s)
    return split


def chaos_run(args, column: str, overrides: list[str], ray_metrics: str) -> tuple[dict[str, str], str]:
    """One run under the chaos schedule, on services and a fake cluster of its own: its
    measures, by name, and the table of where its time went by period."""
    with (
        tiny_services("bench-ettr") as (root, dataset, mlflow_url),
        fake_cluster(services.NODE_HEALTH_CHECKS | RAY_METRICS[ray_metrics]) as cluster,
    ):
        cfg = load_config(
            [
                "experiment=tiny",
                f"data.datasets=[{{uri: {dataset}}}]",
                f"run.name=ettr-{int(time.time())}",
                f"run.storage={root / 'runs'}",
                f"tracking.uri={mlflow_url}",
                "tracking.experiment=bench-ettr",
                f"train.steps={args.steps}",
                f"cluster.worker_resources.{WORKER_SLOT}=1",
                *overrides,
            ]
        )
        say(
            f"{column}: training {args.steps} steps; a worker node dies every {args.kill_every_min:g} min "
            f"from now and returns {args.return_after_min:g} min later"
        )
        submitted = time.time()
        run = BackgroundRun(cfg)
        done = chaos(
            run,
            cluster,
            submitted,
            args.kill_every_min * 60,
            args.return_after_min * 60,
            lambda deaths: rank_node(cluster, run, mlflow_url, root, args.victims[deaths % len(args.victims)]),
        )
        summary = run.join(0)
        ended = time.time()
        result = report_run(mlflow_url, summary.run_id)
        record = fetch_run(mlflow_url, summary.run_id)
        events = read_events(mlflow_url, summary.run_id, tempfile.mkdtemp(dir=root))
        phases = start_up_phases(mlflow_url, cfg.run.name, submitted, root)
        steps_per_epoch = open_datasets(
            cfg.data, cfg.storage, model=cfg.model, train=cfg.train, objective=cfg.objective, needs_validation=False
        ).steps_per_epoch

    recoveries = [e for e in events if isinstance(e, Recovered)]
    accounted = goodput_events(record)
    now = record.ended_at if record.ended_at is not None else ended
    measures = {
        "ETTR (goodput)": f"{result.goodput:.1%} of {result.wall_s:.0f} s",
        "run": f"finished, {ended - submitted:.0f} s from submission, "
        f"{sum(what == 'node killed' for what, _ in done)} node deaths landed",
        "failures / resizes / recoveries recorded": f"{sum(isinstance(e, Failure) for e in events)} / "
        f"{sum(isinstance(e, Resize) for e in events)} / {len(recoveries)}",
        "steps redone": str(sum(e.steps_lost for e in recoveries)),
        # In-process, each group Ray starts forms its generation 1: more than one is a restart.
        "worker groups started": str(sum(e.generation == 1 for e in events if isinstance(e, Formed)) or "-"),
        "shrinks: interruption -> first step (s)": ", ".join(
            f"{e.recovery_s:.1f}" for e in recoveries if e.kind == "failure"
        )
        or "-",
        "regrows: interruption -> first step (s)": ", ".join(
            f"{e.recovery_s:.1f}" for e in recoveries if e.kind == "resize"
        )
        or "-",
        "productive (s)": f"{result.productive_s:.1f}",
    }
    for cause in BADPUT_CAUSES:
        measures[f"badput: {cause} (s)"] = f"{result.badput_s[cause]:.1f}"
    for phase, seconds in phases.items():
        measures[f"first attempt's start-up: {phase} (s)"] = f"{seconds:.1f}"
    measures["data wait: a step at the start, then after each interruption (s)"] = ", ".join(
        f"{seconds:.1f}" for seconds in first_steps_data_wait(accounted)
    )
    for starts_epoch, (windows, steps, seconds) in epoch_data_wait(accounted, steps_per_epoch).items():
        which = (
            f"windows holding an epoch's first step ({steps_per_epoch} steps an epoch)" if starts_epoch else "others"
        )
        measures[f"data wait: {which}"] = (
            f"{seconds:.1f} s over {windows} windows, {1000 * seconds / max(1, steps):.1f} ms a step"
        )
    interruptions = sum(isinstance(e, GroupStopped) for e in accounted)
    where = where_table(spent_by_period(accounted, now, args.settle_s), args.settle_s, interruptions)
    return measures, where


REFERENCES = {"restart": (RESTART, ["elastic.in_process=false"])}
RAY_METRICS = {"on": {}, "off": services.RAY_METRICS_OFF}  # services.RAY_METRICS_OFF says why


def column_name(args, mode: str, stage: int, metrics: str, placement: str) -> str:
    """A run's column: its mode, and what else was varied or differs from the defaults (ZeRO-1,
    the config's; Ray's metrics on, as Ray's; wildtrain's auto placement)."""
    also = (
        ([f"ZeRO-{stage}"] if len(args.zero_stages) > 1 or stage != 1 else [])
        + ([f"Ray metrics {metrics}"] if len(args.ray_metrics) > 1 or metrics != "on" else [])
        + ([placement] if len(args.placement) > 1 or placement != "auto" else [])
    )
    return f"{mode}, {', '.join(also)}" if also else mode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=15000)
    parser.add_argument("--kill-every-min", type=float, default=5.0)
    parser.add_argument("--return-after-min", type=float, default=1.0)
    parser.add_argument(
        "--reference",
        nargs="+",
        choices=sorted(REFERENCES),
        default=[],
        help="runs beside the default config's: restart, the restart path (elastic.in_process=false)",
    )
    run_options(parser)
    parser.add_argument(
        "--settle-s",
        type=float,
        default=30.0,
        help="how long after the first step following a start or an interruption counts as settling "
        "(the periods' table)",
    )
    parser.add_argument(
        "--ray-metrics",
        nargs="+",
        choices=sorted(RAY_METRICS),
        default=["on"],
        help="Ray's metrics collection on the fake cluster (on: Ray's default); each run with each",
    )
    parser.add_argument(
        "--placement",
        nargs="+",
        choices=PLACEMENT_STRATEGIES,
        default=["auto"],
        help="cluster.placement_strategy (auto: wildtrain's default, on this cluster of one-worker "
        "nodes STRICT_SPREAD for restart, NODE_BUNDLES for in-process, alike; PACK: Ray's); "
        "each run with each",
    )
    parser.add_argument(
        "--victims",
        nargs="+",
        type=int,
        choices=[0, 1],
        default=[1],
        help="the ranks whose nodes die, in turn (in-process: of the newest generation)",
    )
    args = parser.parse_args()
    if not 0 < args.return_after_min < args.kill_every_min:
        raise SystemExit(
            f"need 0 < --return-after-min ({args.return_after_min:g}) < --kill-every-min "
            f"({args.kill_every_min:g}): the next death comes after the return"
        )
    modes = {"default": [], **dict(REFERENCES[name] for name in args.reference)}
    runs = {
        column_name(args, mode, stage, metrics, placement): chaos_run(
            args,
            column_name(args, mode, stage, metrics, placement),
            [*run_overrides(args, mode_overrides, stage), f"cluster.placement_strategy={placement}"],
            metrics,
        )
        for stage in args.zero_stages
        for mode, mode_overrides in modes.items()
        for metrics in args.ray_metrics
        for placement in args.placement
    }
    columns = {name: measures for name, (measures, _) in runs.items()}
    names = list(dict.fromkeys(name for measures in columns.values() for name in measures))
    print("\n| measure | " + " | ".join(columns) + " |\n|---|" + "---|" * len(columns))
    for name in names:
        print(f"| {name} | " + " | ".join(measures.get(name, "-") for measures in columns.values()) + " |")
    for name, (_, where) in runs.items():
        print(f"\nWhere the time of {name} went, by period:\n\n{where}")


if __name__ == "__main__":
    main()
