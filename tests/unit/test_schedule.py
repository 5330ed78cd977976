"""The loop's cadence: which steps each component is due at (validation, reporting,
checkpointing), and which saves must commit."""

from wildtrain.config import CheckpointConfig, EvalConfig
from wildtrain.train import checkpointing, validation
from wildtrain.train.reporting import ReportCadence
from wildtrain.train.schedule import At

STEPS = 40
EVERY_20 = CheckpointConfig(every=20)


def at(step: int, restored_step: int = 0, steps: int = STEPS) -> At:
    return At.of(step, restored_step, steps)


def test_logs_every_log_every_steps_and_saves_every_checkpoint_every_steps():
    logged = [step for step in range(1, 41) if ReportCadence(5).logs(at(step), validated=False)]
    saved = [step for step in range(1, 41) if checkpointing.due(at(step), EVERY_20)]
    assert logged == [1, 5, 10, 15, 20, 25, 30, 35, 40]
    assert saved == [20, 40]


def test_the_first_step_of_an_attempt_reports_for_the_recovery_timing():
    reports = ReportCadence(5)
    first = at(13, restored_step=12)
    logs = reports.logs(first, validated=False)
    assert first.first and logs and not checkpointing.due(first, EVERY_20) and reports.due(logs, saving=False)
    after = at(14, restored_step=12)
    assert not after.first and not reports.due(reports.logs(after, False), checkpointing.due(after, EVERY_20))


def test_the_last_step_saves_and_must_commit_even_off_the_cadence():
    last = at(37, steps=37)
    assert last.last and checkpointing.due(last, EVERY_20) and checkpointing.must_commit(last, regrow=False)
    assert ReportCadence(5).logs(last, validated=False)


def test_a_save_without_a_log_still_reports_so_that_it_can_commit():
    reports = ReportCadence(7)
    logs, saving = reports.logs(at(20), False), checkpointing.due(at(20), EVERY_20)
    assert saving and not logs and reports.due(logs, saving)


def test_a_regrow_saves_and_must_commit_and_calling_it_off_keeps_the_save():
    assert checkpointing.due(at(10), EVERY_20, regrow=True) and checkpointing.must_commit(at(10), regrow=True)
    assert not checkpointing.must_commit(at(10), regrow=False)  # called off: the save stands, need not commit


def test_validation_every_eval_every_steps_and_at_the_last_each_a_log_step():
    validated = [step for step in range(1, 41) if validation.due(at(step), EvalConfig(every=15))]
    assert validated == [15, 30, 40]
    assert all(ReportCadence(7).logs(at(step), validated=True) for step in validated)
    assert [s for s in range(1, 41) if validation.due(at(s), EvalConfig(every=0))] == [40]


def test_a_report_step_looks_for_the_previous_report_once_a_poll_has_passed_or_while_a_save_waits():
    reports = ReportCadence(5)
    assert reports.looks(at(5), saving=False)  # nothing sent yet
    reports.sent(5, steps_per_poll=12)
    assert [s for s in (10, 15, 20) if reports.looks(at(s), saving=False)] == [20]
    reports.sent(20, steps_per_poll=12)
    assert reports.looks(at(25), saving=True)  # a save waits for its step's report to commit
    assert reports.looks(at(30), saving=False)  # and keeps every report step looking until one goes
    reports.sent(30, steps_per_poll=12)
    assert not reports.looks(at(35), saving=False)
