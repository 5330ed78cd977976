"""A real run: two DeepSpeed workers under Ray Train, reading the tiny corpus from a real
SeaweedFS store, tracked on a real MLflow server, checkpointed through Ray Train."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from wildtrain import driver, storage
from wildtrain.checkpoint import STATE_FILE, universal
from wildtrain.elastic import CapacityError
from wildtrain.tracking.mlflow_run import read_events

pytestmark = pytest.mark.integration


def test_two_worker_run_trains_tracks_and_checkpoints_into_the_object_store(ray_cluster, object_store, tiny_config,
                                                                            mlflow_url, tmp_path):
    runs = f"s3://{object_store.bucket}/runs-{tmp_path.name}"
    cfg = tiny_config(f"run.storage={runs}")
    summary = driver.run(cfg)

    client = MlflowClient(mlflow_url)
    run = client.get_run(summary.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["train.global_batch_size"] == "16"
    assert run.data.params["model.name"] == "tiny"
    history = sorted(client.get_metric_history(summary.run_id, "loss"), key=lambda m: m.step)
    assert [m.step for m in history] == [1, 2, 4, 6, 8]  # the first step, then every 2nd
    losses = [m.value for m in history]
    assert losses[-1] < losses[0] - 0.5, losses
    assert {m.value for m in client.get_metric_history(summary.run_id, "world_size")} == {2.0}
    tokens = client.get_metric_history(summary.run_id, "tokens_seen")
    assert max(m.value for m in tokens) == 8 * cfg.train.global_batch_size * cfg.data.seq_len
    # Saves of steps 4 and 8 commit in the background; each is reported once it has.
    assert sum(m.value for m in client.get_metric_history(summary.run_id, "checkpoint/saved")) == 2
    assert max(m.value for m in client.get_metric_history(summary.run_id, "checkpoint/step")) == 8
    assert "config.yaml" in [a.path for a in client.list_artifacts(summary.run_id)]

    # Where the time went: the step split, MFU against the measured CPU peak, goodput and its plot.
    metrics = client.get_run(summary.run_id).data.metrics  # newest values
    for phase in ("data_wait", "forward", "backward", "optimizer", "checkpoint_stall"):
        assert f"time/{phase}_s" in metrics, phase
    assert 0 < metrics["time/forward_s"] + metrics["time/backward_s"] < metrics["step_time_s"]
    assert 0 < metrics["mfu"] < 1
    assert 0 < metrics["goodput"] <= 1
    plots = {a.path: a.file_size for a in client.list_artifacts(summary.run_id, "report")}
    assert plots.get("report/run.png", 0) > 1000

    fs, checkpoint = storage.filesystem(summary.checkpoint)
    assert summary.checkpoint.startswith(f"{runs}/{cfg.run.name}/checkpoints/step_000000008-")
    with fs.open_input_stream(f"{checkpoint}/manifest.json") as f:
        manifest = json.loads(f.read())
    assert (manifest["step"], manifest["world_size"], manifest["zero_stage"]) == (8, 2, 1)
    listed = {entry["path"] for entry in manifest["files"]}
    # Both ranks' ZeRO partitions, each listed with its size and sha256.
    assert {"step_8/zero_pp_rank_0_mp_rank_00_optim_states.pt", "step_8/zero_pp_rank_1_mp_rank_00_optim_states.pt",
            STATE_FILE, "latest"} <= listed
    with fs.open_input_stream(f"{checkpoint}/{STATE_FILE}") as f:
        assert json.loads(f.read())["step"] == 8


def test_resubmitted_run_continues_its_checkpoint_and_mlflow_run(ray_cluster, tiny_config, mlflow_url):
    first = driver.run(tiny_config("train.steps=4"))
    second = driver.run(tiny_config("train.steps=8"))
    assert second.run_id == first.run_id

    client = MlflowClient(mlflow_url)
    steps = [m.step for m in client.get_metric_history(first.run_id, "loss")]
    # Each submission logs its first step, then every 2nd: the second resumed after step 4.
    assert sorted(steps) == [1, 2, 4, 5, 6, 8]
    assert client.get_run(first.run_id).info.status == "FINISHED"


def test_min_workers_the_cluster_cannot_hold_fails_fast(ray_cluster, tiny_config):
    cfg = tiny_config("elastic.min_workers=8", "elastic.max_workers=8", "cluster.capacity_wait_s=2")
    with pytest.raises(CapacityError, match=r"^elastic.min_workers: 8 workers need 9 CPU .* offered only 3 CPU for 2 s"):
        driver.run(cfg)


def test_reshard_ahead_converts_committed_checkpoints_in_the_background(ray_cluster, tiny_config):
    summary = driver.run(tiny_config("cluster.reshard_ahead=true"))
    store = Path(summary.checkpoint).parent
    # The controller lets a conversion in flight finish before it shuts down.
    converted = sorted(store.glob(f"step_*/step_*_universal/{universal.MARKER}"))
    assert converted, "a committed checkpoint was converted to the universal format"
    for marker in converted:
        original = marker.parent.parent / marker.parent.name.removesuffix("_universal")
        assert original.is_dir(), "the original checkpoint is kept beside its conversion"


def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous_one(ray_cluster, tiny_config, mlflow_url, tmp_path):
    first = driver.run(tiny_config("train.steps=8"))
    newest = Path(first.checkpoint)
    assert newest.name.startswith("step_000000008-")
    damaged = newest / "step_8" / "mp_rank_00_model_states.pt"
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, different bytes: only the checksum can tell
    damaged.write_bytes(bytes(data))

    second = driver.run(tiny_config("train.steps=10"))
    assert second.run_id == first.run_id
    events = read_events(mlflow_url, first.run_id, str(tmp_path / "events"))
    (fallback,) = [e for e in events if e["event"] == "checkpoint_fallback"]
    assert fallback["step"] == 8 and "sha256" in fallback["reason"]
    # The resubmission restored step 4 (each attempt logs its first step: here 5) and went on to 10.
    steps = [m.step for m in MlflowClient(mlflow_url).get_metric_history(first.run_id, "loss")]
    assert 5 in steps and 9 not in steps and max(steps) == 10
