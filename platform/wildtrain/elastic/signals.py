"""What workers and the controller tell each other beyond Ray's own states: a worker
raises one of these to ask for a planned restart (a regrow, leaving out unhealthy nodes) or
to end the run, and the controller classifies each restart from the error Ray hands it.
Ray keeps only the text of workers' exceptions, so what must reach the controller rides in
the text after a marker.
"""

from __future__ import annotations

import functools
import json
import re
import time
from dataclasses import dataclass, field

from wildtrain.events import Event, HealthCheck, NodeExcluded, from_dict


@dataclass(frozen=True)
class Restart:
    """Why the controller restarts a worker group (see `classify_restart`)."""

    kind: str  # "failure" or "resize"
    cause: str
    # wildtrain's own decision (a planned regrow, leaving out unhealthy nodes), not a fault
    # of the workers: not counted against elastic.max_failures.
    planned: bool
    events: list[Event] = field(default_factory=list)  # what the restart carries for MLflow
    # A restart cannot help (`RunCannotContinue`): the run ends with `cause`.
    fatal: bool = False


class CapacityError(RuntimeError):
    pass


class PlannedRegrow(RuntimeError):
    """Raised by every worker right after a checkpoint, once the cluster has room for more
    workers: Ray Train then restarts the group at the larger size from that checkpoint, so
    growing redoes no step. (Ray's own resize check would stop the group mid-interval and
    lose the steps since the last checkpoint.) Not counted against elastic.max_failures."""


class RunCannotContinue(RuntimeError):
    """Raised by a worker when restarting the group cannot help (a shard that went bad, a
    final checkpoint that cannot commit): the controller ends the run with this message
    instead of restarting into the same error until the failure budget is spent. Ray keeps
    only the text of workers' exceptions, so the message rides in it after `MARKER`."""

    MARKER = "wildtrain-cannot-continue:"

    def __init__(self, message: str) -> None:
        super().__init__(f"{message}\n{self.MARKER} {json.dumps(message)}")
        self.message = message

    def __reduce__(self):  # Ray pickles it to the controller; the default would pass the marker twice
        return type(self), (self.message,)


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
    re-forms without them. Ray keeps only the text of workers' exceptions, so the check's
    results ride in it, as one JSON line after `MARKER`."""

    MARKER = "wildtrain-health-check:"

    def __init__(self, nodes: list[str], checks: list[HealthCheck]) -> None:
        results = {"nodes": nodes, "checks": [check.to_dict() for check in checks]}
        super().__init__(
            f"the health check failed on node(s) {', '.join(nodes)}; re-forming the group without them "
            f"(monitor.exclude_unhealthy)\n{self.MARKER} {json.dumps(results)}"
        )
        self.nodes, self.checks = nodes, checks

    def __reduce__(self):  # Ray pickles it to the controller; the default would pass only the text
        return type(self), (self.nodes, self.checks)


class PeerFailed(RuntimeError):
    """Raised by every rank whose collectives were aborted because another rank of the group
    failed (`collectives.failing_together`): the failed rank's own error is the restart's
    cause, and this one says only that the rank stopped for it."""

    MARKER = "wildtrain-peer-failed:"

    def __init__(self, rank: int, reason: str) -> None:
        super().__init__(f"{self.MARKER} rank {rank} stopped because another rank failed: {reason}")
        self.rank, self.reason = rank, reason

    def __reduce__(self):
        return type(self), (self.rank, self.reason)


def worker_error_cause(per_worker: dict) -> str:
    """`rank N: <its exception's line>` of the first worker whose failure is its own (not a
    `PeerFailed`); "" when there is none."""
    for rank, failure in sorted(per_worker.items()):
        text = str(failure).strip()
        if not text or PeerFailed.MARKER in text:
            continue
        return f"rank {rank}: {text.splitlines()[-1][:500]}"
    return ""


@functools.lru_cache(maxsize=16)
def classify_restart(error: BaseException | None) -> Restart:
    """Why the controller is restarting the group, from its error: Ray's summary of the
    workers' exceptions (truncated), and each worker's own traceback text, whole. Cached
    by the error's identity: the controller's callbacks each ask, and get one answer."""
    text = str(error).strip() if error is not None else ""
    per_worker = "\n".join(str(failure) for failure in getattr(error, "worker_failures", {}).values())
    if PlannedRegrow.__name__ in text + per_worker:
        return Restart("resize", "room for more workers", planned=True)
    fatal = re.search(rf"^{re.escape(RunCannotContinue.MARKER)} (\".*\")$", text + "\n" + per_worker, re.MULTILINE)
    if fatal:
        return Restart("failure", json.loads(fatal[1]), planned=False, fatal=True)
    # Every rank raises UnhealthyNodes; only rank 0's carries the check's results.
    found = [json.loads(m) for m in re.findall(rf"^{re.escape(UnhealthyNodes.MARKER)} (\{{.*\}})$", per_worker, re.MULTILINE)]
    if found:
        nodes = sorted({node for f in found for node in f["nodes"]})
        at = time.time()
        excluded = [NodeExcluded(at, node, f"node {node} failed the pre-flight health check; left out of the run")
                    for node in nodes]
        checks = [from_dict(check) for f in found for check in f["checks"]]
        return Restart("failure", f"health check failed on node(s) {', '.join(nodes)}; left out of the run",
                       planned=True, events=checks + excluded)
    cause = worker_error_cause(getattr(error, "worker_failures", {}))
    return Restart("failure", cause or (text.splitlines()[0][:500] if text else ""), planned=False)
