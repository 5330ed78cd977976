"""The controller's MLflow logging against a hung server (a socket that accepts and never
answers, as a stopped process does) and a real MLflow store (SQLite, no server)."""

import json
import socket
import time
from dataclasses import replace

import pytest
from mlflow.tracking import MlflowClient

from tests.helpers.reports import first_report
from tests.helpers.runs import open_mlflow_run
from wildtrain.config import StorageConfig
from wildtrain.elastic.controller import ControllerEvents
from wildtrain.events import Resize, StoppedEarly, TrackingOutage
from wildtrain.tracking import mlflow_client, record
from wildtrain.tracking.controller import mlflow_run
from wildtrain.tracking.controller.mlflow_run import MlflowRecorder, Tracker
from wildtrain.tracking.record import mlflow_key, read_events
from wildtrain.worker_report import WorkerReport


@pytest.fixture
def hung_server():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(64)
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def store(tmp_path):
    """A real MLflow store and a run in it."""
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.create_experiment("test", artifact_location=str(tmp_path / "artifacts"))
    return client, client.create_run(experiment).info.run_id


def test_reports_never_wait_on_a_hung_mlflow_server_and_nothing_is_lost(hung_server, tmp_path, monkeypatch):
    # The callback bounds MLflow's requests process-wide: undo that after the test.
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "120")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "7")
    monkeypatch.setattr(mlflow_run, "FLUSH_TIMEOUT_S", 0.5)
    recorder = MlflowRecorder(hung_server, "r1", str(tmp_path / "hangs"), StorageConfig(), tmp_path / "tracking")
    callback = ControllerEvents([recorder])
    started = time.perf_counter()
    for step in range(1, 101):
        window = {"step": step, "at": time.time(), "loss": 5.0 - step / 100, "world_size": 2}
        callback.after_report(None, [WorkerReport(step, 64 * step, 2, windows=(window,)).to_dict()])
    assert time.perf_counter() - started < 1.0, "the report path waited on MLflow"

    started = time.perf_counter()
    callback.after_controller_finish(None)
    assert time.perf_counter() - started < 5.0, "the end of the run waits a bounded time"
    [unsent] = (tmp_path / "tracking").glob("*-unsent.jsonl")
    records = [json.loads(line) for line in unsent.read_text().splitlines()]
    assert [r["metrics"][0][3] for r in records] == list(range(1, 101))  # every report's step, in order


def test_what_a_tracker_could_not_send_the_runs_next_tracker_sends_first(store, tmp_path, monkeypatch):
    client, run_id = store
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # refused at once: an outage from the start
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        down = f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens
    folder = tmp_path / "tracking"

    first = Tracker(down, run_id, folder)
    for step in (1, 2, 3):
        first.metrics({"loss": 4.0 - step, "step_time_s": 0.1}, step)
    first.event(Resize(time.time(), world_size=2, last_step=3), 3)
    unsent = first.close(timeout_s=0.5)
    assert unsent is not None and unsent.parent == folder

    second = Tracker(client.tracking_uri, run_id, folder)
    second.metrics({"loss": 0.5}, 4)
    second.terminated("FINISHED")
    assert second.close(timeout_s=30) is None
    assert not unsent.exists()

    history = sorted(client.get_metric_history(run_id, "loss"), key=lambda m: m.timestamp)
    assert [(m.step, m.value) for m in history] == [(1, 3.0), (2, 2.0), (3, 1.0), (4, 0.5)]
    events = read_events(client.tracking_uri, run_id, str(tmp_path / "events"))
    assert [type(e) for e in events] == [Resize, TrackingOutage]
    assert events[1].resolved is False and events[1].seconds >= 0
    assert client.get_run(run_id).info.status == "FINISHED"


def test_a_run_reopened_on_another_cluster_is_tagged_with_every_cluster_it_trained_on(tmp_path):
    from wildtrain.config import load_config

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    MlflowClient(uri).create_experiment("moves", artifact_location=str(tmp_path / "artifacts"))

    def on(cluster):
        return load_config(
            ["experiment=tiny", f"tracking.uri={uri}", "tracking.experiment=moves", f"cluster.name={cluster}"]
        )

    _, run_id = open_mlflow_run(on("a"), None)
    for cluster in ("b", "b", "a"):  # moved to b, resubmitted there, moved back
        open_mlflow_run(on(cluster), run_id)
    tags = MlflowClient(uri).get_run(run_id).data.tags
    assert (tags[record.CLUSTER_TAG], tags[record.CLUSTERS_TAG]) == ("a", ",a,b,")


def test_runs_that_start_together_on_the_same_dataset_each_record_it(tmp_path, monkeypatch):
    import threading

    # A connection for each of the 16 at once (SQLAlchemy's default pool holds 15): on a busy
    # machine the 16th timed out waiting for one, which is not the race under test.
    monkeypatch.setenv("MLFLOW_SQLALCHEMYSTORE_POOL_SIZE", "16")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    experiment = client.create_experiment("together", artifact_location=str(tmp_path / "artifacts"))
    runs = [client.create_run(experiment).info.run_id for _ in range(16)]
    # Three rounds, a new dataset each: all 16 runs log it at the same instant, as a sweep's
    # trials do; MLflow's check-then-insert let some of them fail on its unique key.
    for round_ in range(3):
        start, errors = threading.Barrier(len(runs)), []

        def log(run_id):
            start.wait()
            try:
                mlflow_client.Client(uri).log_datasets(
                    run_id, [(f"s3://b/data-{round_}", f"{round_:02d}" * 32, round_)]
                )
            except Exception as e:  # noqa: BLE001 - the test reports every one
                errors.append(repr(e)[:200])

        threads = [threading.Thread(target=log, args=(run_id,)) for run_id in runs]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert errors == []
    for run_id in runs:
        assert sorted((i.dataset.name, i.dataset.profile) for i in client.get_run(run_id).inputs.dataset_inputs) == [
            (f"s3://b/data-{r}", f'{{"bad_records": {r}}}') for r in range(3)
        ]


def test_each_window_of_a_report_is_logged_at_its_own_step_and_time(store, tmp_path):
    client, run_id = store
    recorder = MlflowRecorder(
        client.tracking_uri, run_id, str(tmp_path / "hangs"), StorageConfig(), tmp_path / "tracking"
    )
    callback = ControllerEvents([recorder])
    # Three log steps that waited for one report, as the loop sends them while the
    # controller's previous report was still queued, and a save's figures at the report's step.
    windows = [
        {
            "step": step,
            "at": 1_700_000_000.0 + step,
            "loss": 5.0 - step,
            "step_time_s": 0.5,
            "world_size": 2,
            "time/report_wait_s": 0.0,
        }
        for step in (1, 2, 3)
    ]
    callback.after_report(
        None, [WorkerReport(3, 192, 2, windows=tuple(windows), checkpoint={"checkpoint/bytes": 1024.0}).to_dict()]
    )
    callback.after_controller_finish(None)
    history = client.get_metric_history(run_id, "loss")
    assert [(m.step, m.value, m.timestamp) for m in history] == [
        (1, 4.0, 1_700_000_001_000),
        (2, 3.0, 1_700_000_002_000),
        (3, 2.0, 1_700_000_003_000),
    ]
    assert [m.step for m in client.get_metric_history(run_id, mlflow_key("checkpoint/bytes"))] == [3]


def test_the_experiment_wildtrain_creates_opens_in_the_mlflow_uis_model_training_view(tmp_path, monkeypatch):
    from wildtrain.config import load_config

    monkeypatch.chdir(tmp_path)  # MLflow's default artifact root of a new experiment: ./mlruns
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = load_config(["experiment=tiny", f"tracking.uri={uri}", "tracking.experiment=new"])
    experiment_id, run_id = open_mlflow_run(cfg, None)
    # What MLflow 3's UI reads and its kind switch writes: not the GenAI view of traces.
    assert MlflowClient(uri).get_experiment(experiment_id).tags["mlflow.experimentKind"] == "custom_model_development"
    # MLflow 3.17 follows its own switch, not the tag: the address wildtrain prints asks.
    url = mlflow_client.run_url("http://127.0.0.1:5000/", experiment_id, run_id)
    assert url == f"http://127.0.0.1:5000/#/experiments/{experiment_id}/runs/{run_id}?workflowType=machine_learning"


def test_the_model_metrics_tab_opens_on_the_training_curves_and_how_the_run_runs_is_under_system(store, tmp_path):
    client, run_id = store
    recorder = MlflowRecorder(
        client.tracking_uri, run_id, str(tmp_path / "hangs"), StorageConfig(), tmp_path / "tracking"
    )
    callback = ControllerEvents([recorder])
    window = {
        "step": 4,
        "at": 1_700_000_000.0,
        "loss": 3.0,
        "lr": 1e-3,
        "tokens_seen": 512.0,
        "tokens_per_s": 900.0,
        "step_time_s": 0.5,
        "world_size": 2,
        "epoch": 0,
        "mfu": 0.3,
        "time/forward_s": 0.2,
        "time/data_wait_s": 0.01,
        "memory/peak_gb": 1.5,
        "val/loss": 3.2,
    }
    report = replace(
        first_report(4, 2, restored_step=0, started_at=1.0, first_step_at=2.0),
        windows=(window,),
        checkpoint={"checkpoint/bytes": 1024.0, "checkpoint/save_s": 0.3},
    )
    callback.after_report(None, [report.to_dict()])
    recorder.record_event(StoppedEarly(time.time(), 4, "loss stopped falling"))
    callback.after_controller_finish(None)
    keys = set(client.get_run(run_id).data.metrics)
    # The MLflow UI's Model metrics tab lists a section per key prefix above the keys with
    # none, and shows `system/...` keys on its System metrics tab instead: on the first tab,
    # only validation (whose section is first) and the training curves beside the step.
    on_model_tab = {key for key in keys if not key.startswith("system/")}
    assert on_model_tab == {"val/loss", "loss", "lr", "mfu", "tokens_per_s", "step", "tokens_seen", "world_size"}
    assert {
        "system/time/forward_s",
        "system/memory/peak_gb",
        "system/checkpoint/bytes",
        "system/step_time_s",
        "system/startup/attempt_started_at",
        "system/elastic/stopped_early",
        "system/epoch",
    } <= keys


def test_a_failed_group_is_one_failure_with_what_it_carries_however_long_the_controller_waits_with_it(store, tmp_path):
    from ray.train.v2._internal.execution.controller import state as ray_states
    from ray.train.v2._internal.execution.worker_group.poll import WorkerGroupPollStatus, WorkerStatus

    from wildtrain.elastic.signals import UnhealthyNodes
    from wildtrain.events import Failure, HealthCheck, NodeExcluded

    client, run_id = store
    recorder = MlflowRecorder(
        client.tracking_uri, run_id, str(tmp_path / "hangs"), StorageConfig(), tmp_path / "tracking"
    )
    callback = ControllerEvents([recorder])
    check = HealthCheck(1.0, "matmul", 1, "slow", False, "0.2x")
    statuses = {
        0: WorkerStatus(False, UnhealthyNodes(["slow"], [check])),
        1: WorkerStatus(False, UnhealthyNodes(["slow"], [])),
    }
    restarting = ray_states.RestartingState(WorkerGroupPollStatus(statuses).get_worker_group_error())
    callback.after_controller_state_update(ray_states.RunningState(), restarting)
    for _ in range(3):  # no room for a group without the node: the controller's loop turns in the same state
        callback.after_controller_state_update(restarting, restarting)
    callback.after_controller_finish(None)
    events = read_events(client.tracking_uri, run_id, str(tmp_path / "events"))
    assert [type(e) for e in events] == [Failure, HealthCheck, NodeExcluded]
    assert "slow" in events[0].cause and events[2].node == "slow"
