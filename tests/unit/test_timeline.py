from dataclasses import replace

from tests.helpers.reports import first_report, report
from wildtrain.controller_events import Interruption, Noted, Recovery, RecoveryPath
from wildtrain.events import Failure, Formed, Recovered, Resize
from wildtrain.tracking.controller.timeline import Timeline


def test_a_failure_and_its_recovery_are_split_into_parts():
    timeline = Timeline()
    timeline.group_started(["node-a", "node-b"])
    timeline.reported(first_report(1, 2, 0, 0.0, 1.0))
    for step in range(2, 7):
        timeline.reported(report(step, 2))
    interruption = timeline.interrupted(Failure, at=100.0, cause="node-b died")
    assert interruption.path is RecoveryPath.RESTART
    event = interruption.event
    assert isinstance(event, Failure)
    assert event.last_step == 6 and event.world_size == 2 and event.nodes == ["node-a", "node-b"]
    # the controller retries once more before the group is back: still one outage
    assert timeline.interrupted(Failure, at=105.0) is None

    timeline.group_started(["node-a"])
    [entry] = timeline.reported(first_report(5, 1, 4, 110.0, 118.0))
    assert isinstance(entry, Recovery) and entry.path is RecoveryPath.RESTART
    recovery = entry.event
    assert (recovery.world_size_before, recovery.world_size_after) == (2, 1)
    assert recovery.restart_s == 10.0 and recovery.recovery_s == 18.0
    assert recovery.restored_step == 4 and recovery.steps_lost == 2
    assert [e.KIND for e in timeline.events] == ["failure", "recovered"]


def test_reports_without_an_interruption_complete_nothing():
    timeline = Timeline()
    assert timeline.reported(first_report(1, 2, 0, 0.0, 1.0)) == ()
    assert timeline.events == []


def test_steps_lost_count_from_the_newest_report_of_the_interrupted_attempt():
    timeline = Timeline()
    timeline.group_started(["a", "b"])
    for step in range(1, 11):
        timeline.reported(report(step, 2))
    timeline.interrupted(Failure, at=0.0)
    timeline.reported(first_report(9, 1, 8, 1.0, 2.0))  # restored from step 8: 2 lost
    timeline.reported(report(10, 1))
    timeline.interrupted(Resize, at=3.0)
    [entry] = timeline.reported(first_report(11, 2, 10, 4.0, 5.0))
    assert entry.event.kind == "resize" and entry.event.steps_lost == 0


def test_an_in_process_re_form_reaches_the_timeline_as_the_same_entries_in_the_order_the_workers_made_them():
    """Rank 0 of the generation that recovered measured its interruption and recovery
    (`train.generations`); the group itself went on, so nothing is pending after them."""
    timeline = Timeline()
    timeline.group_started(["a", "b"])
    timeline.reported(report(10, 2))
    failure = Failure(50.0, 2, 10, "a member left the group of 2", ["a", "b"])
    formed = Formed(51.0, 1, 9, ["a"])
    recovered = Recovered(52.0, "failure", 2, 1, 1.0, 0.5, 0.0, 2.0, 9, 1)
    entries = timeline.reported(replace(report(11, 1), events=(formed, failure, recovered)))
    assert entries == (
        Noted(formed),
        Interruption(failure, RecoveryPath.IN_PROCESS),
        Recovery(recovered, RecoveryPath.IN_PROCESS),
    )
    assert timeline.events == [failure, recovered] and timeline.pending is None
    assert (timeline.world_size, timeline.last_step) == (1, 11)
