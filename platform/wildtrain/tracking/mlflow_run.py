"""One MLflow run per training run, spanning every attempt and resize.

The driver opens (or, for a resubmitted run, reopens) the run; `MlflowCallback` logs from
the Ray Train controller, which outlives worker restarts, so a restart never starts a
second MLflow run.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from typing import Optional

from ray.train import UserCallback

from wildtrain.config import Config, flatten, to_yaml

# MLflow caps a batch at 100 params and a param value at 6000 characters.
_PARAMS_PER_BATCH = 100


class TrackingError(RuntimeError):
    pass


def check_reachable(uri: str, timeout_s: float = 5.0) -> None:
    if not uri.startswith(("http://", "https://")):
        return
    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout_s) as response:
            if response.status == 200:
                return
            reason = f"HTTP {response.status}"
    except (urllib.error.URLError, OSError) as e:
        reason = str(getattr(e, "reason", e))
    raise TrackingError(
        f"tracking.uri: the MLflow server at {uri} is unreachable ({reason}); start the local one "
        "with `wildtrain up`, or point tracking.uri at yours"
    )


def open_run(cfg: Config, run_id: Optional[str]) -> tuple[str, str]:
    """(experiment id, run id): the run `run_id` reopened, or a new run with the config logged."""
    from mlflow.entities import Param
    from mlflow.tracking import MlflowClient

    client = MlflowClient(cfg.tracking.uri)
    if run_id is not None:
        run = client.get_run(run_id)
        client.update_run(run_id, status="RUNNING")
        return run.info.experiment_id, run_id

    experiment = client.get_experiment_by_name(cfg.tracking.experiment)
    experiment_id = experiment.experiment_id if experiment else client.create_experiment(cfg.tracking.experiment)
    run = client.create_run(experiment_id, run_name=cfg.run.name, tags={"wildtrain.cluster": cfg.cluster.name})
    params = [Param(key, str(value)[:6000]) for key, value in flatten(cfg).items()]
    for i in range(0, len(params), _PARAMS_PER_BATCH):
        client.log_batch(run.info.run_id, params=params[i : i + _PARAMS_PER_BATCH])
    client.log_text(run.info.run_id, to_yaml(cfg), "config.yaml")
    return experiment_id, run.info.run_id


def finish_run(uri: str, run_id: str, status: str) -> None:
    from mlflow.tracking import MlflowClient

    MlflowClient(uri).set_terminated(run_id, status=status)


def run_url(uri: str, experiment_id: str, run_id: str) -> str:
    return f"{uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"


class MlflowCallback(UserCallback):
    """Logs rank 0's metrics of every report, and each checkpoint, to the run."""

    def __init__(self, uri: str, run_id: str) -> None:
        self.uri = uri
        self.run_id = run_id
        self._client = None

    def after_report(self, run_context, metrics, checkpoint) -> None:
        from mlflow.entities import Metric
        from mlflow.tracking import MlflowClient

        if self._client is None:
            self._client = MlflowClient(self.uri)
        reported = metrics[0]
        step = int(reported["step"])
        now = int(time.time() * 1000)
        values = [
            Metric(key, float(value), now, step)
            for key, value in reported.items()
            if key != "step" and isinstance(value, (int, float))
        ]
        if checkpoint is not None:
            values.append(Metric("checkpoint_step", float(step), now, step))
            self._client.set_tag(self.run_id, "wildtrain.last_checkpoint", checkpoint.path)
        self._client.log_batch(self.run_id, metrics=values)
