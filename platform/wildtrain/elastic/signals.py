"""What workers and the controller tell each other beyond Ray's own states: a worker
raises one of these to ask for a planned restart (a regrow, leaving out unhealthy nodes) or
to end the run, and the controller classifies each restart from the error Ray hands it
(`restarts.classify_restart`). Ray pickles each worker's exception to the controller whole
(`ray_compat.worker_failures`), so the controller reads their typed fields: each must pickle.
Workers import this module: it imports no Ray.
"""

from __future__ import annotations

from wildtrain.events import HealthCheck


class CapacityError(RuntimeError):
    pass


class PlannedRegrow(RuntimeError):
    """Raised by every worker right after a checkpoint, once the cluster has room for more
    workers: Ray Train then restarts the group at the larger size from that checkpoint, so
    growing redoes no step. (Ray's own resize check would stop the group mid-interval and
    lose the steps since the last checkpoint.) Not counted against elastic.max_failures."""


class MembersJoining(RuntimeError):
    """Raised by every member of an in-process group (elastic.in_process) at the same log
    step, once workers started on lost members' placement slots asked to join: the members
    hand their state over to the next generation, which includes the joiners. No restart,
    and no failure."""


class RunCannotContinue(RuntimeError):
    """Raised by a worker when restarting the group cannot help (a shard that went bad, a
    final checkpoint that cannot commit): the controller ends the run with this message
    instead of restarting into the same error until the failure budget is spent."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class FinalCheckpointFailed(RunCannotContinue):
    """The run's last step is trained but its checkpoint did not commit within
    checkpoint.timeout_s, retries included; restarting would redo steps only to meet the
    same storage."""

    def __init__(self, step: int, resume_from: str) -> None:
        super().__init__(
            f"the final checkpoint (step {step}) could not be committed within checkpoint.timeout_s; "
            f"the newest committed checkpoint is {resume_from}: fix the store and run the same command "
            "again to resume from it"
        )
        self.step, self.resume_from = step, resume_from

    def __reduce__(self):
        return type(self), (self.step, self.resume_from)


class UnhealthyNodes(RuntimeError):
    """Raised by every worker of a group whose pre-flight health check failed nodes, with
    monitor.exclude_unhealthy on: the controller leaves those nodes out and the group
    re-forms without them. `checks`: the check's results, for the controller to log."""

    def __init__(self, nodes: list[str], checks: list[HealthCheck]) -> None:
        super().__init__(
            f"the health check failed on node(s) {', '.join(nodes)}; re-forming the group without them "
            "(monitor.exclude_unhealthy)"
        )
        self.nodes, self.checks = nodes, checks

    def __reduce__(self):  # the default would pass the text as `nodes`
        return type(self), (self.nodes, self.checks)


class PeerFailed(RuntimeError):
    """Raised by every rank whose collectives were aborted because another rank of the group
    failed (`collectives.failing_together`): the failed rank's own error is the restart's
    cause, and this one says only that the rank stopped for it."""

    def __init__(self, rank: int, reason: str) -> None:
        super().__init__(f"rank {rank} stopped because another rank failed: {reason}")
        self.rank, self.reason = rank, reason

    def __reduce__(self):
        return type(self), (self.rank, self.reason)
