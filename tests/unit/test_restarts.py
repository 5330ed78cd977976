"""The controller's pure decisions about restarts: why a group restarts, what a change of
the controller's state means, what the restart policy does about it, and how many workers
the nodes that are not left out can hold. What a state holds as `seen` reads it off Ray's
(errors as Ray's controller holds them), or as plain exceptions; no Ray cluster, no time passing."""

import pickle

from ray.train.v2._internal.execution.controller import state as ray_states
from ray.train.v2._internal.execution.worker_group.poll import WorkerGroupPollStatus, WorkerStatus
from ray.train.v2.api.exceptions import ControllerError

from wildtrain.controller_events import Restart, RestartKind, RestartReason, Transition, TransitionKind
from wildtrain.elastic.nodes import room_for_another_worker, workers_that_fit
from wildtrain.elastic.restarts import (
    CapacityClock,
    FailureBudget,
    StateSeen,
    classify_restart,
    decide,
    interpret,
    seen,
)
from wildtrain.elastic.signals import (
    FinalCheckpointFailed,
    PeerFailed,
    PlannedRegrow,
    RunCannotContinue,
    UnhealthyNodes,
)
from wildtrain.events import Failure, HealthCheck, NodeExcluded, Resize
from wildtrain.ray_compat import UserExceptionWithTraceback, WorkerGroupStartupTimeoutError

FAILURE, RESIZE = RestartKind.FAILURE, RestartKind.RESIZE


def _worker_group_error(*worker_errors: BaseException):
    """What the controller holds, made as Ray makes it: each worker's poll answers with its
    exception and traceback text, pickled across to the controller, which makes the group's
    error (a summary it truncates, and each worker's exception) from them."""
    statuses = {
        rank: pickle.loads(
            pickle.dumps(
                WorkerStatus(
                    running=False,
                    error=UserExceptionWithTraceback(
                        e, f"Traceback (most recent call last):\n  ...\n{type(e).__module__}.{type(e).__name__}: {e}"
                    ),
                )
            )
        )
        for rank, e in enumerate(worker_errors)
    }
    return WorkerGroupPollStatus(statuses).get_worker_group_error()


def _restarting(error: BaseException | None) -> StateSeen:
    """Ray's RESTARTING state holding `error`, as the controller's callback reads it."""
    return seen(ray_states.RestartingState(error))


def test_a_failed_health_check_restarts_as_planned_and_names_the_nodes_to_leave_out():
    checks = [HealthCheck(1.0, "matmul", 0, "good", True, "1.0x"), HealthCheck(1.0, "matmul", 1, "slow", False, "0.2x")]
    # Every rank raises, with the same results: they are logged once.
    error = _worker_group_error(UnhealthyNodes(["slow"], checks), UnhealthyNodes(["slow"], checks))
    restart = classify_restart(_restarting(error))
    assert restart.kind is FAILURE and restart.planned
    assert "slow" in restart.cause
    assert restart.events[:2] == checks
    (excluded,) = restart.events[2:]  # once, though both ranks name the node
    assert isinstance(excluded, NodeExcluded) and excluded.node == "slow"


def test_planned_regrows_and_real_failures_are_told_apart():
    regrow = classify_restart(_restarting(_worker_group_error(PlannedRegrow("room for more than 1 workers"))))
    assert (regrow.kind, regrow.planned) == (RESIZE, True)
    crash = classify_restart(_restarting(_worker_group_error(ValueError("bad batch"))))
    assert (crash.kind, crash.planned, crash.events) == (FAILURE, False, [])
    assert crash.cause == "rank 0: bad batch"
    assert "bad batch" in str(_worker_group_error(ValueError("bad batch")).worker_failures[0])
    assert not classify_restart(_restarting(None)).planned


def test_the_cause_of_a_failure_is_the_failed_ranks_error_not_its_peers_stopping_for_it():
    error = _worker_group_error(PeerFailed(0, "rank 1: ShardCorrupt: shard-3 is gone"), OSError("shard-3 is gone"))
    restart = classify_restart(_restarting(error))
    assert (restart.kind, restart.planned) == (FAILURE, False)
    assert restart.cause == "rank 1: shard-3 is gone"


def test_peer_failed_survives_pickling_as_ray_sends_it_to_the_controller():
    stopped = pickle.loads(pickle.dumps(PeerFailed(2, "rank 0: out of memory")))
    assert (stopped.rank, stopped.reason) == (2, "rank 0: out of memory")
    assert str(stopped) == str(PeerFailed(2, "rank 0: out of memory"))


def test_workers_that_fit_leave_out_excluded_nodes_and_count_the_scarcest_resource():
    nodes = {
        "a": {"CPU": 8, "GPU": 2},
        "b": {"CPU": 8, "GPU": 8},
        "c": {"CPU": 1, "GPU": 8},
        "head": {"CPU": 16},
    }
    per_worker = {"CPU": 1, "GPU": 1}
    assert workers_that_fit(nodes, per_worker, excluded=set()) == 2 + 8 + 1
    assert workers_that_fit(nodes, per_worker, excluded={"b"}) == 3
    assert workers_that_fit(nodes, {"CPU": 2}, excluded={"head"}) == 4 + 4 + 0


def test_unhealthy_nodes_survives_pickling_as_ray_sends_it_to_the_controller():
    check = HealthCheck(1.0, "matmul", 1, "slow", False, "0.2x")
    error = pickle.loads(pickle.dumps(UnhealthyNodes(["slow"], [check])))
    assert (error.nodes, error.checks) == (["slow"], [check])


def test_an_error_a_restart_cannot_help_ends_the_run_with_its_message():
    final = FinalCheckpointFailed(60, "s3://b/run/checkpoints/step_000000040-ab")
    restart = classify_restart(_restarting(_worker_group_error(final, pickle.loads(pickle.dumps(final)))))
    assert restart.fatal and not restart.planned
    assert restart.cause.startswith("the final checkpoint (step 60) could not be committed")
    assert restart.cause.endswith("again to resume from it") and "step_000000040-ab" in restart.cause
    shard = classify_restart(
        _restarting(_worker_group_error(RunCannotContinue("shard s3://b/d/shard-1.parquet: gone")))
    )
    assert shard.fatal and shard.cause == "shard s3://b/d/shard-1.parquet: gone"
    assert not classify_restart(_restarting(_worker_group_error(ValueError("bad batch")))).fatal


def test_a_signal_is_the_exception_a_worker_raised_not_text_that_looks_like_one():
    # A worker's error that repeats a signal's text, or names one (as Ray's summary of the
    # group's tracebacks then does), is a failure like any other.
    lookalikes = _worker_group_error(
        RuntimeError(str(RunCannotContinue("shard gone"))),
        RuntimeError(f"{PlannedRegrow.__name__}: room for more workers"),
        RuntimeError(str(UnhealthyNodes(["slow"], []))),
    )
    assert PlannedRegrow.__name__ in str(lookalikes)
    restart = classify_restart(_restarting(lookalikes))
    assert (restart.kind, restart.planned, restart.fatal, restart.events) == (FAILURE, False, False, [])
    assert restart.cause == "rank 0: shard gone"
    # An error that is no worker group's failure carries no worker's exception.
    not_a_group = classify_restart(_restarting(RuntimeError(str(RunCannotContinue("shard gone")))))
    assert (not_a_group.kind, not_a_group.fatal, not_a_group.cause) == (FAILURE, False, "shard gone")


def test_room_to_grow_leaves_the_data_reads_their_cpus():
    per_worker = {"CPU": 1, "wildtrain_worker": 1}
    free = {"a": {"CPU": 1.0, "wildtrain_worker": 1.0}, "b": {"CPU": 0.0}}
    assert not room_for_another_worker(free, per_worker, excluded=set(), keep_free_cpus=1.0), (
        "the one free CPU is the reads' between two tasks"
    )
    free["b"]["CPU"] = 1.0
    assert room_for_another_worker(free, per_worker, excluded=set(), keep_free_cpus=1.0)
    assert not room_for_another_worker(free, per_worker, excluded={"a"}, keep_free_cpus=1.0), "no worker slot elsewhere"


RUNNING = StateSeen("RUNNING")


def _group_failed(*failures: BaseException, lost_process: bool = False) -> StateSeen:
    """RESTARTING with a worker group's failure: each rank's exception, as a worker raised it."""
    return StateSeen(
        "RESTARTING",
        error=RuntimeError("the group failed"),
        failures=dict(enumerate(failures)),
        by_workers=True,
        lost_process=lost_process,
    )


def test_interpret_tells_a_failure_from_a_regrow_and_from_the_controller_waiting_with_it():
    crash = _group_failed(ValueError("bad batch"), lost_process=True)
    failure = interpret(RUNNING, crash)
    assert (failure.kind, failure.interruption, failure.counted, failure.again, failure.lost_process) == (
        TransitionKind.FAILURE,
        Failure,
        True,
        False,
        True,
    )
    assert failure.cause == "rank 0: bad batch" and failure.error is crash.error
    assert interpret(crash, crash).again, "no room: the controller's loop turns in the same state"
    assert not interpret(crash, _group_failed(ValueError("bad batch"))).again, "another error: another failure"

    regrow = interpret(RUNNING, _group_failed(PlannedRegrow("room for 2")))
    assert (regrow.kind, regrow.interruption, regrow.counted) == (TransitionKind.RESIZE, Resize, False)
    assert regrow.restart.reason is RestartReason.REGROW
    unhealthy = interpret(RUNNING, _group_failed(UnhealthyNodes(["slow"], [])))
    assert (unhealthy.kind, unhealthy.counted) == (TransitionKind.FAILURE, False)
    assert [e.node for e in unhealthy.events if isinstance(e, NodeExcluded)] == ["slow"]
    fatal = interpret(RUNNING, _group_failed(RunCannotContinue("shard gone")))
    assert (fatal.restart.reason, fatal.restart.fatal, fatal.cause) == (
        RestartReason.CANNOT_CONTINUE,
        True,
        "shard gone",
    )
    ray_resize = interpret(RUNNING, StateSeen("RESIZING", workers=3))
    assert (ray_resize.kind, ray_resize.restart, ray_resize.interruption) == (TransitionKind.RESIZE, None, Resize)


def test_interpret_follows_a_start_and_its_failure():
    start = interpret(StateSeen("RESTARTING"), StateSeen("SCHEDULING", workers=2))
    assert (start.kind, start.workers, start.interruption) == (TransitionKind.START, 2, None)
    timed_out = StateSeen("RESCHEDULING", error=RuntimeError("no room"), start_timed_out=True, summary="no room")
    failed = interpret(StateSeen("SCHEDULING", workers=2), timed_out)
    assert (failed.kind, failed.workers, failed.timed_out, failed.counted, failed.interruption, failed.cause) == (
        TransitionKind.START_FAILED,
        2,
        True,
        False,
        Failure,
        "no room",
    )
    assert interpret(timed_out, timed_out) == Transition(TransitionKind.WAITING, again=True)
    assert interpret(StateSeen("SCHEDULING", workers=1), RUNNING) == Transition(TransitionKind.RUNNING)
    assert interpret(RUNNING, StateSeen("SHUTTING_DOWN")).kind is TransitionKind.FINISH
    assert interpret(StateSeen("INITIALIZING"), StateSeen("INITIALIZING")).again


def test_seen_reads_what_rays_states_hold():
    crash = _worker_group_error(ValueError("bad batch"))
    restarting = seen(ray_states.RestartingState(crash))
    assert (restarting.name, restarting.error, restarting.by_workers, restarting.lost_process) == (
        "RESTARTING",
        crash,
        True,
        False,
    )
    assert [str(e) for e in restarting.failures.values()] == ["bad batch"]
    timed_out = ControllerError(WorkerGroupStartupTimeoutError(num_workers=2))
    rescheduling = seen(ray_states.ReschedulingState(timed_out))
    assert rescheduling.start_timed_out and not rescheduling.by_workers and rescheduling.failures == {}
    assert rescheduling.summary == str(timed_out).strip().splitlines()[0]
    assert seen(ray_states.RunningState()) == StateSeen("RUNNING")


def _failure(cause: str = "rank 0: bad batch", counted: bool = True, **fields) -> Transition:
    return Transition(
        TransitionKind.FAILURE,
        Restart(RestartReason.WORKERS_FAILED if counted else RestartReason.UNHEALTHY_NODES, cause),
        RuntimeError(cause),
        counted=counted,
        **fields,
    )


def test_a_failure_is_counted_once_and_its_restart_sized_for_what_is_alive():
    budget, clock = FailureBudget(max_failures=1), CapacityClock(min_workers=1)
    failure = _failure(lost_process=True)
    decision = decide(failure, budget, clock, now=10.0)
    assert (decision.budget.failures, decision.end, decision.exclude) == (1, None, frozenset())
    assert decision.await_lost_nodes and decision.refresh and decision.bounded and not decision.paced
    assert decision.capacity.waiting_since == 10.0
    again = decide(failure, decision.budget, decision.capacity, now=11.0)
    assert again.budget.failures == 1 and not again.await_lost_nodes, "the same error again is a turn of the loop"
    assert again.paced and again.refresh

    second = decide(_failure("rank 1: out of memory"), decision.budget, decision.capacity, now=12.0)
    assert second.end == ("elastic.max_failures: 2 failures, more than the 1 allowed; the last: rank 1: out of memory")
    planned = decide(_failure(counted=False), decision.budget, decision.capacity, now=12.0)
    assert planned.budget.failures == 1 and planned.end is None


def test_a_failed_health_check_leaves_its_nodes_out_and_a_hopeless_failure_ends_the_run():
    excluded = Restart(RestartReason.UNHEALTHY_NODES, "health check failed", events=[NodeExcluded(1.0, "slow", "")])
    t = Transition(TransitionKind.FAILURE, excluded, RuntimeError("unhealthy"))
    assert decide(t, FailureBudget(-1), CapacityClock(1), now=0.0).exclude == {"slow"}
    fatal = Transition(TransitionKind.FAILURE, Restart(RestartReason.CANNOT_CONTINUE, "shard gone"), RuntimeError("x"))
    decision = decide(fatal, FailureBudget(-1), CapacityClock(1), now=0.0)
    assert decision.end == "shard gone" and not decision.refresh


def test_a_wait_for_room_is_timed_from_the_first_turn_that_found_none_until_a_group_runs():
    clock = decide(_failure(), FailureBudget(-1), CapacityClock(1), now=100.0).capacity
    turn = decide(Transition(TransitionKind.WAITING, again=True), FailureBudget(-1), clock, now=101.0)
    assert turn.capacity.no_room_since == 100.0 and turn.paced
    start = decide(Transition(TransitionKind.START, workers=1), FailureBudget(-1), turn.capacity, now=130.0)
    assert not start.refresh and not start.bounded and start.capacity.attempt_started == 130.0
    running = decide(Transition(TransitionKind.RUNNING), FailureBudget(-1), start.capacity, now=135.0)
    assert running.waited_s == 35.0 and running.capacity.waited_s(200.0) == 0.0
    assert decide(Transition(TransitionKind.RUNNING), FailureBudget(-1), running.capacity, now=136.0).waited_s is None


def test_a_failed_start_above_the_minimum_is_forgiven_once_per_size():
    clock = decide(
        Transition(TransitionKind.START, workers=2), FailureBudget(-1), CapacityClock(1).waiting(0.0), now=10.0
    ).capacity
    failed = decide(
        Transition(TransitionKind.START_FAILED, workers=2, timed_out=True), FailureBudget(-1), clock, now=40.0
    )
    assert failed.refresh and failed.bounded and failed.capacity.waited_s(40.0) == 10.0
    assert (
        decide(Transition(TransitionKind.FINISH), FailureBudget(-1), failed.capacity, now=50.0).capacity
        == failed.capacity
    )
