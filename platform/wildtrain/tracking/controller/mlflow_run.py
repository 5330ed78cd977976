"""One MLflow run per training run, spanning every attempt and resize.

The driver opens (or, for a resubmitted run, reopens) the run (`run_setup`); `MlflowRecorder` logs from
the Ray Train controller, which outlives worker restarts, so a restart never starts a
second MLflow run. The controller's records go through a `Tracker`: `ray.train.report`
returns on the worker only once the controller has handled the report, so a call to a
slow or stopped MLflow server there would stop training.
"""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Optional

from wildtrain import storage
from wildtrain.config import StorageConfig
from wildtrain.controller_events import (
    Consumer,
    Entry,
    GroupStarted,
    Interruption,
    Noted,
    Recovery,
    RecoveryPath,
    Reported,
    Stage,
    StateChanged,
)
from wildtrain.events import Event, Hang, HealthCheck, StoppedEarly
from wildtrain.layout import rank_of_hang_dump
from wildtrain.tracking.controller.buffer import Outage, TrackingBuffer
from wildtrain.tracking.mlflow_client import METRICS_PER_REQUEST, Client, bound_requests, is_transient
from wildtrain.tracking.record import EVENTS_DIR, STARTUP_METRICS, STOPPED_EARLY_TAG, mlflow_key

# What the controller logs of rank 0's reports, besides every `checkpoint/*` (per save);
# `time/*` are means per step over the report's window.
TRAINING_METRICS = (
    "step",
    "loss",
    "lr",
    "tokens_seen",
    "tokens_per_s",
    "step_time_s",
    "world_size",
    "epoch",
    "mfu",
    "time/data_wait_s",
    "time/forward_s",
    "time/backward_s",
    "time/optimizer_s",
    "time/checkpoint_stall_s",
    "time/report_wait_s",
    "time/eval_s",
    "memory/peak_gb",
    "spares",
)

# In the controller, a request to a stopped server fails after this long, once: the
# tracker retries it with its own backoff, in order, and records the outage.
_REQUEST_TIMEOUT_S = 10
# At the end of a run, how long the records still waiting may take to send.
FLUSH_TIMEOUT_S = 30.0

_EVENT_COUNTER = itertools.count()


def log_event(client: Client, run_id: str, event: Event, step: int) -> None:
    """Log an event now (for the driver, outside training); `Tracker.event` buffers it."""
    for record in _event_records(run_id, event, step):
        _send(client, record)


def _event_records(run_id: str, event: Event, step: int) -> list[dict]:
    """Each event is its own small JSON artifact, so a resubmitted run appends to them;
    named and stamped when it happened, however late it is sent."""
    now = time.time()
    # Buffered events are named within the same millisecond (a health check's, one per
    # rank): the counter keeps each its own file, in the order they happened.
    return [
        {
            "op": "text",
            "run_id": run_id,
            "path": f"{EVENTS_DIR}/{now:.3f}-{next(_EVENT_COUNTER):06d}-{event.KIND}.json",
            "text": json.dumps(event.to_dict(), indent=1),
        },
        {
            "op": "metrics",
            "run_id": run_id,
            "metrics": [[mlflow_key(f"elastic/{event.KIND}"), 1.0, int(now * 1000), step]],
        },
    ]


def _send(client: Client, record: dict) -> None:
    """One buffered record to MLflow. Each is idempotent (a metric point with its
    timestamp, a tag, a named artifact), so sending one again after a timeout is harmless."""
    run_id = record["run_id"]
    op = record["op"]
    if op == "metrics":
        client.log_metrics(run_id, [tuple(row) for row in record["metrics"]])
    elif op == "tag":
        client.set_tag(run_id, record["key"], record["value"])
    elif op == "text":
        client.log_text(run_id, record["text"], record["path"])
    elif op == "terminated":
        client.end_run(run_id, record["status"], record["end_time"])
    else:
        raise ValueError(f"unknown tracking record {op!r}")


class Tracker:
    """A run's MLflow records, sent in order by a background thread (`TrackingBuffer`):
    no call here waits on the server. An outage is recorded as a `tracking_outage` event
    once the server takes records again."""

    def __init__(self, uri: str, run_id: str, folder: Path, bounded_requests: bool = False) -> None:
        if bounded_requests:  # process-wide: for the controller, where only this tracker calls MLflow
            bound_requests(_REQUEST_TIMEOUT_S)
        self.run_id = run_id
        self.step = 0  # the newest step logged: where an outage event is marked
        client = Client(uri)
        self._buffer = TrackingBuffer(
            lambda record: _send(client, record), folder, is_transient=is_transient, on_outage=self._outage
        )

    def metrics(self, values: dict[str, float], step: int, at: Optional[float] = None) -> None:
        """Log `values` at `step`, stamped `at` (wall-clock seconds; default: now)."""
        self.metric_points([(values, step, at)])

    def metric_points(self, points: list[tuple[dict[str, float], int, Optional[float]]]) -> None:
        """Log several (values, step, at) points in as few requests as MLflow takes: a report
        carries every log step since the last one, and a request per step would cost the
        controller and the server more than the step itself on a small machine. A record is
        one request: retried whole."""
        now = time.time()
        rows = [
            [mlflow_key(key), float(value), int((now if at is None else at) * 1000), step]
            for values, step, at in points
            for key, value in values.items()
        ]
        if points:
            self.step = max(self.step, max(step for _, step, _ in points))
        for i in range(0, len(rows), METRICS_PER_REQUEST):
            self._buffer.put({"op": "metrics", "run_id": self.run_id, "metrics": rows[i : i + METRICS_PER_REQUEST]})

    def event(self, event: Event, step: int) -> None:
        for record in _event_records(self.run_id, event, step):
            self._buffer.put(record)

    def tag(self, key: str, value: str) -> None:
        self._buffer.put({"op": "tag", "run_id": self.run_id, "key": key, "value": value})

    def text(self, text: str, path: str) -> None:
        self._buffer.put({"op": "text", "run_id": self.run_id, "path": path, "text": text})

    def terminated(self, status: str) -> None:
        self._buffer.put(
            {"op": "terminated", "run_id": self.run_id, "status": status, "end_time": int(time.time() * 1000)}
        )

    def close(self, timeout_s: float) -> Optional[Path]:
        """Send what is left within `timeout_s`; the file of what could not be (None: all was)."""
        unsent = self._buffer.close(timeout_s)
        if unsent is not None:
            print(
                f"warning: MLflow did not take every record within {timeout_s:g} s; they are kept in "
                f"{unsent} and sent first by the run's next submission",
                flush=True,
            )
        return unsent

    def _outage(self, outage: Outage) -> None:
        event = outage.event()
        self.event(event, self.step)
        print(f"{event.KIND}: {event.summary()}", flush=True)


def _numbers(values: dict, keys: tuple[str, ...]) -> dict[str, float]:
    """The numbers among `values` named in `keys`, and the validation metrics (`val/...`)."""
    return {
        key: value
        for key, value in values.items()
        if (key in keys or key.startswith("val/")) and isinstance(value, (int, float))
    }


class MlflowRecorder(Consumer):
    """In the Ray Train controller, records what `elastic.controller.ControllerEvents` tells
    in the run's MLflow run: rank 0's metrics of every report, each checkpoint, the elastic
    timeline (failures, resizes, recoveries) and every other event, and the hung ranks'
    stacks. Records before the restart policy acts, which may end the run."""

    stage = Stage.RECORD

    def __init__(self, uri: str, run_id: str, hang_dumps: str, storage_config: StorageConfig, folder: Path) -> None:
        self.uri = uri
        self.run_id = run_id
        self.folder = folder  # see `RunLayout.tracking`
        self.hang_dumps = hang_dumps  # where workers' hang watchdogs write their stacks
        self.storage_config = storage_config
        self._attached: set[str] = set()
        self.step = 0  # of the newest report: where an event that names no step is logged
        self.worker_pids: list[int] = []  # by rank, of the newest group
        self._tracking: Optional[Tracker] = None

    @property
    def tracking(self) -> Tracker:
        # Made in the controller: the recorder is built in the driver and pickled there.
        if self._tracking is None:
            self._tracking = Tracker(self.uri, self.run_id, self.folder, bounded_requests=True)
        return self._tracking

    def ended(self) -> None:
        if self._tracking is not None:
            self._tracking.close(FLUSH_TIMEOUT_S)
            self._tracking = None

    def group_started(self, started: GroupStarted) -> None:
        self.worker_pids = started.pids
        # Node-seconds in service, for the cluster card's failures per node-day.
        self.tracking.metrics({"elastic/nodes": len(set(started.nodes))}, self.step)

    def state_changed(self, change: StateChanged) -> None:
        for entry in change.entries:
            if isinstance(entry, Interruption) and entry.path is RecoveryPath.RESTART:
                # The whole group stopped: no node in service from its last step, and the
                # stacks its hung ranks wrote explain it.
                event = entry.event
                self._record(event, event.last_step)
                self.tracking.metrics({"elastic/nodes": 0}, event.last_step)
                self._attach_hang_dumps(event.last_step, event.nodes)
            else:
                self._log_entry(entry, self.step)

    def reported(self, reported: Reported) -> None:
        report = reported.report
        step = self.step = report.step
        # Each window closed at a log step since the last report, at its step and at the time
        # the worker closed it: the report itself may come a poll later (train/attempt.py).
        self.tracking.metric_points(
            [(_numbers(window, TRAINING_METRICS), int(window["step"]), window["at"]) for window in report.windows]
        )
        values = dict(report.checkpoint)
        if report.startup is not None:
            values |= {f"startup/{key}": getattr(report.startup, key) for key in STARTUP_METRICS}
        for entry in reported.entries:
            if isinstance(entry, Recovery) and entry.path is RecoveryPath.RESTART:
                values |= {
                    f"elastic/{key}": value
                    for key, value in asdict(entry.event).items()
                    if key != "at" and isinstance(value, (int, float))
                }
            self._log_entry(entry, step)
        for committed in report.committed_checkpoints:
            self.tracking.tag("wildtrain.last_checkpoint", committed)
        if values:
            self.tracking.metrics(values, step)

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
            self.tracking.text(text, f"hangs/{name}")
            reasons.append(text.splitlines()[0] if text else "")
        dumped = {rank_of_hang_dump(name) for name in dumps}
        silent = [
            {"rank": rank, "node": node, "pid": self.worker_pids[rank] if rank < len(self.worker_pids) else None}
            for rank, node in enumerate(nodes)
            if rank not in dumped
        ]
        reason = reasons[0] + "".join(
            f"; rank {s['rank']} (pid {s['pid']} on node {s['node']}) wrote no stacks: stopped, or stuck outside Python"
            for s in silent
        )
        self._log_event(Hang(time.time(), [f"hangs/{name}" for name in dumps], silent, reason), step)

    def record_event(self, event: Event) -> None:
        """An event of another controller callback, at the newest step reported."""
        self._log_event(event, self.step)

    def _log_entry(self, entry: Entry, step: int) -> None:
        """A timeline entry is said by the progress lines (or, in-process, by the workers)."""
        if isinstance(entry, Noted):
            self._log_event(entry.event, step)
        else:
            self._record(entry.event, step)

    def _log_event(self, event: Event, step: int) -> None:
        """Into MLflow, and onto the log unless it is a passed health check."""
        self._record(event, step)
        if isinstance(event, HealthCheck):
            if not event.passed:
                print(f"health check failed at step {step}: {event.summary()}", flush=True)
        else:
            print(f"{event.KIND} at step {step}: {event.summary()}", flush=True)

    def _record(self, event: Event, step: int) -> None:
        self.tracking.event(event, step)
        if isinstance(event, StoppedEarly):  # searchable, unlike the event's artifact
            self.tracking.tag(STOPPED_EARLY_TAG, event.reason)
