"""The controller-side elastic policy without a Ray cluster: failures counted once however
often the controller repeats a state, the capacity clock that ends a stranded run but not a
recovering one, refreshes of the resource view that fail, and the node grace only for lost
processes. The controller's states are Ray's own, as its controller makes them; time is fake."""

import threading
from types import SimpleNamespace

import pytest
from ray.exceptions import ActorDiedError
from ray.train.v2._internal.execution.controller import state as ray_states
from ray.train.v2._internal.execution.scaling_policy.scaling_policy import ResizeDecision
from ray.train.v2.api.exceptions import ControllerError, WorkerGroupError

from wildtrain.config import load_config
from wildtrain.elastic import controller
from wildtrain.elastic import nodes as elastic_nodes
from wildtrain.elastic.controller import ControllerEvents, RestartPolicy
from wildtrain.elastic.nodes import ResourceView
from wildtrain.elastic.restarts import CapacityClock, FailureBudget
from wildtrain.elastic.signals import CapacityError
from wildtrain.events import Waiting
from wildtrain.ray_compat import WorkerGroupStartupTimeoutError, WorkerHealthCheckFailedError, lost_a_worker_process


class FakeTime:
    """Stands in for the `time` module inside wildtrain.elastic: sleeping advances the clock."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


_RAY_STATES = {
    "INITIALIZING": ray_states.InitializingState,
    "SCHEDULING": ray_states.SchedulingState,
    "RUNNING": ray_states.RunningState,
    "RESTARTING": ray_states.RestartingState,
    "RESCHEDULING": ray_states.ReschedulingState,
}


def state(name: str, error=None, workers: int | None = None):
    """Ray's controller state `name`, holding `error` or a decision for `workers` where it holds one."""
    if name == "SCHEDULING":
        return _RAY_STATES[name](ResizeDecision(num_workers=workers, resources_per_worker={"CPU": 1.0}))
    return _RAY_STATES[name](error) if name in ("RESTARTING", "RESCHEDULING") else _RAY_STATES[name]()


def worker_exception() -> WorkerGroupError:
    return WorkerGroupError("[Rank 0 Error Snippet]: ValueError: bad batch", {0: ValueError("bad batch")})


def lost_worker() -> WorkerGroupError:
    died = WorkerHealthCheckFailedError("A worker health check failed.", failure=ActorDiedError())
    return WorkerGroupError(
        "[Rank 1 Error Snippet]: the actor died", {0: RuntimeError("Connection closed by peer"), 1: died}
    )


def start_timed_out(workers: int) -> ControllerError:
    return ControllerError(WorkerGroupStartupTimeoutError(num_workers=workers))


@pytest.fixture
def clock(monkeypatch) -> FakeTime:
    fake = FakeTime()
    monkeypatch.setattr(controller, "time", fake)
    monkeypatch.setattr(elastic_nodes, "time", fake)
    return fake


@pytest.fixture
def nodes(monkeypatch):
    """Ray's node table: the group's two nodes, alive unless a test kills one."""
    table = {"a": True, "b": True}
    calls = []

    def ray_nodes():
        calls.append(1)
        return [{"NodeID": node, "Alive": alive} for node, alive in table.items()]

    monkeypatch.setattr(controller.ray, "nodes", ray_nodes)
    return SimpleNamespace(table=table, calls=calls)


def policy(*overrides: str, recorded: list | None = None) -> RestartPolicy:
    p = RestartPolicy(load_config(list(overrides)), record_event=(recorded if recorded is not None else []).append)
    p.view = ResourceView(lambda: None)
    p.group_nodes = {"a", "b"}
    return p


def changed(p: RestartPolicy, previous, current) -> None:
    """Ray's controller changes its state: its one reader tells the policy."""
    ControllerEvents([p]).after_controller_state_update(previous, current)


def test_one_failure_counts_once_however_often_the_controller_repeats_its_state(clock, nodes):
    p = policy("elastic.max_failures=1")
    error = worker_exception()
    changed(p, state("RUNNING"), state("RESTARTING", error))
    restarting = state("RESTARTING", error)
    for _ in range(20):  # the controller waits for capacity: same state, same error
        changed(p, restarting, restarting)
    assert p.budget.failures == 1
    changed(p, state("SCHEDULING", workers=1), state("RUNNING"))
    with pytest.raises(RuntimeError, match=r"^elastic.max_failures: 2 failures, more than the 1 allowed"):
        changed(p, state("RUNNING"), state("RESTARTING", worker_exception()))


@pytest.fixture
def pending_kills(monkeypatch) -> threading.Event:
    """Set once the start watchdog kills the workers still waiting to be created."""
    killed = threading.Event()

    def kill_pending_actors() -> int:
        killed.set()
        return 2

    monkeypatch.setattr(controller.ray_compat, "kill_pending_actors", kill_pending_actors)
    return killed


def test_a_slow_worker_group_start_goes_on_and_one_that_lost_a_node_is_ended(nodes, pending_kills):
    p = policy("elastic.worker_start_timeout_s=0.05")  # the watchdog looks from 0.1 s on
    with p.on_worker_group_start():
        # Every node alive: a start that is only slow (workers' processes, a runtime env) goes on.
        assert not pending_kills.wait(0.5)
        nodes.table["b"] = False
        assert pending_kills.wait(5), "a node alive at the start died: its pending workers are ended"


def test_the_failure_budget_counts_an_error_once_and_planned_restarts_never():
    first, second, regrow = worker_exception(), worker_exception(), worker_exception()
    budget = FailureBudget(max_failures=1).after(first, counts=True).after(first, counts=True)
    assert (budget.failures, budget.exceeded) == (1, False)
    budget = budget.after(regrow, counts=False)
    assert (budget.failures, budget.is_new(regrow)) == (1, False)
    assert budget.after(second, counts=True).exceeded
    assert not FailureBudget(max_failures=-1, failures=99).exceeded


def test_a_worker_exception_does_not_wait_the_node_grace(clock, nodes):
    p = policy()
    started = clock.now
    changed(p, state("RUNNING"), state("RESTARTING", worker_exception()))
    assert clock.now == started and not nodes.calls, "no node was lost: nothing to wait for"


def test_a_lost_worker_waits_until_its_node_is_marked_dead(clock, nodes):
    p = policy()
    started = clock.now
    changed(p, state("RUNNING"), state("RESTARTING", lost_worker()))
    assert clock.now - started == pytest.approx(p.node_grace_s), "the node lives: the whole grace"
    nodes.table["b"] = False
    started = clock.now
    changed(p, state("RUNNING"), state("RESTARTING", lost_worker()))
    assert clock.now == started, "the node is already marked dead"


def test_what_tells_a_lost_worker_from_an_exception_in_the_training_function():
    assert lost_a_worker_process(lost_worker())
    assert not lost_a_worker_process(worker_exception())
    assert not lost_a_worker_process(start_timed_out(2))
    assert not lost_a_worker_process(None)


def test_a_smaller_group_slow_to_start_after_a_stale_sized_attempt_is_not_a_capacity_loss(clock, nodes):
    """The defaults: a node dies; Ray's view still counts it, so two starts at the old size
    time out (elastic.worker_start_timeout_s each) before the smaller group starts, slowly."""
    cfg = load_config([])
    timeout = cfg.elastic.worker_start_timeout_s
    p = policy()
    changed(p, state("SCHEDULING", workers=2), state("RUNNING"))
    changed(p, state("RUNNING"), state("RESTARTING", lost_worker()))
    for workers in (2, 2):
        scheduling = state("SCHEDULING", workers=workers)
        changed(p, state("RESTARTING"), scheduling)
        clock.now += timeout
        changed(p, scheduling, state("RESCHEDULING", start_timed_out(workers)))
    changed(p, state("RESCHEDULING"), state("SCHEDULING", workers=1))
    clock.now += 60  # runtime env, imports: slow, but it fits
    changed(p, state("SCHEDULING", workers=1), state("RUNNING"))
    assert p.capacity.waited_s(clock.now) == 0


def test_a_run_without_capacity_ends_after_capacity_wait_s(clock, nodes):
    p = policy("elastic.capacity_wait_s=15")
    changed(p, state("RUNNING"), state("RESTARTING", lost_worker()))
    started = clock.now - p.node_grace_s
    restarting = state("RESTARTING", lost_worker())
    with pytest.raises(CapacityError, match=r"^elastic.capacity_wait_s: no worker group could run for 15 s"):
        for _ in range(100):
            changed(p, restarting, restarting)
    assert 15 < clock.now - started < 17, "each turn of the controller's loop waits for the next refresh"


def test_a_wait_for_room_is_recorded_when_a_group_runs_again_and_a_usual_restart_is_not(clock, nodes):
    recorded = []
    p = policy(recorded=recorded)
    error = worker_exception()
    changed(p, state("RUNNING"), state("RESTARTING", error))
    changed(p, state("RESTARTING", error), state("SCHEDULING", workers=2))
    changed(p, state("SCHEDULING", workers=2), state("RUNNING"))
    assert recorded == [], "a restart that found room at once waited for nothing"

    error = worker_exception()
    stopped_at = clock.now
    restarting = state("RESTARTING", error)
    changed(p, state("RUNNING"), restarting)
    for _ in range(10):  # no room: the controller's loop turns without a decision
        changed(p, restarting, restarting)
    changed(p, restarting, state("SCHEDULING", workers=1))
    clock.now += 3.0
    changed(p, state("SCHEDULING", workers=1), state("RUNNING"))
    [waiting] = recorded
    assert isinstance(waiting, Waiting)
    assert (waiting.start, waiting.end) == (stopped_at, clock.now)


def test_the_capacity_clock_forgives_one_timed_out_attempt_per_size_above_the_minimum():
    c = CapacityClock(min_workers=1).waiting(0.0)
    c = c.attempt(10.0).attempt_failed(40.0, size=2, timed_out=True)
    assert c.waited_s(40.0) == 10.0, "the stale-sized attempt is not time without capacity"
    c = c.attempt(41.0).attempt_failed(71.0, size=2, timed_out=True)
    assert c.waited_s(71.0) == 41.0, "the same size again: the view is not merely stale"
    c = c.attempt(72.0).attempt_failed(102.0, size=1, timed_out=True)
    assert c.waited_s(102.0) == 72.0, "no room even for the smallest group"
    c = c.attempt(103.0).attempt_failed(104.0, size=3, timed_out=False)
    assert c.waited_s(104.0) == 74.0, "a start that failed otherwise is still time without a group"
    assert c.running().waited_s(200.0) == 0.0


def test_a_failing_refresh_does_not_end_the_run(capsys, clock, nodes):
    calls = []

    def refresh():
        calls.append(1)
        raise TimeoutError("GCS did not answer in 10 s")

    p = policy()
    p.view = ResourceView(refresh)
    changed(p, state("RUNNING"), state("RESTARTING", worker_exception()))
    restarting = state("RESTARTING", worker_exception())
    changed(p, restarting, restarting)
    assert len(calls) == 2
    assert capsys.readouterr().out.count("TimeoutError: GCS did not answer in 10 s") == 1, "once per distinct error"
