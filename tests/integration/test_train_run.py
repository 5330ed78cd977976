"""A real run: two DeepSpeed workers under Ray Train, reading the tiny corpus from a real
SeaweedFS store, tracked on a real MLflow server, checkpointed through Ray Train; sent as a
job with `ray job submit`, and resubmitted from its checkpoints."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from ray.job_submission import JobStatus, JobSubmissionClient

from tests.conftest import REPO
from tests.helpers.pacing import Pace
from tests.helpers.waiting import wait_for
from wildtrain import driver, services, storage
from wildtrain.checkpoint import STATE_FILE, reshard
from wildtrain.checkpoint.restore import list_candidates, newest_committed
from wildtrain.config import load_config
from wildtrain.data.dataset import DataError
from wildtrain.elastic.signals import CapacityError
from wildtrain.events import CheckpointFallback
from wildtrain.layout import RunLayout, checkpoint_stores
from wildtrain.tracking.record import mlflow_key, read_events

pytestmark = pytest.mark.integration


def test_a_two_worker_run_sent_with_ray_job_submit_trains_tracks_and_checkpoints_into_the_object_store(
    ray_cluster, object_store, tiny_overrides, mlflow_url, tmp_path
):
    """The cluster path, as the README shows it; with checkpoint.reshard_ahead, whose universal
    copy a one-worker run of the same run then restores through (a run's start costs more
    than either promise's checks)."""
    runs = f"s3://{object_store.bucket}/runs-{tmp_path.name}"
    overrides = [*tiny_overrides, f"run.storage={runs}", "eval.every=4", "checkpoint.reshard_ahead=true"]
    cfg = load_config(overrides)
    dashboard = f"http://{ray_cluster.webui_url}"
    submission_id = f"wildtrain-test-{uuid.uuid4().hex[:8]}"
    done = subprocess.run(
        [
            "ray",
            "job",
            "submit",
            "--address",
            dashboard,
            "--working-dir",
            str(REPO),
            "--submission-id",
            submission_id,
            "--",
            "python",
            "-m",
            "wildtrain",
            "train",
            *overrides,
        ],
        capture_output=True,
        text=True,
        timeout=480,
    )
    # The submit's own output first: where the submission itself failed ("No available agent
    # to submit job"), there is no job whose status could say why.
    output = done.stdout[-3000:] + done.stderr[-3000:]
    assert done.returncode == 0, output
    assert JobSubmissionClient(dashboard).get_job_status(submission_id) == JobStatus.SUCCEEDED, output
    assert "step 8/8" in done.stdout and "finished" in done.stdout
    # The run's first lines and its summary name the command that prints the dashboard's
    # token (Ray's token authentication), never the token.
    dashboard_lines = [line for line in done.stdout.splitlines() if "Ray dashboard:" in line]
    assert len(dashboard_lines) == 2 and all("ray get-auth-token" in line for line in dashboard_lines), dashboard_lines
    token = subprocess.run([services.ray_cli(), "get-auth-token"], capture_output=True, text=True, check=True).stdout
    assert token and token not in done.stdout + done.stderr

    client = MlflowClient(mlflow_url)
    [run] = client.search_runs(
        [client.get_experiment_by_name(cfg.tracking.experiment).experiment_id],
        f"attributes.run_name = '{cfg.run.name}'",
    )
    run_id = run.info.run_id
    assert run.info.status == "FINISHED"
    assert run.data.params["train.global_batch_size"] == "16"
    assert run.data.params["model.name"] == "tiny"
    history = sorted(client.get_metric_history(run_id, "loss"), key=lambda m: m.step)
    assert [m.step for m in history] == [1, 2, 4, 6, 8]  # the first step, then every 2nd
    losses = [m.value for m in history]
    assert losses[-1] < losses[0] - 0.5, losses
    assert {m.value for m in client.get_metric_history(run_id, "world_size")} == {2.0}
    tokens = client.get_metric_history(run_id, "tokens_seen")
    assert max(m.value for m in tokens) == 8 * cfg.train.global_batch_size * cfg.data.seq_len
    # Saves of steps 4 and 8 commit in the background; each is reported once it has.
    assert sum(m.value for m in client.get_metric_history(run_id, mlflow_key("checkpoint/saved"))) == 2
    assert max(m.value for m in client.get_metric_history(run_id, mlflow_key("checkpoint/step"))) == 8
    assert "config.yaml" in [a.path for a in client.list_artifacts(run_id)]

    # Where the time went: the step split, MFU against the measured CPU peak, goodput and its plot.
    metrics = client.get_run(run_id).data.metrics  # newest values
    for phase in ("data_wait", "forward", "backward", "optimizer", "checkpoint_stall"):
        assert mlflow_key(f"time/{phase}_s") in metrics, phase
    forward, backward, step = (
        metrics[mlflow_key(name)] for name in ("time/forward_s", "time/backward_s", "step_time_s")
    )
    assert 0 < forward + backward < step
    assert 0 < metrics["mfu"] < 1
    tags = client.get_run(run_id).data.tags
    assert 0 < float(tags["goodput"]) <= 1
    # Validation on the documents the dataset holds out, at every 4th step and the last, each
    # number a ratio of sums over both ranks' shares; its time is badput of its own.
    validated = client.get_metric_history(run_id, "val/loss")
    assert [m.step for m in validated] == [4, 8]
    assert validated[-1].value < validated[0].value
    assert metrics["val/tiny/loss"] == metrics["val/loss"] and 0 < metrics["val/bpb"] < metrics["val/loss"] * 2
    assert mlflow_key("time/eval_s") in metrics and "badput/eval_s" in tags
    plots = {a.path: a.file_size for a in client.list_artifacts(run_id, "report")}
    assert plots.get("report/run.png", 0) > 1000

    newest = storage.join(*newest_committed(checkpoint_stores(RunLayout.of(cfg.run, cfg.checkpoint), cfg.storage)).key)
    fs, checkpoint = storage.filesystem(newest)
    assert newest.startswith(f"{runs}/{cfg.run.name}/checkpoints/step_000000008-")
    with fs.open_input_stream(f"{checkpoint}/manifest.json") as f:
        manifest = json.loads(f.read())
    assert (manifest["step"], manifest["world_size"], manifest["zero_stage"]) == (8, 2, 1)
    listed = {entry["path"] for entry in manifest["files"]}
    # Both ranks' ZeRO partitions, each listed with its size and sha256.
    assert {
        "step_8/zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "step_8/zero_pp_rank_1_mp_rank_00_optim_states.pt",
        STATE_FILE,
        "latest",
    } <= listed
    with fs.open_input_stream(f"{checkpoint}/{STATE_FILE}") as f:
        assert json.loads(f.read())["step"] == 8

    # The controller converted a committed checkpoint in the background and committed the copy.
    [store] = checkpoint_stores(RunLayout.of(cfg.run, cfg.checkpoint), cfg.storage)
    copies = [c for c in (reshard.find_universal(store, n) for n in committed_names(store)) if c]
    assert copies, "no universal copy committed beside a checkpoint"
    _, copy = copies[0]
    assert copy.tag.endswith("_universal") and copy.world_size == 2
    paths = {f.path for f in copy.files}
    assert STATE_FILE in paths and f"{copy.tag}/zero/optimizer_state.pt" in paths
    assert not any("zero_pp_rank_" in p for p in paths), "the copy holds no per-rank partition"
    # At one worker the run restores its newest checkpoint through a universal copy.
    resumed = driver.run(load_config([*overrides, "elastic.min_workers=1", "elastic.max_workers=1", "train.steps=10"]))
    assert reshard.find_universal(store, newest.rsplit("/", 1)[-1]) is not None
    steps = [m.step for m in client.get_metric_history(resumed.run_id, "loss")]
    assert 9 in steps and 10 in steps and max(steps) == 10
    assert {m.value for m in client.get_metric_history(resumed.run_id, "world_size")} == {1.0, 2.0}


def test_a_second_driver_is_refused_while_a_run_trains_and_the_resubmitted_run_falls_back_past_a_corrupt_checkpoint(
    ray_cluster, tiny_overrides, mlflow_url, tmp_path
):
    """One run's life: started as a user does on the head (`wildtrain train`: no job of
    `wildtrain submit` to find), a second driver of it refused in one line naming the first;
    then resubmitted, from the newest checkpoint that verifies, in the same MLflow run."""
    # One worker: neither promise depends on the world size, and a worker's start is most of a
    # tiny run's CPU time. Half a second a step: it still trains while the second driver starts.
    # Checkpoints every 4 steps; the run logs its first step, then every 2nd.
    overrides = [*tiny_overrides, "elastic.max_workers=1"]
    pace = Pace(min_step_s=0.5)
    first_run = [*overrides, "train.steps=16"]
    train = [sys.executable, "-m", "wildtrain", "train", *first_run]
    cfg = load_config(first_run)
    log = tmp_path / "first.log"
    with log.open("w") as out:
        first = subprocess.Popen(train, stdout=out, stderr=subprocess.STDOUT, env=os.environ | pace.env())
    try:
        # Printed once the run is the first's: its lease taken, its MLflow run opened.
        wait_for(lambda: "MLflow run:" in log.read_text(), "first driver's MLflow run line", timeout_s=120, every_s=0.1)
        second = subprocess.run(train, capture_output=True, text=True, timeout=120, env=os.environ | pace.env())
        assert first.poll() is None, "the first driver must still train while the second is refused"
        first.wait(timeout=480)
    finally:
        if first.poll() is None:
            first.kill()
    output = log.read_text()
    assert second.returncode == 1, second.stdout + second.stderr
    [line] = [text for text in second.stderr.splitlines() if text.startswith("wildtrain:")]
    assert re.fullmatch(
        rf"wildtrain: run '{cfg.run.name}' is live: pid {first.pid} on {socket.gethostname()} "
        r"\(cluster local\) holds its lease until \d\d:\d\d:\d\d UTC .*",
        line,
    ), second.stderr
    assert "Traceback" not in second.stderr
    assert first.returncode == 0 and "step 16/16" in output, output[-3000:]
    held = json.loads((Path(RunLayout.of(cfg.run, cfg.checkpoint).root) / "lease.json").read_text())
    assert held["holder"]["pid"] == first.pid and held["released_at"] is not None  # its end released it

    client = MlflowClient(mlflow_url)
    [run] = client.search_runs(
        [client.get_experiment_by_name(cfg.tracking.experiment).experiment_id],
        f"attributes.run_name = '{cfg.run.name}'",
    )
    assert run.info.status == "FINISHED"
    # Another seed would resume step 16 in another data order: refused before Ray starts.
    with pytest.raises(DataError, match=r"train\.seed: 0 -> 1.*data\.allow_order_change=true"):
        driver.run(load_config([*overrides, "train.steps=20", "train.seed=1"]), step_hook=pace.spec())

    # The newest checkpoint damaged where only its checksum can tell: same size, other bytes.
    newest = Path(
        storage.join(*newest_committed(checkpoint_stores(RunLayout.of(cfg.run, cfg.checkpoint), cfg.storage)).key)
    )
    assert newest.name.startswith("step_000000016-")
    # The one before it the fallback must land on: step 12 unless a loaded machine skipped
    # periodic saves while an earlier one was still being written (the last step's never is).
    earlier = max(
        c.step
        for c in list_candidates(checkpoint_stores(RunLayout.of(cfg.run, cfg.checkpoint), cfg.storage))
        if c.manifest is not None and c.step < 16
    )
    damaged = newest / "step_16" / "mp_rank_00_model_states.pt"
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    resubmitted = driver.run(load_config([*overrides, "train.steps=18"]), step_hook=pace.spec())
    assert resubmitted.run_id == run.info.run_id
    assert client.get_run(run.info.run_id).info.status == "FINISHED"
    events = read_events(mlflow_url, run.info.run_id, str(tmp_path / "events"))
    (fallback,) = [e for e in events if isinstance(e, CheckpointFallback)]
    assert fallback.step == 16 and "sha256" in fallback.reason
    # It continued that earlier checkpoint in the same MLflow run: 1, 2, 4, ..., 16 from the
    # first submission, then its first step and every 2nd to 18 (from step 12: 13, 14, 16, 18,
    # with 14 and 16 trained again).
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "loss")]
    resumed = [earlier + 1, *range(earlier + 2, 19, 2)]
    assert sorted(steps) == sorted([1, *range(2, 17, 2), *resumed])

    # Submitted once more, finished: reported as it stands, no worker started, nothing logged.
    again = driver.run(load_config([*overrides, "train.steps=18"]), step_hook=pace.spec())
    assert again.run_id == run.info.run_id and again.final_metrics["step"] == 18
    assert again.checkpoint.endswith(
        newest_committed(checkpoint_stores(RunLayout.of(cfg.run, cfg.checkpoint), cfg.storage)).name
    )
    assert read_events(mlflow_url, run.info.run_id, str(tmp_path / "events-again")) == events
    assert len(client.get_metric_history(run.info.run_id, "loss")) == len(steps)


def test_min_workers_the_cluster_cannot_hold_fails_fast(ray_cluster, tiny_config):
    cfg = tiny_config("elastic.min_workers=8", "elastic.max_workers=8", "elastic.capacity_wait_s=2")
    with pytest.raises(
        CapacityError, match=r"^elastic.min_workers: 8 workers need 9 CPU .* offered only 3 CPU for 2 s"
    ):
        driver.run(cfg)


def committed_names(store) -> list[str]:
    return [c.name for c in list_candidates([store]) if c.manifest is not None]
