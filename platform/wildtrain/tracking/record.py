"""How a run is recorded in MLflow: the keys its metrics and tags go under and its events'
artifacts. The controller and the driver write them during training (`controller/`), the
reports and sweeps read them afterwards (`reports/`, `sweeps/`): both sides name them here,
so a renamed key cannot leave a reader looking for the old one.
"""

from __future__ import annotations

import json
from pathlib import Path

from wildtrain.events import Event, from_dict
from wildtrain.tracking.mlflow_client import Client

EVENTS_DIR = "events"  # one JSON artifact per event (`controller.mlflow_run`)
# Set, with the reason, on a run the early-stop rule ended (`early_stop.*`).
STOPPED_EARLY_TAG = "wildtrain.stopped_early"
CLUSTER_TAG = "wildtrain.cluster"  # where the run trains now
# Every cluster it trained on, as ",a,b,": a moved run is on each one's report card, and
# MLflow's search finds it with LIKE.
CLUSTERS_TAG = "wildtrain.clusters"

# The MLflow UI's Model metrics tab shows a section per key prefix, alphabetically, above the
# keys with none, and keeps the keys under `system/` for its System metrics tab. What the
# model learns and how fast stays on the first: validation's section (eval/ too, where evals
# ran), then loss, lr, mfu and tokens_per_s; how the run runs (step timings, memory,
# checkpoints, nodes, start-up) goes to the second, where its sections stood above the loss.
# `step`, `tokens_seen` and `world_size` stay: tools read them there (a run's summary, a
# sweep's loss-against-tokens curves, the elastic tests).
MODEL_METRICS = ("step", "loss", "lr", "tokens_seen", "tokens_per_s", "mfu", "world_size")
SYSTEM_PREFIX = "system/"


def mlflow_key(name: str) -> str:
    """The MLflow key of a metric the workers or the controller name `name`."""
    return name if name in MODEL_METRICS or name.startswith(("val/", "eval/")) else SYSTEM_PREFIX + name


# An attempt's first report: where its start-up went (bench/startup.py), logged as startup/<key>.
STARTUP_METRICS = (
    "worker_started_at",
    "attempt_started_at",
    "health_checked_at",
    "restored_at",
    "engine_build_s",
    "first_step_at",
)


def read_events(uri: str, run_id: str, folder: str) -> list[Event]:
    """The run's elastic events (see `controller.mlflow_run.MlflowRecorder`), oldest first."""
    client = Client(uri)
    if not client.has_artifacts(run_id, EVENTS_DIR):
        return []
    local = client.download(run_id, EVENTS_DIR, folder)
    return [from_dict(json.loads(path.read_text())) for path in sorted(Path(local).glob("*.json"))]
