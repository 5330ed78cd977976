"""One MLflow run per training run, spanning every attempt and resize.

The driver opens (or, for a resubmitted run, reopens) the run; `MlflowCallback` logs from
the Ray Train controller, which outlives worker restarts, so a restart never starts a
second MLflow run.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Optional

from ray.train.v2._internal.execution.callback import ControllerCallback, ReportCallback, WorkerGroupCallback

from wildtrain import storage
from wildtrain.config import Config, StorageConfig, flatten, to_yaml
from wildtrain.tracking.timeline import Restart, Timeline
from wildtrain.train.watchdog import rank_of_dump

EVENTS_DIR = "events"
CLUSTER_TAG = "wildtrain.cluster"
# What the controller logs of rank 0's reports, besides every `checkpoint/*` (per save);
# `time/*` are means per step over the report's window.
TRAINING_METRICS = (
    "step", "loss", "lr", "tokens_seen", "tokens_per_s", "step_time_s", "world_size", "epoch", "mfu",
    "time/data_wait_s", "time/forward_s", "time/backward_s", "time/optimizer_s", "time/checkpoint_stall_s",
)

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
    run = client.create_run(experiment_id, run_name=cfg.run.name, tags={CLUSTER_TAG: cfg.cluster.name})
    params = [Param(key, str(value)[:6000]) for key, value in flatten(cfg).items()]
    for i in range(0, len(params), _PARAMS_PER_BATCH):
        client.log_batch(run.info.run_id, params=params[i : i + _PARAMS_PER_BATCH])
    client.log_text(run.info.run_id, to_yaml(cfg), "config.yaml")
    return experiment_id, run.info.run_id


def read_events(uri: str, run_id: str, folder: str) -> list[dict]:
    """The run's elastic events (see `MlflowCallback`), oldest first."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    if not client.list_artifacts(run_id, EVENTS_DIR):
        return []
    local = client.download_artifacts(run_id, EVENTS_DIR, folder)
    return [json.loads(path.read_text()) for path in sorted(Path(local).glob("*.json"))]


def log_event(client, run_id: str, event: dict, step: int) -> None:
    """Each event is its own small JSON artifact, so a resubmitted run appends to them."""
    name = f"{EVENTS_DIR}/{time.time():.3f}-{event['event']}.json"
    client.log_text(run_id, json.dumps(event, indent=1), name)
    client.log_metric(run_id, f"elastic/{event['event']}", 1.0, step=step)


def run_url(uri: str, experiment_id: str, run_id: str) -> str:
    return f"{uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"


class MlflowCallback(ReportCallback, ControllerCallback, WorkerGroupCallback):
    """Runs in the Ray Train controller: logs rank 0's metrics of every report, each
    checkpoint, and the elastic timeline (failures, resizes, recoveries) to the run.

    It uses Ray Train's developer callback hooks rather than `UserCallback`, which sees
    reports but not the controller's state changes that mark failures and resizes."""

    def __init__(self, uri: str, run_id: str, classify_restart: Callable[[BaseException | None], Restart],
                 hang_dumps: str, storage_config: StorageConfig) -> None:
        self.uri = uri
        self.run_id = run_id
        self.classify_restart = classify_restart
        self.hang_dumps = hang_dumps  # where workers' hang watchdogs write their stacks
        self.storage_config = storage_config
        self._attached: set[str] = set()
        self.timeline = Timeline()
        self.worker_pids: list[int] = []  # by rank, of the newest group
        self._client = None

    @property
    def client(self):
        from mlflow.tracking import MlflowClient

        if self._client is None:
            self._client = MlflowClient(self.uri)
        return self._client

    def after_worker_group_start(self, worker_group) -> None:
        workers = sorted(worker_group.get_workers(), key=lambda w: w.distributed_context.world_rank)
        nodes = [w.metadata.node_id for w in workers]
        self.worker_pids = [w.metadata.pid for w in workers]
        self.timeline.group_started(nodes)
        # Node-seconds in service, for the cluster card's failures per node-day.
        self.client.log_metric(self.run_id, "elastic/nodes", len(set(nodes)), step=self.timeline.last_step)

    def after_controller_state_update(self, previous_state, current_state) -> None:
        state = current_state._state_type.state_name
        kind = {"RESTARTING": "failure", "RESCHEDULING": "failure", "RESIZING": "resize"}.get(state)
        if kind is None:
            return
        restart = self.classify_restart(getattr(current_state, "training_failed_error", None))
        if kind == "failure":
            kind = restart.kind
        event = self.timeline.interrupted(kind, time.time(), restart.cause)
        if event is not None:
            self._log_event(event, event["last_step"])
            self.client.log_metric(self.run_id, "elastic/nodes", 0, step=event["last_step"])
            self._attach_hang_dumps(event["last_step"], event["nodes"])
            print(f"{kind} after step {event['last_step']} at world size {event['world_size']}: {restart.cause}", flush=True)
        if state == "RESTARTING":  # once per failed group, even within one outage
            for carried in restart.events:  # a failed health check's results, the nodes left out
                self._log_event(carried, self.timeline.last_step)

    def after_report(self, training_report, metrics) -> None:
        from mlflow.entities import Metric

        reported = metrics[0]
        step = int(reported["step"])
        recovery = self.timeline.reported(reported)
        now = int(time.time() * 1000)
        values = [
            Metric(key, float(value), now, step)
            for key, value in reported.items()
            if (key in TRAINING_METRICS or key.startswith("checkpoint/")) and isinstance(value, (int, float))
        ]
        if recovery is not None:
            values += [Metric(f"elastic/{key}", float(value), now, step) for key, value in asdict(recovery).items()
                       if isinstance(value, (int, float))]
            self._log_event(self.timeline.events[-1], step)
            print(
                f"recovered at world size {recovery.world_size_after} from step {recovery.restored_step} "
                f"in {recovery.recovery_s:.1f} s (restart {recovery.restart_s:.1f} s, restore {recovery.restore_s:.1f} s, "
                f"reshard {recovery.reshard_s:.1f} s); {recovery.steps_lost} steps redone",
                flush=True,
            )
        for event in reported.get("events", []):  # the workers' own: health, stragglers, checkpoints
            self._log_event(event, step)
        for committed in reported.get("committed_checkpoints", []):
            self.client.set_tag(self.run_id, "wildtrain.last_checkpoint", committed)
        self.client.log_batch(self.run_id, metrics=values)

    def _attach_hang_dumps(self, step: int, nodes: list[str]) -> None:
        """Stacks the hang watchdogs wrote before they failed the attempt, as artifacts under
        hangs/, and one `hang` event. A rank that wrote none could not run its watchdog
        (stopped, or stuck outside Python with the GIL held): the event names it, since it
        is the likeliest cause of the others' wait."""
        _, paths = storage.list_files(self.hang_dumps, self.storage_config)
        dumps = sorted(name for name in (path.rsplit("/", 1)[-1] for path in paths) if name not in self._attached)
        if not dumps:
            return
        reasons = []
        for name in dumps:
            self._attached.add(name)
            text = storage.read_text(storage.join(self.hang_dumps, name), self.storage_config) or ""
            self.client.log_text(self.run_id, text, f"hangs/{name}")
            reasons.append(text.splitlines()[0] if text else "")
        dumped = {rank_of_dump(name) for name in dumps}
        silent = [{"rank": rank, "node": node, "pid": self.worker_pids[rank] if rank < len(self.worker_pids) else None}
                  for rank, node in enumerate(nodes) if rank not in dumped]
        reason = reasons[0] + "".join(
            f"; rank {s['rank']} (pid {s['pid']} on node {s['node']}) wrote no stacks: stopped, or stuck outside Python"
            for s in silent
        )
        self._log_event({"event": "hang", "at": time.time(), "dumps": [f"hangs/{name}" for name in dumps],
                         "silent_ranks": silent, "reason": reason}, step)

    def _log_event(self, event: dict, step: int) -> None:
        """Into MLflow, and onto the log unless it is a passed health check."""
        log_event(self.client, self.run_id, event, step)
        if event["event"] == "health":
            if not event["passed"]:
                print(f"health check failed at step {step}: {event['check']} on node {event['node']}: {event['detail']}",
                      flush=True)
        elif event["event"] not in ("failure", "resize", "recovered"):  # printed by their own lines
            print(f"{event['event']} at step {step}: {event.get('reason', '')}", flush=True)
