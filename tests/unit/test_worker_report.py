"""A worker's report to the controller: the dict Ray Train carries reads back as the report
the loop made, and a key either side does not know fails, naming it."""

import pytest

from wildtrain.checkpoint.save_policy import SaveOutcome
from wildtrain.events import CheckpointFailed, HealthCheck, StoppedEarly
from wildtrain.train.checkpointing import saves_report
from wildtrain.worker_report import Startup, WorkerReport, rank_zero

STARTUP = Startup(
    restored_step=8,
    restore_s=3.0,
    reshard_s=2.0,
    engine_build_s=1.5,
    worker_started_at=1040.0,
    attempt_started_at=1045.0,
    health_checked_at=1046.0,
    restored_at=1051.5,
    first_step_at=1052.0,
)
WINDOWS = (
    {"step": 9, "at": 1052.0, "loss": 3.5, "step_time_s": 0.5, "val/loss": 3.6},
    {"step": 10, "at": 1052.5, "loss": 3.4, "step_time_s": 0.5},
)


def full_report() -> WorkerReport:
    return WorkerReport(
        step=10,
        tokens_seen=640,
        world_size=2,
        windows=WINDOWS,
        events=(
            HealthCheck(1046.0, "matmul", 0, "node-a", passed=True, detail=""),
            StoppedEarly(1052.5, 10, "loss diverged"),
        ),
        checkpoint={"checkpoint/saved": 1.0, "checkpoint/bytes": 4096.0},
        committed_checkpoints=("s3://ckpt/run/step_10",),
        startup=STARTUP,
    )


def test_a_report_reads_back_from_the_dict_ray_train_carries():
    report = full_report()
    assert WorkerReport.from_dict(report.to_dict()) == report
    plain = WorkerReport(step=3, tokens_seen=192, world_size=1)
    assert WorkerReport.from_dict(plain.to_dict()) == plain
    assert rank_zero([report.to_dict(), plain.to_dict()]) == report


def test_the_dict_keeps_the_flat_keys_the_controller_has_always_read():
    assert set(full_report().to_dict()) == {
        "step",
        "tokens_seen",
        "world_size",
        "windows",
        "events",
        "checkpoint/saved",
        "checkpoint/bytes",
        "committed_checkpoints",
        "restored_step",
        "restore_s",
        "reshard_s",
        "engine_build_s",
        "worker_started_at",
        "attempt_started_at",
        "health_checked_at",
        "restored_at",
        "first_step_at",
    }
    # Start-up times only in an attempt's first report.
    assert "restored_step" not in WorkerReport(step=3, tokens_seen=192, world_size=1).to_dict()


@pytest.mark.parametrize("key", ["step", "tokens_seen", "world_size", "windows", "events", "committed_checkpoints"])
def test_a_missing_key_fails_naming_it(key):
    metrics = full_report().to_dict()
    del metrics[key]
    with pytest.raises(ValueError, match=f"no '{key}'"):
        WorkerReport.from_dict(metrics)


def test_an_unknown_key_fails_naming_it():
    with pytest.raises(ValueError, match="unknown key 'tokens'"):
        WorkerReport.from_dict(full_report().to_dict() | {"tokens": 640})


def test_start_up_times_come_all_together():
    metrics = full_report().to_dict()
    del metrics["restored_at"]
    with pytest.raises(ValueError, match="start-up times without 'restored_at'"):
        WorkerReport.from_dict(metrics)


def test_a_window_without_its_step_or_time_fails_naming_it():
    with pytest.raises(ValueError, match=r"windows\[1\] has no 'at'"):
        WorkerReport(step=2, tokens_seen=128, world_size=1, windows=({"step": 1, "at": 1.0}, {"step": 2}))
    with pytest.raises(ValueError, match="'events' holds"):
        WorkerReport.from_dict(full_report().to_dict() | {"events": [{"event": "health"}]})
    with pytest.raises(ValueError, match="'loss' is not named checkpoint/"):
        WorkerReport(step=2, tokens_seen=128, world_size=1, checkpoint={"loss": 1.0})


def test_the_saves_that_ended_ride_in_the_report():
    saves = saves_report(
        [
            SaveOutcome(step=8, name="step_8", status="failed", reason="upload failed", failure="store"),
            SaveOutcome(
                step=10,
                name="step_10",
                status="saved",
                stall_s=0.2,
                background_s=2.0,
                bytes=4_000_000,
                stored=("s3://a/run", "file:///b/run"),
            ),
        ]
    )
    report = WorkerReport(
        step=10,
        tokens_seen=640,
        world_size=2,
        events=tuple(saves.events),
        checkpoint=saves.metrics,
        committed_checkpoints=tuple(saves.committed),
    )
    back = WorkerReport.from_dict(report.to_dict())
    assert back.committed_checkpoints == ("s3://a/run/step_10", "file:///b/run/step_10")
    assert [(type(e), e.step) for e in back.events] == [(CheckpointFailed, 8)]
    assert (back.checkpoint["checkpoint/saved"], back.checkpoint["checkpoint/failed"]) == (1.0, 1.0)
    assert back.checkpoint["checkpoint/step"] == 10.0
