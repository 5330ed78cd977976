"""A helper of bench/eval_interference.py, eval_share.py and report_cadence.py, no benchmark.

What those benches, which time whole tiny runs, share: an object store, an MLflow server,
the tiny corpus prepared, a local fake cluster, and a run's steps/s read back from MLflow.

steps/s is the steps between the first and the last window the run logged, over the time
between them (the workers stamp each window when it closes): start-up and the end of the
run are left out, and every run is timed over the same span.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from wildtrain import services

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# Ray reads its authentication mode once, on import: the fake cluster uses tokens, as
# `wildtrain up` does.
os.environ.update(services.token_auth_env())

import ray  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402
from recovery import tiny_services  # noqa: E402

from wildtrain import driver  # noqa: E402
from wildtrain.config import Config, load_config  # noqa: E402
from wildtrain.tracking.record import mlflow_key  # noqa: E402


@dataclass(frozen=True)
class Timed:
    """A run's pace over its logged span, and the shares of that span spent handing reports
    over and validating (goodput's report_wait and eval)."""

    run_id: str
    steps_per_s: float
    report_wait: float
    validation: float


@dataclass
class TinyBench:
    root: Path
    dataset: str
    mlflow_url: str
    experiment: str

    def config(self, name: str, *overrides: str) -> Config:
        return load_config(
            [
                "experiment=tiny",
                f"data.datasets=[{{uri: {self.dataset}}}]",
                f"run.name={name}-{int(time.time())}",
                f"run.storage={self.root / 'runs'}",
                f"tracking.uri={self.mlflow_url}",
                f"tracking.experiment={self.experiment}",
                *overrides,
            ]
        )

    def train(self, cfg: Config) -> Timed:
        summary = driver.run(cfg)
        client = MlflowClient(self.mlflow_url)
        windows = sorted(client.get_metric_history(summary.run_id, mlflow_key("step_time_s")), key=lambda m: m.step)
        first, last = windows[0], windows[-1]
        span_s = (last.timestamp - first.timestamp) / 1000

        def share(key: str) -> float:
            per_step = {m.step: m.value for m in client.get_metric_history(summary.run_id, key)}
            # Each window's mean per step, times the steps it covers.
            return (
                sum((w.step - before.step) * per_step.get(w.step, 0.0) for before, w in zip(windows, windows[1:]))
                / span_s
            )

        return Timed(
            summary.run_id,
            (last.step - first.step) / span_s,
            share(mlflow_key("time/report_wait_s")),
            share(mlflow_key("time/eval_s")),
        )


def add_services_nice(parser) -> None:
    """The `--services-nice` option of the benches that pass it to `tiny_bench`."""
    parser.add_argument(
        "--services-nice",
        type=int,
        default=0,
        help="the object store's and MLflow server's niceness: 0 as `wildtrain up` runs them, "
        "19 as if they ran elsewhere (tiny_runs.tiny_bench)",
    )


@contextlib.contextmanager
def tiny_bench(experiment: str, num_cpus: int, services_nice: int = 0) -> Iterator[TinyBench]:
    """The services, the tiny corpus in the store, and a one-node fake cluster of `num_cpus`
    CPUs that this process has joined; all stopped after. `services_nice`: the object
    store's and MLflow server's niceness (`wildtrain up` runs them at 0, which outranks
    training: Ray runs its workers at 15). 19 stands in for services on other machines,
    as on a real cluster: what they serve then costs the training node no CPU."""
    with tiny_services(experiment, services_nice) as (root, dataset, mlflow_url):
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": num_cpus})
        ray.init(address=cluster.address)
        try:
            yield TinyBench(root, dataset, mlflow_url, experiment)
        finally:
            ray.shutdown()
            cluster.shutdown()
