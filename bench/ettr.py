"""ETTR under chaos (issue 24): restart against in-process recovery as worker nodes die on a schedule.

A tiny run on a local fake cluster (a head and two one-worker nodes, `bench/recovery.py`'s)
whose worker nodes die every `--kill-every-min` minutes from its submission and come back
`--return-after-min` later, on wildtrain's default config. Prints the run's effective
training time ratio (goodput: productive seconds over wall seconds, from its own accounting,
`wildtrain report`), the badput by cause, the interruptions that happened, and where the
first attempt's start-up went (`bench/startup.py`'s phases).

The run must outlast the chaos schedule for every death to land: `--steps` is a step count,
not a duration; the table says how many deaths landed and how long the run took. The
default is sized for a 20-minute run with three deaths on a 2-core machine
(docs/benchmarks.md, goodput under chaos).

Runs both modes side by side by default, one after the other on fresh services and clusters:
"restart" (every resize restarts the group) and "in-process" (elastic.in_process: the survivor
re-forms in its process, and a worker started on the returned node joins it). Each death takes
the node of the rank `--victims` names next, in the newest in-process generation (rank 1, by
default, every time; `--victims 0 1` alternates: on two nodes, every second death leaves
only a joiner, which then reports for the group through the controller).

Usage: .venv/bin/python bench/ettr.py [--steps 15000] [--kill-every-min 5] [--return-after-min 1]
       [--modes restart in-process] [--ray-metrics on off] [--placement auto PACK STRICT_SPREAD NODE_BUNDLES]
       [--victims 0 1]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from typing import Callable

from progress import say
from recovery import WORKER_SLOT, add_worker_node, fake_cluster, rank_node, tiny_services
from startup import start_up_phases

from tests.helpers.chaos import BackgroundRun
from wildtrain import services
from wildtrain.config import load_config
from wildtrain.config.system import PLACEMENT_STRATEGIES
from wildtrain.events import Failure, Formed, Recovered, Resize
from wildtrain.tracking.record import read_events
from wildtrain.tracking.reports.goodput import BADPUT_CAUSES
from wildtrain.tracking.reports.runs import report_run


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


def chaos_run(args, in_process: bool, ray_metrics: str, placement: str) -> dict[str, str]:
    """One run under the chaos schedule, on services and a fake cluster of its own: its
    measures, by name."""
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
                f"elastic.in_process={str(in_process).lower()}",
                f"cluster.placement_strategy={placement}",
            ]
        )
        say(
            f"{MODES[in_process]}: training {args.steps} steps; a worker node dies every {args.kill_every_min:g} min "
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
        events = read_events(mlflow_url, summary.run_id, tempfile.mkdtemp(dir=root))
        phases = start_up_phases(mlflow_url, cfg.run.name, submitted, root)

    recoveries = [e for e in events if isinstance(e, Recovered)]
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
    return measures


MODES = {False: "restart", True: "in-process"}
RAY_METRICS = {"on": {}, "off": services.RAY_METRICS_OFF}  # services.RAY_METRICS_OFF says why


def column_name(args, mode: str, metrics: str, placement: str) -> str:
    """A run's column: its mode, and what else was varied or differs from the defaults (Ray's
    metrics on, as Ray's; wildtrain's auto placement)."""
    also = ([f"Ray metrics {metrics}"] if len(args.ray_metrics) > 1 or metrics != "on" else []) + (
        [placement] if len(args.placement) > 1 or placement != "auto" else []
    )
    return f"{mode} ({', '.join(also)})" if also else mode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=15000)
    parser.add_argument("--kill-every-min", type=float, default=5.0)
    parser.add_argument("--return-after-min", type=float, default=1.0)
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=sorted(MODES.values()),
        default=list(MODES.values()),
        help="restart: every resize restarts the group; in-process: elastic.in_process=true",
    )
    parser.add_argument(
        "--ray-metrics",
        nargs="+",
        choices=sorted(RAY_METRICS),
        default=["on"],
        help="Ray's metrics collection on the fake cluster (on: Ray's default); each mode runs with each",
    )
    parser.add_argument(
        "--placement",
        nargs="+",
        choices=PLACEMENT_STRATEGIES,
        default=["auto"],
        help="cluster.placement_strategy (auto: wildtrain's default, on this cluster of one-worker "
        "nodes STRICT_SPREAD for restart, NODE_BUNDLES for in-process, alike; PACK: Ray's); "
        "each mode runs with each",
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
    columns = {
        column_name(args, mode, metrics, placement): chaos_run(
            args, in_process=mode == "in-process", ray_metrics=metrics, placement=placement
        )
        for mode in args.modes
        for metrics in args.ray_metrics
        for placement in args.placement
    }
    names = list(dict.fromkeys(name for measures in columns.values() for name in measures))
    print("\n| measure | " + " | ".join(columns) + " |\n|---|" + "---|" * len(columns))
    for name in names:
        print(f"| {name} | " + " | ".join(measures.get(name, "-") for measures in columns.values()) + " |")


if __name__ == "__main__":
    main()
