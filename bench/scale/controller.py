"""The controller's side of a report at N ranks (issue 60, table 2): every rank sends a real
`WorkerReport` (`worker_report.py`, four log-step windows of the metrics the controller logs)
each poll, and the controller reads rank 0's (`rank_zero`) and logs its windows' metrics
(`tracking.controller.mlflow_run.TRAINING_METRICS`). Measured per N: the bytes of the N
reports a poll carries (pickled, as Ray moves them), the CPU time of pickling and unpickling
them (a stand-in for Ray's transport, which this does not run), the CPU time of the
controller's own processing (`rank_zero` and the metric points built from it), and the
metric values sent to MLflow per log step.

MLflow's logging is timed against a real server (`services.start_mlflow`: SQLite in a temp
dir, on a free port, stopped at the end) through the controller's own path: each poll's
windows go to `Tracker.metric_points`, whose buffer thread sends them (`Client.log_metrics`);
the time per poll is the time to send `--polls` polls' records, over the polls. For scale,
the same for every rank's metrics (keyed by rank), which the controller does not log: what
logging per rank would cost.

Usage: PYTHONPATH=platform .venv/bin/python bench/scale/controller.py [--ranks 8 64 256 1024] [--no-mlflow]
"""

from __future__ import annotations

import argparse
import pickle
import sys
import tempfile
import time
from pathlib import Path

from wildtrain import services
from wildtrain.tracking.controller.mlflow_run import TRAINING_METRICS, Tracker
from wildtrain.tracking.mlflow_client import Client
from wildtrain.worker_report import WorkerReport, rank_zero

sys.path.insert(0, str(Path(__file__).resolve().parent))
from growth import growth_line, markdown  # noqa: E402

WINDOWS = 4  # log steps a report covers (a poll every 2 s, a log step every 0.5 s)


def report(rank: int, world: int, step: int) -> dict:
    windows = tuple(
        {key: float(rank + i) for key in TRAINING_METRICS} | {"step": step - WINDOWS + 1 + i, "at": 1e9 + i}
        for i in range(WINDOWS)
    )
    return WorkerReport(step=step, tokens_seen=step * 4096, world_size=world, windows=windows).to_dict()


def cpu(f, repeat: int = 5) -> float:
    started = time.process_time()
    for _ in range(repeat):
        f()
    return (time.process_time() - started) / repeat


def mlflow_s(uri: str, run_id: str, folder: Path, polls: list[list[tuple[dict, int, float]]]) -> float:
    """Seconds to send each poll's metric points through a `Tracker`, per poll."""
    tracker = Tracker(uri, run_id, folder)
    started = time.perf_counter()
    for points in polls:
        tracker.metric_points(points)
    if tracker.close(600) is not None:
        raise RuntimeError("MLflow did not take every record")
    return (time.perf_counter() - started) / len(polls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 64, 256, 1024])
    parser.add_argument("--polls", type=int, default=10, help="polls sent to MLflow per N")
    parser.add_argument("--no-mlflow", action="store_true", help="count what is sent, do not start a server")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="scale-controller-") as tmp:
        if args.no_mlflow:
            measure(args.ranks, args.polls, None, Path(tmp))
            return
        port = services.free_port()
        server = services.start_mlflow(Path(tmp, "mlflow"), port)
        try:
            measure(args.ranks, args.polls, f"http://{services.HOST}:{port}", Path(tmp))
        finally:
            services.stop_process(server.pid)


def measure(ranks: list[int], polls: int, uri: str | None, tmp: Path) -> None:
    rows, carried, processed, logged, per_rank = [], [], [], [], []
    client = Client(uri) if uri else None
    experiment = client.experiment_id("scale-bench") if client else ""
    for n in ranks:
        metrics = [report(rank, n, 100) for rank in range(n)]
        blob = pickle.dumps(metrics)
        transport = cpu(lambda: pickle.loads(pickle.dumps(metrics)))

        def process():
            r = rank_zero(metrics)
            return [({k: w[k] for k in TRAINING_METRICS if k in w}, int(w["step"]), w["at"]) for w in r.windows]

        controller = cpu(process, repeat=50)
        points = process()
        values_per_step = len(points[0][0])
        carried.append(len(blob))
        processed.append(controller)
        row = [
            f"{n:,}",
            f"{len(blob) / 1e3:,.0f} kB",
            f"{transport * 1000:.2f} ms",
            f"{controller * 1e6:.0f} µs",
            values_per_step,
        ]
        if client:
            # The controller's path: rank 0's windows, `polls` polls, into a run of their own.
            sent = mlflow_s(uri, client.create_run(experiment, f"rank0-{n}", {}), tmp / f"r0-{n}", [points] * polls)
            # Every rank's windows, keyed by rank: one poll (it is N times the values).
            every_rank = [
                ({f"rank_{rank}/{k}": v for k, v in values.items()}, step, at)
                for rank, m in enumerate(metrics)
                for values, step, at in (
                    ({k: w[k] for k in TRAINING_METRICS if k in w}, int(w["step"]), w["at"])
                    for w in WorkerReport.from_dict(m).windows
                )
            ]
            all_sent = mlflow_s(uri, client.create_run(experiment, f"all-{n}", {}), tmp / f"all-{n}", [every_rank])
            logged.append(sent)
            per_rank.append(all_sent)
            row += [
                f"{sent * 1000:.0f} ms",
                f"{all_sent * 1000:,.0f} ms ({len(every_rank) * values_per_step // WINDOWS:,})",
            ]
        rows.append(row)
        print(" | ".join(str(c) for c in rows[-1]), flush=True)
    print()
    headers = [
        "ranks",
        "reports a poll carries (pickled)",
        "pickle + unpickle them",
        "controller's processing",
        "metric values to MLflow per log step",
    ]
    if client:
        headers += [
            f"MLflow logging per poll ({WINDOWS} log steps)",
            "every rank's metrics instead, per poll (values per log step)",
        ]
    print(markdown(headers, rows))
    print(growth_line("reports' bytes", ranks, carried))
    print(growth_line("controller's processing", ranks, processed))
    if client:
        print(growth_line("MLflow logging per poll", ranks, logged))
        print(growth_line("every rank's metrics to MLflow", ranks, per_rank))


if __name__ == "__main__":
    main()
