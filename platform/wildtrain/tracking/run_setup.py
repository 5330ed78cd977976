"""Opening the MLflow run of a training run, from the driver: created with its config
(params and config.yaml), tags and cluster, or reopened for a resubmission or a move.
Runs that start together (a sweep's trials) race on MLflow's unique keys here; the
`Client` takes the loser through.
"""

from __future__ import annotations

from typing import Mapping, Optional

from wildtrain.config import RunSectionConfig, TrackingConfig, redact
from wildtrain.tracking.mlflow_client import Client
from wildtrain.tracking.record import CLUSTER_TAG, CLUSTERS_TAG

# MLflow caps a param value at 6000 characters.
_PARAM_CHARS = 6000


def open_run(
    tracking: TrackingConfig,
    run: RunSectionConfig,
    cluster: str,
    run_id: Optional[str],
    tags: Optional[dict[str, str]] = None,
    *,
    params: Mapping[str, object],
    config_yaml: str,
) -> tuple[str, str]:
    """(experiment id, run id): the run `run_id` reopened, or a new run on `cluster` with the
    config logged (`params`, its flattened keys, and `config_yaml`) and tagged with `run.tags`
    and `tags` (a sweep's parent run id and trial)."""
    client = Client(tracking.uri)
    if run_id is not None:
        reopened = client.get_run(run_id)
        client.set_running(run_id)
        visited = reopened.data.tags.get(CLUSTERS_TAG, ",")
        if f",{cluster}," not in visited:  # resumed on another cluster: moved
            client.set_tag(run_id, CLUSTERS_TAG, f"{visited}{cluster},")
        client.set_tag(run_id, CLUSTER_TAG, cluster)
        return reopened.info.experiment_id, run_id

    experiment_id = client.experiment_id(tracking.experiment)
    run_id = client.create_run(
        experiment_id,
        run.name,
        {CLUSTER_TAG: cluster, CLUSTERS_TAG: f",{cluster},", **run.tags, **(tags or {})},
    )
    # Everyone who can read the experiment sees params: no user:password from a URI in them.
    client.log_params(run_id, {key: redact(str(value))[:_PARAM_CHARS] for key, value in params.items()})
    client.log_text(run_id, redact(config_yaml), "config.yaml")
    return experiment_id, run_id
