"""The controller's one reader of what happens to a run (`ControllerEvents`): each change of
Ray's controller state is interpreted once and told, typed, to the progress lines, the MLflow
record and the restart policy, in the order of their stages; both recovery paths' failures and
recoveries reach them as the same entries. Ray's states as its controller makes them; no Ray
cluster, no MLflow server."""

from dataclasses import replace
from types import SimpleNamespace

import pytest
from ray.train.v2._internal.execution.controller import state as ray_states
from ray.train.v2.api.exceptions import WorkerGroupError

from tests.helpers.reports import first_report, report
from wildtrain import ray_compat
from wildtrain.config import load_config
from wildtrain.controller_events import (
    Consumer,
    Interruption,
    Noted,
    Recovery,
    RecoveryPath,
    Reported,
    Stage,
    StateChanged,
    TransitionKind,
    in_stage_order,
)
from wildtrain.elastic import controller
from wildtrain.elastic.controller import ControllerEvents
from wildtrain.elastic.signals import UnhealthyNodes
from wildtrain.events import Failure, HealthCheck, NodeExcluded, Recovered
from wildtrain.tracking.controller.progress import ProgressLines


class Heard(Consumer):
    """A consumer that writes down what it is told, into a log it shares with the others."""

    def __init__(self, stage: Stage, log: list, fail_on: TransitionKind | None = None) -> None:
        self.stage, self.log, self.fail_on = stage, log, fail_on

    def state_changed(self, change: StateChanged) -> None:
        self.log.append((self.stage, change))
        if change.transition.kind is self.fail_on:
            raise RuntimeError("the run ends")

    def reported(self, reported: Reported) -> None:
        self.log.append((self.stage, reported))


def _failed(*errors: BaseException):
    return ray_states.RestartingState(WorkerGroupError("the group failed", dict(enumerate(errors))))


def test_consumers_hear_in_the_order_of_their_stages_whatever_order_they_are_given():
    log: list = []
    act, record, say = Heard(Stage.ACT, log), Heard(Stage.RECORD, log), Heard(Stage.SAY, log)
    assert in_stage_order([act, record, say]) == [say, record, act]
    events = ControllerEvents([act, record, say])
    events.after_controller_state_update(ray_states.RunningState(), _failed(ValueError("bad batch")))
    assert [stage for stage, _ in log] == [Stage.SAY, Stage.RECORD, Stage.ACT]
    changes = [change for _, change in log]
    assert changes[0] is changes[1] is changes[2], "interpreted once: every consumer gets the same reading"


def test_a_policy_that_ends_the_run_acts_after_the_failure_is_said_and_recorded():
    log: list = []
    events = ControllerEvents([Heard(Stage.ACT, log, fail_on=TransitionKind.FAILURE), Heard(Stage.RECORD, log)])
    with pytest.raises(RuntimeError, match="the run ends"):
        events.after_controller_state_update(ray_states.RunningState(), _failed(ValueError("bad batch")))
    [(_, recorded), (_, acted)] = log
    assert recorded is acted and isinstance(recorded.entries[0], Interruption)


def test_a_failed_group_is_one_interruption_and_its_carried_events_once_per_failure():
    log: list = []
    events = ControllerEvents([Heard(Stage.RECORD, log)])
    events.timeline.group_started(["good", "slow"])
    check = HealthCheck(1.0, "matmul", 1, "slow", False, "0.2x")
    restarting = _failed(UnhealthyNodes(["slow"], [check]), UnhealthyNodes(["slow"], [check]))
    events.after_controller_state_update(ray_states.RunningState(), restarting)
    for _ in range(3):  # no room: the controller's loop turns in the same state
        events.after_controller_state_update(restarting, restarting)
    first, *again = [change for _, change in log]
    interruption, carried_check, excluded = first.entries
    assert interruption.path is RecoveryPath.RESTART and isinstance(interruption.event, Failure)
    assert interruption.event.nodes == ["good", "slow"] and "slow" in interruption.event.cause
    assert carried_check == Noted(check) and isinstance(excluded.event, NodeExcluded)
    assert all(change.transition.again and change.entries == () for change in again)

    # A second failure before the group recovered belongs to the same outage: no new interruption.
    events.after_controller_state_update(ray_states.RunningState(), _failed(ValueError("bad batch")))
    assert log[-1][1].entries == ()


def test_both_recovery_paths_reach_the_consumers_as_the_same_entries(capsys, monkeypatch):
    monkeypatch.setattr(controller, "time", SimpleNamespace(time=lambda: 100.0))  # when the controller learns of it
    log: list = []
    events = ControllerEvents([ProgressLines(total_steps=20), Heard(Stage.RECORD, log)])
    events.timeline.group_started(["a", "b"])
    window = {"step": 6, "at": 0.0, "loss": 2.0, "step_time_s": 1.0, "tokens_per_s": 100.0, "world_size": 2}
    events.after_report(None, [replace(report(6, 2), windows=(window,)).to_dict()])
    events.after_controller_state_update(ray_states.RunningState(), _failed(ValueError("bad batch")))
    events.timeline.group_started(["a"])
    events.after_report(None, [first_report(5, 1, 4, 110.0, 118.0).to_dict()])
    failure = Failure(200.0, 1, 9, "a member left the group of 1", ["a"])
    recovered = Recovered(202.0, "failure", 2, 1, 1.0, 0.5, 0.0, 2.0, 8, 1)
    events.after_report(None, [replace(report(10, 1), events=(failure, recovered)).to_dict()])

    restart_recovery = log[2][1].entries
    in_process = log[3][1].entries
    assert [type(e) for e in restart_recovery] == [Recovery] and restart_recovery[0].path is RecoveryPath.RESTART
    assert in_process == (
        Interruption(failure, RecoveryPath.IN_PROCESS),
        Recovery(recovered, RecoveryPath.IN_PROCESS),
    )
    # Both paths' recoveries are said by the controller, each in its own words.
    assert capsys.readouterr().out.splitlines() == [
        "step  6/20 | loss 2.0000 | 100 tok/s | world 2 | ETA 0:00:14",
        "failure after step 6 at world size 2: rank 0: bad batch",
        "recovered at world size 1 from step 4 in 18.0 s (restart 10.0 s, restore 1.0 s, reshard 2.0 s); "
        "2 steps redone",
        "re-formed in-process at world size 1 from step 8 in 2.0 s (rendezvous 1.0 s, state from peers 0.5 s); "
        "1 steps redone",
    ]


def test_the_policy_hears_a_group_start_as_its_nodes(monkeypatch):
    policy = controller.RestartPolicy(load_config([]), record_event=lambda event: None)
    workers = [ray_compat.GroupWorker(0, "a", 11), ray_compat.GroupWorker(1, "b", 12)]
    monkeypatch.setattr(controller.ray_compat, "group_workers", lambda group: workers)
    ControllerEvents([policy]).after_worker_group_start(SimpleNamespace())
    assert policy.group_nodes == {"a", "b"}
