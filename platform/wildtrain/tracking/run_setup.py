"""Opening the MLflow run of a training run, from the driver: created with its config
(params and config.yaml), tags and cluster, or reopened for a resubmission or a move.
Runs that start together (a sweep's trials) race on MLflow's unique keys here; the
`Client` takes the loser through.
"""

from __future__ import annotations

from typing import Optional

from wildtrain.config import Config, flatten, redact, to_yaml
from wildtrain.tracking.mlflow_client import Client
from wildtrain.tracking.record import CLUSTER_TAG, CLUSTERS_TAG

# MLflow caps a param value at 6000 characters.
_PARAM_CHARS = 6000


def open_run(cfg: Config, run_id: Optional[str], tags: Optional[dict[str, str]] = None) -> tuple[str, str]:
    """(experiment id, run id): the run `run_id` reopened, or a new run with the config
    logged and tagged with `run.tags` and `tags` (a sweep's parent run id and trial)."""
    client = Client(cfg.tracking.uri)
    if run_id is not None:
        run = client.get_run(run_id)
        client.set_running(run_id)
        visited = run.data.tags.get(CLUSTERS_TAG, ",")
        if f",{cfg.cluster.name}," not in visited:  # resumed on another cluster: moved
            client.set_tag(run_id, CLUSTERS_TAG, f"{visited}{cfg.cluster.name},")
        client.set_tag(run_id, CLUSTER_TAG, cfg.cluster.name)
        return run.info.experiment_id, run_id

    experiment_id = client.experiment_id(cfg.tracking.experiment)
    run_id = client.create_run(
        experiment_id,
        cfg.run.name,
        {CLUSTER_TAG: cfg.cluster.name, CLUSTERS_TAG: f",{cfg.cluster.name},", **cfg.run.tags, **(tags or {})},
    )
    # Everyone who can read the experiment sees params: no user:password from a URI in them.
    client.log_params(run_id, {key: redact(str(value))[:_PARAM_CHARS] for key, value in flatten(cfg).items()})
    client.log_text(run_id, redact(to_yaml(cfg)), "config.yaml")
    return experiment_id, run_id
