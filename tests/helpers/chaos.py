"""Fault injection on a local fake multi-node cluster (`ray.cluster_utils.Cluster`), for
the elastic tests and the recovery benchmark: run training in a background thread, watch
its MLflow run, and remove or add nodes when it reaches chosen points."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from mlflow.tracking import MlflowClient

from tests.helpers.pacing import Pace
from wildtrain import driver
from wildtrain.config import Config

# Only the session cluster's head offers it: a run that asks for it
# (`cluster.worker_resources.wildtrain_head=1`) stays off the nodes a test adds and removes.
HEAD_SLOT = "wildtrain_head"

# The training that runs moved between clusters (test_clusters) and resized (test_elastic)
# must reproduce, step for step: UL2 under document masks, the objective with the most moving
# parts (random corruption per document, reserved ids, a mask and positions from doc_ids),
# validated every 10 steps, checkpointed every 4, and half a second a step (UNINTERRUPTED_PACE),
# so that 40 steps outlast a move, or a node's death, its detection and its return.
UNINTERRUPTED_STEPS = 40
UNINTERRUPTED = (
    f"train.steps={UNINTERRUPTED_STEPS}",
    "train.log_every=1",
    "checkpoint.every=4",
    "eval.every=10",
    "train.objective=ul2",
    "model.attention=document",
)
UNINTERRUPTED_PACE = Pace(min_step_s=0.5)


@dataclass
class BackgroundRun:
    cfg: Config
    # The drill's pace, kept by every worker of the run (tests/helpers/pacing.py); none: unpaced.
    pace: Optional[Pace] = None
    summary: Optional[driver.RunSummary] = None
    error: Optional[BaseException] = None
    thread: threading.Thread = field(init=False)
    run_id: Optional[str] = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.thread = threading.Thread(target=self._run, name=f"run-{self.cfg.run.name}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.summary = driver.run(self.cfg, step_hook=self.pace.spec() if self.pace else None)
        except BaseException as e:  # handed to the waiting thread
            self.error = e

    def join(self, timeout_s: float) -> driver.RunSummary:
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            raise TimeoutError(f"run {self.cfg.run.name!r} did not finish within {timeout_s:g} s")
        if self.error is not None:
            raise self.error
        return self.summary

    def mlflow_run_id(self) -> Optional[str]:
        """The run's MLflow id, once the driver created the run; kept from then on (it never
        changes), so that polls ask MLflow only for what they poll."""
        if self.run_id is None:
            client = MlflowClient(self.cfg.tracking.uri)
            experiment = client.get_experiment_by_name(self.cfg.tracking.experiment)
            runs = (
                []
                if experiment is None
                else client.search_runs(
                    [experiment.experiment_id], filter_string=f"attributes.run_name = '{self.cfg.run.name}'"
                )
            )
            self.run_id = runs[0].info.run_id if runs else None
        return self.run_id

    def reports(self, key: str = "world_size") -> list:
        """The run's history of `key` (MLflow metrics) in the order it was logged."""
        run_id = self.mlflow_run_id()
        if run_id is None:
            return []
        history = MlflowClient(self.cfg.tracking.uri).get_metric_history(run_id, key)
        return sorted(history, key=lambda m: (m.timestamp, m.step))

    def wait_until(
        self, condition: Callable[[list], bool], what: str, timeout_s: float, key: str = "world_size"
    ) -> list:
        """Poll the run's reports until `condition(reports)` holds; fail if the run ends first."""
        deadline = time.monotonic() + timeout_s
        while True:
            history = self.reports(key)
            if condition(history):
                return history
            if not self.thread.is_alive():
                raise RuntimeError(f"run ended before {what}: {self.error!r}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {what} within {timeout_s:g} s (last reports: {history[-3:]})")
            time.sleep(0.25)
