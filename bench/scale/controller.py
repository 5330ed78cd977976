"""The controller's side of a report at N ranks (issue 60, table 2): every rank sends a real
`WorkerReport` (`worker_report.py`, four log-step windows of the metrics the controller logs)
each poll, and the controller reads rank 0's (`rank_zero`) and logs its windows' metrics
(`tracking.controller.mlflow_run.TRAINING_METRICS`). Measured per N: the bytes of the N
reports a poll carries (pickled, as Ray moves them), the CPU time of pickling and unpickling
them (a stand-in for Ray's transport, which this does not run), the CPU time of the
controller's own processing (`rank_zero` and the metric points built from it), and the
metric values sent to MLflow per log step. No MLflow server is started: what is sent is
counted, not timed.

Usage: PYTHONPATH=platform .venv/bin/python bench/scale/controller.py [--ranks 8 64 256 1024]
"""

from __future__ import annotations

import argparse
import pickle
import sys
import time
from pathlib import Path

from wildtrain.tracking.controller.mlflow_run import TRAINING_METRICS
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 64, 256, 1024])
    args = parser.parse_args()
    rows, carried, processed = [], [], []
    for n in args.ranks:
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
        rows.append(
            [
                f"{n:,}",
                f"{len(blob) / 1e3:,.0f} kB",
                f"{transport * 1000:.2f} ms",
                f"{controller * 1e6:.0f} µs",
                values_per_step,
            ]
        )
        print(" | ".join(str(c) for c in rows[-1]), flush=True)
    print()
    print(
        markdown(
            [
                "ranks",
                "reports a poll carries (pickled)",
                "pickle + unpickle them",
                "controller's processing",
                "metric values to MLflow per log step",
            ],
            rows,
        )
    )
    print(growth_line("reports' bytes", args.ranks, carried))
    print(growth_line("controller's processing", args.ranks, processed))


if __name__ == "__main__":
    main()
