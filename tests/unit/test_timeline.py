from tests.helpers.reports import first_report, report
from wildtrain.events import Failure, Resize
from wildtrain.tracking.controller.timeline import Timeline


def test_a_failure_and_its_recovery_are_split_into_parts():
    timeline = Timeline()
    timeline.group_started(["node-a", "node-b"])
    timeline.reported(first_report(1, 2, 0, 0.0, 1.0))
    for step in range(2, 7):
        timeline.reported(report(step, 2))
    event = timeline.interrupted(Failure, at=100.0, cause="node-b died")
    assert isinstance(event, Failure)
    assert event.last_step == 6 and event.world_size == 2 and event.nodes == ["node-a", "node-b"]
    # the controller retries once more before the group is back: still one outage
    assert timeline.interrupted(Failure, at=105.0) is None

    timeline.group_started(["node-a"])
    recovery = timeline.reported(first_report(5, 1, 4, 110.0, 118.0))
    assert (recovery.world_size_before, recovery.world_size_after) == (2, 1)
    assert recovery.restart_s == 10.0 and recovery.recovery_s == 18.0
    assert recovery.restored_step == 4 and recovery.steps_lost == 2
    assert [e.KIND for e in timeline.events] == ["failure", "recovered"]


def test_reports_without_an_interruption_complete_nothing():
    timeline = Timeline()
    assert timeline.reported(first_report(1, 2, 0, 0.0, 1.0)) is None
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
    recovery = timeline.reported(first_report(11, 2, 10, 4.0, 5.0))
    assert recovery.kind == "resize" and recovery.steps_lost == 0
