"""Steps per second against how often a run logs: reports must never hold a step back.

Ray Train keeps one report per worker, and a second waits until the controller polls
(`elastic.poll_interval_s`, 2 s). Before the loop sent its log steps' metrics together at
most once a poll, a tiny run logging every step trained one step per poll. This script
trains the tiny model with `train.log_every` 1, 5 (the demo's) and 1000 (only the first
and last steps), at world size 1 and 2, on one local fake cluster with the default 2 s
poll, one run after the other, `--repeats` times in alternating order (so that the load of
a shared machine drifts over every cadence alike), and prints the median steps/s of each
and its ratio to the `log_every=1000` runs at the same size (the goal: within 3%).

steps/s is read back from MLflow: the steps between the first and the last window the run
logged, over the time between them (the workers stamp each window when it closes), so
start-up and the end of the run are left out, and every run is timed over the same span.
`report wait` and `validation` are the shares of that span spent handing reports over and
scoring the validation set (goodput's report_wait and eval; the demo's experiment validates
every 20 steps on the 5% of documents `make demo` holds out), `load` the machine's 1-minute
load average meanwhile.

Usage: .venv/bin/python bench/report_cadence.py [--steps 150] [--log-every 1,5,1000] [--world-sizes 1,2] [--repeats 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from progress import say
from wildtrain import services

REPO = Path(__file__).resolve().parents[1]
# The tiny corpus's preparation comes from the recovery bench, beside this file.
sys.path.insert(0, str(REPO))

# Ray reads its authentication mode once, on import: the fake cluster uses tokens, as
# `wildtrain up` does.
os.environ.update(services.token_auth_env())

import ray  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from recovery import prepare_tiny  # noqa: E402
from wildtrain import driver  # noqa: E402
from wildtrain.config import load_config  # noqa: E402
from wildtrain.tracking.mlflow_run import quiet_mlflow  # noqa: E402


def steps_per_s(client: MlflowClient, run_id: str) -> tuple[float, float, float]:
    """Steps/s between the run's first and last logged windows, and the shares of that span
    spent handing reports over and validating (the demo's validations: eval.every)."""
    windows = sorted(client.get_metric_history(run_id, "step_time_s"), key=lambda m: m.step)
    first, last = windows[0], windows[-1]
    span_s = (last.timestamp - first.timestamp) / 1000

    def share(key: str) -> float:
        per_step = {m.step: m.value for m in client.get_metric_history(run_id, key)}
        # Each window's mean per step, times the steps it covers.
        return sum((w.step - before.step) * per_step.get(w.step, 0.0) for before, w in zip(windows, windows[1:])) / span_s

    return (last.step - first.step) / span_s, share("time/report_wait_s"), share("time/eval_s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--log-every", default="1,5,1000")
    parser.add_argument("--world-sizes", default="1,2")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    cadences = [int(n) for n in args.log_every.split(",")]
    sizes = [int(n) for n in args.world_sizes.split(",")]
    quiet_mlflow()
    root = Path(tempfile.mkdtemp(prefix="wildtrain-bench-report-cadence-"))
    say(f"starting an object store and an MLflow server in {root}")
    store = services.start_object_store(root / "objectstore", services.free_port(), "bench")
    os.environ.update(store.env())  # before the cluster starts: its workers inherit it
    port = services.free_port()
    mlflow = services.start_mlflow(root / "mlflow", port)
    mlflow_url = f"http://{services.HOST}:{port}"
    rows = []
    try:
        say("preparing the tiny corpus")
        dataset = prepare_tiny(f"s3://{store.bucket}/datasets/tiny")
        # Two training workers and a CPU for Ray Data's reads, as `wildtrain up`'s head offers.
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": max(sizes) + 1})
        ray.init(address=cluster.address)
        client = MlflowClient(mlflow_url)
        try:
            for size in sizes:
                for repeat in range(args.repeats):
                    for every in cadences if repeat % 2 == 0 else cadences[::-1]:
                        name = f"cadence-w{size}-log{every}-{repeat}-{int(time.time())}"
                        cfg = load_config([
                            "experiment=tiny", f"data.datasets=[{{uri: {dataset}}}]", f"run.name={name}",
                            f"run.storage={root / 'runs'}", f"tracking.uri={mlflow_url}",
                            "tracking.experiment=bench-report-cadence", f"train.steps={args.steps}",
                            f"train.log_every={every}", f"train.checkpoint_every={args.steps}",
                            f"elastic.min_workers={size}", f"elastic.max_workers={size}",
                            "elastic.poll_interval_s=2",
                        ])
                        say(f"world size {size}, log_every {every}, run {repeat + 1}: training {args.steps} steps")
                        load_before = os.getloadavg()[0]
                        summary = driver.run(cfg)
                        rate, wait_share, eval_share = steps_per_s(client, summary.run_id)
                        rows.append({"world size": size, "log_every": every, "steps/s": rate,
                                     "report wait": wait_share, "eval": eval_share,
                                     "load": (load_before + os.getloadavg()[0]) / 2})
                        say(f"world size {size}, log_every {every}, run {repeat + 1}: {rate:.2f} steps/s")
        finally:
            ray.shutdown()
            cluster.shutdown()
    finally:
        services.stop_process(mlflow.pid)
        services.stop_process(store.pid)

    def median(size: int, every: int, key: str) -> float:
        return statistics.median(r[key] for r in rows if r["world size"] == size and r["log_every"] == every)

    print(f"\nmedians of {args.repeats} runs each, {args.steps} steps a run")
    print("| world size | log_every | steps/s | vs log_every=1000 | report wait | validation | load | each run's steps/s |")
    print("|---|---|---|---|---|---|---|---|")
    for size in sizes:
        for every in cadences:
            rate = median(size, every, "steps/s")
            ratio = f"{rate / median(size, 1000, 'steps/s'):.3f}" if 1000 in cadences else "-"
            each = ", ".join(f"{r['steps/s']:.2f}" for r in rows if r["world size"] == size and r["log_every"] == every)
            print(f"| {size} | {every} | {rate:.2f} | {ratio} | {median(size, every, 'report wait'):.1%} | "
                  f"{median(size, every, 'eval'):.1%} | {median(size, every, 'load'):.1f} | {each} |")


if __name__ == "__main__":
    main()
