"""ETTR under chaos (issue 24): one tiny run on a local fake cluster (a head and two
one-worker nodes, `bench/recovery.py`'s) whose worker nodes die every `--kill-every-min`
minutes from its submission and come back `--return-after-min` later, on wildtrain's
default config. Prints the run's effective training time ratio (goodput: productive
seconds over wall seconds, from its own accounting, `wildtrain report`), the badput by
cause, the interruptions that happened, and where the first attempt's start-up went
(`bench/startup.py`'s phases).

The run must outlast the chaos schedule for every death to land: `--steps` is a step count,
not a duration; the table says how many deaths landed and how long the run took. Here (2
cores, nothing else running, restart-based recovery) 8,000 steps took 1,068 s with three
deaths landed: ETTR 86.8%; badput start-up 72.9 s (the first attempt's 29.1 of it), lost
20.6 s (85 steps redone), data wait 20.2 s, restore 15.7 s; hence the default of 9,000.

With --in-process the run has elastic.in_process on and each death is rank 1's (rank 0's
falls back to a restart): the survivor re-forms in its process, and the group regrows by a
restart once the node is back.

Usage: .venv/bin/python bench/ettr.py [--steps 9000] [--kill-every-min 5] [--return-after-min 1] [--in-process]
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
from wildtrain.events import Failure, Recovered, Resize
from wildtrain.tracking.record import read_events
from wildtrain.tracking.reports.runs import report_run


def chaos(run: BackgroundRun, cluster, submitted: float, every_s: float, back_after_s: float,
          victim: Callable[[], object]) -> list[tuple[str, float]]:
    """Kill a worker node (`victim()`) every `every_s` from `submitted`, add one back
    `back_after_s` later, until the run ends; what was done, when."""
    done: list[tuple[str, float]] = []
    deaths = 0
    while run.thread.is_alive():
        kill_at = submitted + (deaths + 1) * every_s
        run.thread.join(max(0.0, kill_at - time.time()))
        if not run.thread.is_alive():
            break
        cluster.remove_node(victim())
        deaths += 1
        done.append(("node killed", time.time()))
        say(f"killed a worker node ({deaths}) at {time.time() - submitted:.0f} s")
        run.thread.join(max(0.0, kill_at + back_after_s - time.time()))
        add_worker_node(cluster)
        done.append(("node returned", time.time()))
        say(f"a worker node returned at {time.time() - submitted:.0f} s")
    return done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=9000)
    parser.add_argument("--kill-every-min", type=float, default=5.0)
    parser.add_argument("--return-after-min", type=float, default=1.0)
    parser.add_argument("--in-process", action="store_true", help="elastic.in_process=true; rank 1's node dies")
    args = parser.parse_args()
    if not 0 < args.return_after_min < args.kill_every_min:
        raise SystemExit(f"need 0 < --return-after-min ({args.return_after_min:g}) < --kill-every-min "
                         f"({args.kill_every_min:g}): the next death comes after the return")
    with tiny_services("bench-ettr") as (root, dataset, mlflow_url), fake_cluster(services.NODE_HEALTH_CHECKS) as cluster:
        cfg = load_config([
            "experiment=tiny", f"data.datasets=[{{uri: {dataset}}}]", f"run.name=ettr-{int(time.time())}",
            f"run.storage={root / 'runs'}", f"tracking.uri={mlflow_url}", "tracking.experiment=bench-ettr",
            f"train.steps={args.steps}", f"cluster.worker_resources.{WORKER_SLOT}=1",
            f"elastic.in_process={str(args.in_process).lower()}",
        ])
        say(f"training {args.steps} steps; a worker node dies every {args.kill_every_min:g} min from now and "
            f"returns {args.return_after_min:g} min later")
        submitted = time.time()
        run = BackgroundRun(cfg)
        done = chaos(run, cluster, submitted, args.kill_every_min * 60, args.return_after_min * 60,
                     lambda: rank_node(cluster, run, mlflow_url, root, 1))
        summary = run.join(0)
        ended = time.time()
        result = report_run(mlflow_url, summary.run_id)
        folder = tempfile.mkdtemp(dir=root)
        events = read_events(mlflow_url, summary.run_id, folder)
        phases = start_up_phases(mlflow_url, cfg.run.name, submitted, root)

    deaths = sum(what == "node killed" for what, _ in done)
    print("\n| measure | value |\n|---|---|")
    print(f"| ETTR (goodput) | {result.goodput:.1%} of {result.wall_s:.0f} s |")
    print(f"| run | finished, {ended - submitted:.0f} s from submission, {deaths} node deaths landed; "
          f"final checkpoint {summary.checkpoint} |")
    print(f"| failures / resizes / recoveries recorded | {sum(isinstance(e, Failure) for e in events)} / "
          f"{sum(isinstance(e, Resize) for e in events)} / {sum(isinstance(e, Recovered) for e in events)} |")
    print(f"| steps redone | {sum(e.steps_lost for e in events if isinstance(e, Recovered))} |")
    print(f"| productive | {result.productive_s:.1f} s |")
    for cause, seconds in sorted(result.badput_s.items(), key=lambda kv: -kv[1]):
        if seconds > 0:
            print(f"| badput: {cause} | {seconds:.1f} s |")
    print("\n| first attempt's start-up | s |\n|---|---|")
    for phase, seconds in phases.items():
        print(f"| {phase} | {seconds:.1f} |")


if __name__ == "__main__":
    main()
