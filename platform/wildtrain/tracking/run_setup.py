"""Opening the MLflow run of a training run: created with its config (params and
config.yaml), tags and cluster, or reopened for a resubmission or a move; its dataset
inputs. Runs that start together (a sweep's trials) race on MLflow's unique keys here, and
each of these calls takes the loser through.
"""

from __future__ import annotations

import json
from typing import Optional

from wildtrain.config import Config, flatten, redact, to_yaml

CLUSTER_TAG = "wildtrain.cluster"  # where the run trains now
# Every cluster it trained on, as ",a,b,": a moved run is on each one's report card, and
# MLflow's search finds it with LIKE.
CLUSTERS_TAG = "wildtrain.clusters"
# MLflow 3 opens an experiment in its GenAI view (traces, latency, "Detect issues") unless it
# is a model-training one: the kind the UI's own switch writes, set when wildtrain creates it.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
TRAINING_KIND = "custom_model_development"
# MLflow caps a batch at 100 params and a param value at 6000 characters.
_PARAMS_PER_BATCH = 100


def open_run(cfg: Config, run_id: Optional[str], tags: Optional[dict[str, str]] = None) -> tuple[str, str]:
    """(experiment id, run id): the run `run_id` reopened, or a new run with the config
    logged and tagged with `run.tags` and `tags` (a sweep's parent run id and trial)."""
    from mlflow.entities import Param
    from mlflow.tracking import MlflowClient

    client = MlflowClient(cfg.tracking.uri)
    if run_id is not None:
        run = client.get_run(run_id)
        client.update_run(run_id, status="RUNNING")
        visited = run.data.tags.get(CLUSTERS_TAG, ",")
        if f",{cfg.cluster.name}," not in visited:  # resumed on another cluster: moved
            client.set_tag(run_id, CLUSTERS_TAG, f"{visited}{cfg.cluster.name},")
        client.set_tag(run_id, CLUSTER_TAG, cfg.cluster.name)
        return run.info.experiment_id, run_id

    experiment_id = experiment_id_of(client, cfg.tracking.experiment)
    run = client.create_run(experiment_id, run_name=cfg.run.name,
                            tags={CLUSTER_TAG: cfg.cluster.name, CLUSTERS_TAG: f",{cfg.cluster.name},",
                                  **cfg.run.tags, **(tags or {})})
    # Everyone who can read the experiment sees params: no user:password from a URI in them.
    params = [Param(key, redact(str(value))[:6000]) for key, value in flatten(cfg).items()]
    for i in range(0, len(params), _PARAMS_PER_BATCH):
        client.log_batch(run.info.run_id, params=params[i : i + _PARAMS_PER_BATCH])
    client.log_text(run.info.run_id, redact(to_yaml(cfg)), "config.yaml")
    return experiment_id, run.info.run_id


def experiment_id_of(client, name: str) -> str:
    """The experiment's id; created if there is none. Two runs that start together may both
    create it: the one that loses finds the other's."""
    from mlflow.exceptions import MlflowException

    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        return experiment.experiment_id
    try:
        return client.create_experiment(name, tags={EXPERIMENT_KIND_TAG: TRAINING_KIND})
    except MlflowException:
        experiment = client.get_experiment_by_name(name)
        if experiment is None:
            raise
        return experiment.experiment_id


def log_datasets(client, run_id: str, datasets: list[tuple[str, str, int]]) -> None:
    """Each (uri, manifest sha256, bad records its preparation skipped) as an MLflow dataset
    input: the UI shows what each run trained on, and runs on different data show different
    digests. MLflow keeps one input per dataset and digest, so a resubmission logs nothing new."""
    from mlflow.entities import Dataset, DatasetInput, InputTag
    from mlflow.exceptions import MlflowException

    inputs = [DatasetInput(Dataset(name=uri, digest=sha256[:16], source_type="wildtrain-manifest",
                                   source=f"{uri}/manifest.json", profile=json.dumps({"bad_records": bad})),
                           tags=[InputTag("mlflow.data.context", "training")])
              for uri, sha256, bad in datasets]
    for attempt in range(_DATASET_ATTEMPTS):
        try:
            client.log_inputs(run_id, datasets=inputs)
            return
        except MlflowException as e:
            # Runs that start together (a sweep's trials) record the same new dataset at
            # once, and MLflow's store checks, then inserts: the losers' insert breaks its
            # unique key. Logged again, MLflow finds the winner's row and links to it.
            if attempt + 1 == _DATASET_ATTEMPTS or not any(m in str(e) for m in _DUPLICATE_KEY):
                raise


_DATASET_ATTEMPTS = 3
# How SQLite, PostgreSQL and MySQL name a broken unique key, through MLflow's SQL store.
_DUPLICATE_KEY = ("UNIQUE constraint failed", "UniqueViolation", "Duplicate entry")
