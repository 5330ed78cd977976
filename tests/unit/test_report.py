import json
from pathlib import Path

import pytest

from tests.helpers.reports import first_report, report
from wildtrain.events import Event, Failure, HealthCheck, Moved
from wildtrain.tracking.controller.timeline import Timeline
from wildtrain.tracking.reports.goodput import (
    BADPUT_CAUSES,
    AttemptStarted,
    Goodput,
    GroupStopped,
    RunStarted,
    RunStopped,
    Steps,
    account,
)
from wildtrain.tracking.reports.runs import (
    CHECKPOINT_BYTES,
    CHECKPOINT_SAVE_S,
    DATA_WAIT,
    MFU,
    NODES,
    STEP_TIME,
    WORLD_SIZE,
    RunRecord,
    RunStats,
    Sample,
    card_text,
    cluster_card,
    fetch_cluster,
    fetch_run,
    goodput_events,
    parts_on,
    plot_run,
    report_run,
    summarize,
    summary_figure,
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def recorded_events() -> list[Event]:
    """What the controller's timeline records for: a failure at 1035 after step 10 at
    world size 2; the next group started at 1045 from step 8's checkpoint."""
    timeline = Timeline()
    timeline.group_started(["a", "b"])
    for step in (1, 5, 10):
        timeline.reported(report(step, 2))
    timeline.interrupted(Failure, at=1035.0, cause="node b died")
    timeline.group_started(["a"])
    timeline.reported(
        first_report(9, 1, restored_step=8, started_at=1045.0, first_step_at=1052.0, restore_s=3.0, reshard_s=2.0)
    )
    health = [
        HealthCheck(1001.0, "gpu-burn", 0, "a", passed=True, detail=""),
        HealthCheck(1001.0, "nccl-allreduce", -1, "b", passed=False, detail="12 GB/s"),
    ]
    return timeline.events + health


def record() -> RunRecord:
    # (logged at, step, step_time_s) of each report with a window; steps 9 and 10 redone.
    reports = [(1012.0, 1, 2.0), (1020.0, 5, 2.0), (1030.0, 10, 2.0), (1053.0, 9, 1.0), (1055.0, 10, 1.0)]
    history = {
        STEP_TIME: tuple(Sample(at, step, value) for at, step, value in reports),
        "loss": tuple(Sample(at, step, 5.0 - 0.1 * step) for at, step, _ in reports),
        MFU: tuple(Sample(at, step, 0.3 + 0.01 * i) for i, (at, step, _) in enumerate(reports)),
        DATA_WAIT: (Sample(1020.0, 5, 0.5),),
        WORLD_SIZE: tuple(Sample(at, step, 2.0 if at < 1035.0 else 1.0) for at, step, _ in reports),
        NODES: (Sample(1010.0, 0, 2.0), Sample(1035.0, 10, 0.0), Sample(1050.0, 8, 1.0), Sample(1060.0, 10, 0.0)),
        CHECKPOINT_BYTES: (Sample(1025.0, 8, 1.5e9), Sample(1055.0, 10, 1.5e9)),
        CHECKPOINT_SAVE_S: (Sample(1025.0, 8, 4.0), Sample(1055.0, 10, 6.0)),
    }
    return RunRecord(
        "r1",
        "demo",
        started_at=1000.0,
        ended_at=1060.0,
        history=history,
        events=tuple(recorded_events()),
        cluster="lambda-h100",
    )


def test_goodput_events_from_the_timeline_and_the_reports():
    events = goodput_events(record())
    assert [e for e in events if not isinstance(e, Steps)] == [
        RunStarted(1000.0),
        RunStopped(1060.0),
        GroupStopped(1035.0, "failure"),
        AttemptStarted(1045.0, restored_step=8, restore_s=3.0, reshard_s=2.0),
    ]
    # a window per report, from the previous report of the same attempt; an attempt's
    # first report is its first step alone
    assert [e for e in events if isinstance(e, Steps)] == [
        Steps(1, 1, 1010.0, 1012.0, world_size=2),
        Steps(2, 5, 1012.0, 1020.0, data_wait_s=2.0, world_size=2),
        Steps(6, 10, 1020.0, 1030.0, world_size=2),
        Steps(9, 9, 1052.0, 1053.0, world_size=1),
        Steps(10, 10, 1053.0, 1055.0, world_size=1),
    ]


def test_a_run_summary():
    stats = summarize(record(), now=1060.0)
    # steps 9, 10 of [1020, 1030) redone: 4 s lost, and 5 s until the failure was noticed
    assert stats.goodput == Goodput(
        60.0,
        2.0 + 6.0 + 6.0 + 3.0,
        {
            "startup": 10.0 + 10.0 + 2.0 + 5.0,
            "waiting": 0.0,
            "restore": 5.0,
            "lost": 4.0 + 5.0,
            "checkpoint_stall": 0.0,
            "data_wait": 2.0,
            "report_wait": 0.0,
            "eval": 0.0,
            "stalled": 0.0,
            "stopped": 0.0,
            "unreported": 0.0,
        },
    )
    assert stats.mfu == pytest.approx(0.32)
    assert stats.failures == 1 and stats.recoveries_s == (1052.0 - 1035.0,)
    assert stats.node_s == 2 * 25.0 + 1 * 10.0
    assert (stats.checkpoint_bytes, stats.checkpoint_save_s) == (3e9, 10.0)
    assert stats.health_passed == 1 and stats.health_failed == ("b: nccl-allreduce (12 GB/s)",)


def test_a_moved_run_counts_on_each_cluster_for_the_part_it_trained_there():
    # Moved to cluster b at 1050, during the recovery from the failure at 1035.
    run = record()
    run = RunRecord(
        run.run_id,
        run.name,
        run.started_at,
        run.ended_at,
        run.history,
        run.events + (Moved(1050.0, "lambda-h100", "b", 8, 10 << 20),),
        cluster="b",
    )
    (before,), (after,) = parts_on(run, "lambda-h100"), parts_on(run, "b")
    assert parts_on(run, "elsewhere") == []
    assert (before.name, before.started_at, before.ended_at) == ("demo (part 1 of 2)", 1000.0, 1050.0)
    assert (after.name, after.started_at, after.ended_at) == ("demo (part 2 of 2)", 1050.0, 1060.0)
    # Every report and event in exactly one part.
    for key, samples in run.history.items():
        assert before.history[key] + after.history[key] == samples, key
    assert sorted(map(repr, before.events + after.events)) == sorted(map(repr, run.events))
    a, b = summarize(before, before.ended_at), summarize(after, after.ended_at)
    assert a.goodput.wall_s + b.goodput.wall_s == 60.0
    assert (a.failures, b.failures) == (1, 0)
    assert [s.step for s in after.history[STEP_TIME]] == [9, 10], "the steps b trained"
    # A run that never moved is on its own cluster's card whole.
    assert parts_on(record(), "lambda-h100") == [record()] and parts_on(record(), "b") == []


def test_plot_is_a_png(tmp_path):
    r = record()
    path = tmp_path / "run.png"
    plot_run(r.history, goodput_events(r) + [GroupStopped(1058.0, "resize")], path, now=1060.0)
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 10_000


def stats(name, wall, productive, mfu, failures, recoveries, node_days, ckpt_bytes, ckpt_s, passed, failed):
    badput = dict.fromkeys(BADPUT_CAUSES, 0.0) | {"startup": wall - productive}
    return RunStats(
        name,
        name,
        Goodput(wall, productive, badput),
        mfu,
        failures,
        recoveries,
        None if node_days is None else node_days * 86400,
        ckpt_bytes,
        ckpt_s,
        passed,
        failed,
    )


RUNS = [
    stats("a", 100.0, 80.0, 0.4, 2, (30.0, 50.0), 2.0, 3e9, 10.0, 3, ("n3: nccl-allreduce",)),
    stats("b", 300.0, 120.0, 0.2, 1, (20.0,), None, 1e9, 10.0, 2, ()),
]


def test_cluster_card_numbers():
    a, b, total = cluster_card(RUNS)
    assert (a.label, a.mfu, a.goodput, a.failures_per_node_day, a.mttr_s, a.checkpoint_mb_per_s) == (
        "a",
        0.4,
        0.8,
        1.0,
        40.0,
        300.0,
    )
    assert (a.health_passed, a.health_checks) == (3, 4)
    assert (b.failures_per_node_day, b.mttr_s, b.checkpoint_mb_per_s) == (None, 20.0, 100.0)
    assert total.label == "all runs" and total.runs == 2 and total.failures == 3
    assert total.mfu == pytest.approx((0.4 * 80 + 0.2 * 120) / 200)  # weighted by productive time
    assert total.goodput == 200.0 / 400.0
    assert total.failures_per_node_day == 2 / 2.0  # only runs that recorded their nodes
    assert total.mttr_s == pytest.approx(100.0 / 3)
    assert total.checkpoint_mb_per_s == 4e9 / 20.0 / 1e6
    assert (total.health_passed, total.health_checks) == (5, 6)


def test_cluster_card_text():
    r = summarize(record(), now=1060.0)
    text = card_text("lambda-h100", RUNS + [r])
    lines = text.splitlines()
    assert lines[0] == "cluster lambda-h100: 3 runs"
    assert lines[1].split() == [
        "run",
        "MFU",
        "goodput",
        "failures",
        "fail/node-day",
        "MTTR",
        "s",
        "ckpt",
        "MB/s",
        "health",
        "ok",
    ]
    assert lines[2].split() == ["a", "40.0%", "80.0%", "2", "1.00", "40.0", "300.0", "3/4"]
    assert lines[4].split()[:3] == ["demo", "32.0%", f"{17 / 60:.1%}"]
    mfu = (0.4 * 80 + 0.2 * 120 + 0.32 * 17) / (80 + 120 + 17)
    assert lines[5].split()[:4] == ["all", "runs", f"{mfu:.1%}", f"{(200 + 17) / 460:.1%}"]
    assert f"lost {9 / 460:.1%}" in text
    assert "failed health check in a: n3: nccl-allreduce" in text
    assert "failed health check in demo: b: nccl-allreduce (12 GB/s)" in text


@pytest.fixture
def mlflow_uri(tmp_path):
    """A file-backed store: MLflow's client without a server."""
    return f"sqlite:///{tmp_path}/mlflow.db"


def log_record(uri, tmp_path, r: RunRecord, cluster: str, visited: str = "") -> str:
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("e")
    experiment_id = (
        experiment.experiment_id
        if experiment
        else client.create_experiment("e", artifact_location=(tmp_path / "artifacts").as_uri())
    )
    run_id = client.create_run(
        experiment_id,
        start_time=int(r.started_at * 1000),
        run_name=r.name,
        tags={"wildtrain.cluster": cluster, "wildtrain.clusters": visited or f",{cluster},"},
    ).info.run_id
    client.log_batch(
        run_id,
        metrics=[Metric(key, s.value, int(s.at * 1000), s.step) for key, samples in r.history.items() for s in samples],
    )
    for i, event in enumerate(r.events):
        client.log_text(run_id, json.dumps(event.to_dict()), f"events/{i:03d}-{event.KIND}.json")
    client.set_terminated(run_id, "FINISHED", end_time=int(r.ended_at * 1000))
    return run_id


def test_fetch_and_report_through_mlflow(mlflow_uri, tmp_path):
    from mlflow.tracking import MlflowClient

    r = record()
    run_id = log_record(mlflow_uri, tmp_path, r, "lambda-h100")
    other = log_record(mlflow_uri, tmp_path, r, "local")
    fetched = fetch_run(mlflow_uri, run_id)
    assert (fetched.name, fetched.started_at, fetched.ended_at, fetched.events) == ("demo", 1000.0, 1060.0, r.events)
    assert {key: samples for key, samples in fetched.history.items() if samples} == r.history
    assert [x.run_id for x in fetch_cluster(mlflow_uri, "lambda-h100")] == [run_id]
    assert [x.run_id for x in fetch_cluster(mlflow_uri, "local")] == [other]
    moved = log_record(mlflow_uri, tmp_path, r, "b", visited=",lambda-h100,b,")
    # Both started at the same instant: MLflow's order between them is its own.
    assert sorted(x.run_id for x in fetch_cluster(mlflow_uri, "lambda-h100")) == sorted([run_id, moved])
    assert [x.cluster for x in fetch_cluster(mlflow_uri, "b")] == ["b"]
    assert fetch_cluster(mlflow_uri, "lambda") == [], "a cluster named like a part of another's name"

    result = report_run(mlflow_uri, run_id)
    assert result == account(goodput_events(r), 1060.0)
    client = MlflowClient(mlflow_uri)
    assert [a.path for a in client.list_artifacts(run_id, "report")] == ["report/run.png"]
    downloaded = client.download_artifacts(run_id, "report/run.png", str(tmp_path))
    assert Path(downloaded).read_bytes().startswith(PNG_SIGNATURE)
    logged = client.get_run(run_id).data
    # The run's summary, not one-point charts above its loss in the MLflow UI.
    assert summary_figure(logged.tags, "goodput") == pytest.approx(result.goodput, rel=1e-5)
    assert summary_figure(logged.tags, "badput/lost_s") == 9.0
    assert not [key for key in logged.metrics if key.startswith(("goodput", "badput/"))]
