"""The controller's pure decisions about restarts: why a group restarts, and how many
workers the nodes that are not left out can hold."""

from ray.train.v2.api.exceptions import WorkerGroupError

from wildtrain.events import HealthCheck, NodeExcluded
from wildtrain.ray_compat import UserExceptionWithTraceback
from wildtrain.elastic.nodes import room_for_another_worker, workers_that_fit
from wildtrain.elastic.signals import PeerFailed, PlannedRegrow, UnhealthyNodes, classify_restart


def _worker_group_error(*worker_errors: BaseException) -> WorkerGroupError:
    """What the controller holds: each worker's traceback text, and a summary of them all
    that Ray truncates."""
    tracebacks = {rank: f"Traceback (most recent call last):\n  ...\n{type(e).__module__}.{type(e).__name__}: {e}"
                  for rank, e in enumerate(worker_errors)}
    summary = "\n".join(f"[Rank {rank} Error Snippet]:\n{text[:40]}..." for rank, text in tracebacks.items())
    return WorkerGroupError(summary, {rank: UserExceptionWithTraceback(worker_errors[rank], text)
                                      for rank, text in tracebacks.items()})


def test_a_failed_health_check_restarts_as_planned_and_names_the_nodes_to_leave_out():
    checks = [HealthCheck(1.0, "matmul", 0, "good", True, "1.0x"), HealthCheck(1.0, "matmul", 1, "slow", False, "0.2x")]
    # Every rank raises; only rank 0 knows the check's results.
    error = _worker_group_error(UnhealthyNodes(["slow"], checks), UnhealthyNodes(["slow"], []))
    restart = classify_restart(error)
    assert restart.kind == "failure" and restart.planned
    assert "slow" in restart.cause
    assert restart.events[:2] == checks
    (excluded,) = restart.events[2:]
    assert isinstance(excluded, NodeExcluded) and excluded.node == "slow"


def test_planned_regrows_and_real_failures_are_told_apart():
    regrow = classify_restart(_worker_group_error(PlannedRegrow("room for more than 1 workers")))
    assert (regrow.kind, regrow.planned) == ("resize", True)
    crash = classify_restart(_worker_group_error(ValueError("bad batch")))
    assert (crash.kind, crash.planned, crash.events) == ("failure", False, [])
    assert crash.cause == "rank 0: builtins.ValueError: bad batch"
    assert "bad batch" in str(_worker_group_error(ValueError("bad batch")).worker_failures[0])
    assert not classify_restart(None).planned


def test_the_cause_of_a_failure_is_the_failed_ranks_error_not_its_peers_stopping_for_it():
    error = _worker_group_error(PeerFailed(0, "rank 1: ShardCorrupt: shard-3 is gone"), OSError("shard-3 is gone"))
    restart = classify_restart(error)
    assert (restart.kind, restart.planned) == ("failure", False)
    assert restart.cause == "rank 1: builtins.OSError: shard-3 is gone"


def test_peer_failed_survives_pickling_as_ray_sends_it_to_the_controller():
    import pickle

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
    import pickle

    check = HealthCheck(1.0, "matmul", 1, "slow", False, "0.2x")
    error = pickle.loads(pickle.dumps(UnhealthyNodes(["slow"], [check])))
    assert (error.nodes, error.checks) == (["slow"], [check])


def test_an_error_a_restart_cannot_help_ends_the_run_with_its_message():
    import pickle

    from wildtrain.elastic.signals import FinalCheckpointFailed, RunCannotContinue

    final = FinalCheckpointFailed(60, "s3://b/run/checkpoints/step_000000040-ab")
    restart = classify_restart(_worker_group_error(final, pickle.loads(pickle.dumps(final))))
    assert restart.fatal and not restart.planned
    assert restart.cause.startswith("the final checkpoint (step 60) could not be committed")
    assert restart.cause.endswith("again to resume from it") and "step_000000040-ab" in restart.cause
    shard = classify_restart(_worker_group_error(RunCannotContinue("shard s3://b/d/shard-1.parquet: gone")))
    assert shard.fatal and shard.cause == "shard s3://b/d/shard-1.parquet: gone"
    assert not classify_restart(_worker_group_error(ValueError("bad batch"))).fatal


def test_room_to_grow_leaves_the_data_reads_their_cpus():
    per_worker = {"CPU": 1, "wildtrain_worker": 1}
    free = {"a": {"CPU": 1.0, "wildtrain_worker": 1.0}, "b": {"CPU": 0.0}}
    assert not room_for_another_worker(free, per_worker, excluded=set(), keep_free_cpus=1.0), \
        "the one free CPU is the reads' between two tasks"
    free["b"]["CPU"] = 1.0
    assert room_for_another_worker(free, per_worker, excluded=set(), keep_free_cpus=1.0)
    assert not room_for_another_worker(free, per_worker, excluded={"a"}, keep_free_cpus=1.0), "no worker slot elsewhere"
