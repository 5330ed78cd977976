"""Bad ranks on a real run: one made slow is flagged as a straggler; one stopped with SIGSTOP
makes the others' hang watchdogs dump their stacks and fail the attempt, which restarts."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest
from mlflow.tracking import MlflowClient

from wildtrain import driver
from wildtrain.chaos import BackgroundRun
from wildtrain.tracking.mlflow_run import read_events

pytestmark = pytest.mark.integration


def test_a_slow_rank_is_flagged_as_a_straggler(ray_cluster, tiny_config, mlflow_url, tmp_path):
    cfg = tiny_config("train.steps=12", "chaos.slow_rank=1", "chaos.slow_step_s=0.15", "monitor.straggler_every=2",
                      "monitor.straggler_patience=2", "monitor.straggler_factor=1.5")
    summary = driver.run(cfg)
    events = [e for e in read_events(mlflow_url, summary.run_id, str(tmp_path)) if e["event"] == "straggler"]
    assert events, "rank 1 slept in every forward pass"
    assert {e["rank"] for e in events} == {1}
    assert events[0]["factor"] > 1.5 and events[0]["node"]
    # The same drill slows its pre-flight matmul check: it fails, its peer passes.
    checks = [e for e in read_events(mlflow_url, summary.run_id, str(tmp_path / "again")) if e["event"] == "health"]
    matmul = {e["rank"]: e["passed"] for e in checks if e["check"] == "matmul"}
    assert matmul == {0: True, 1: False}
    assert any(e["check"] == "allreduce" for e in checks)


def _train_workers(started_after: float) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter(["cmdline", "create_time"]):
        cmdline = " ".join(process.info["cmdline"] or [])
        if "RayTrainWorker" in cmdline and process.info["create_time"] >= started_after:
            found.append(process)
    return found


def test_a_stopped_rank_is_detected_as_a_hang_and_the_attempt_restarts(ray_cluster, tiny_config, mlflow_url, tmp_path):
    started = time.time() - 1
    cfg = tiny_config("train.steps=30", "train.log_every=1", "train.checkpoint_every=5", "monitor.hang_timeout_s=15")
    run = BackgroundRun(cfg)
    run.wait_until(lambda h: any(m.step >= 6 for m in h), "step 6", 300)
    workers = _train_workers(started)
    assert len(workers) == 2, [w.cmdline() for w in workers]
    os.kill(workers[1].pid, signal.SIGSTOP)  # alive but silent: its peer waits in a collective
    try:
        summary = run.join(600)
    finally:
        if workers[1].is_running():
            os.kill(workers[1].pid, signal.SIGCONT)

    events = read_events(mlflow_url, summary.run_id, str(tmp_path))
    hangs = [e for e in events if e["event"] == "hang"]
    assert hangs and "no optimizer step for" in hangs[0]["reason"]
    dumps = [a.path for a in MlflowClient(mlflow_url).list_artifacts(summary.run_id, "hangs")]
    assert dumps, "the watchdog's stacks are attached to the run"
    text = MlflowClient(mlflow_url).download_artifacts(summary.run_id, dumps[0], str(tmp_path))
    assert "--- thread MainThread ---" in open(text).read()
    assert any(e["event"] == "recovered" for e in events), "the attempt restarted"
    assert summary.final_metrics["step"] == 30
