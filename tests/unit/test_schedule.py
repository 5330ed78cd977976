"""The loop's cadence: which steps report, save, and must commit."""

from wildtrain.config import CheckpointConfig, TrainConfig
from wildtrain.train.schedule import due_at

TRAIN = TrainConfig(steps=40, log_every=5)
EVERY_20 = CheckpointConfig(every=20)


def test_logs_every_log_every_steps_and_saves_every_checkpoint_every_steps():
    logged = [step for step in range(1, 41) if due_at(step, 0, TRAIN, EVERY_20).log]
    saved = [step for step in range(1, 41) if due_at(step, 0, TRAIN, EVERY_20).checkpoint]
    assert logged == [1, 5, 10, 15, 20, 25, 30, 35, 40]
    assert saved == [20, 40]


def test_the_first_step_of_an_attempt_reports_for_the_recovery_timing():
    due = due_at(13, restored_step=12, train=TRAIN, checkpoint=EVERY_20)
    assert due.first_of_attempt and due.log and due.report and not due.checkpoint
    assert not due_at(14, restored_step=12, train=TRAIN, checkpoint=EVERY_20).report


def test_the_last_step_saves_and_must_commit_even_off_the_cadence():
    due = due_at(37, 0, TrainConfig(steps=37, log_every=5), EVERY_20)
    assert due.last and due.checkpoint and due.must_commit and due.report


def test_a_save_without_a_log_still_reports_so_that_it_can_commit():
    due = due_at(20, 0, TrainConfig(steps=40, log_every=7), EVERY_20)
    assert due.checkpoint and not due.log and due.report


def test_a_regrow_saves_and_must_commit_and_calling_it_off_keeps_the_save():
    due = due_at(10, 0, TRAIN, EVERY_20).with_regrow()
    assert due.regrow and due.checkpoint and due.must_commit
    off = due.without_regrow()
    assert not off.regrow and off.checkpoint and not off.must_commit


def test_validation_every_eval_every_steps_and_at_the_last_each_a_log_step():
    from wildtrain.config import EvalConfig

    validated = [step for step in range(1, 41) if due_at(step, 0, TRAIN, EVERY_20, EvalConfig(every=15), validates=True).validate]
    assert validated == [15, 30, 40]
    assert all(due_at(step, 0, TRAIN, EVERY_20, EvalConfig(every=15), validates=True).log for step in validated)
    assert [s for s in range(1, 41) if due_at(s, 0, TRAIN, EVERY_20, EvalConfig(every=0), validates=True).validate] == [40]
    assert not any(due_at(s, 0, TRAIN, EVERY_20, EvalConfig(every=15), validates=False).validate for s in range(1, 41))
