"""Ray Train wiring for a worker group that shrinks when nodes die and grows back.

Ray Train restarts the group at whatever size in [min_workers, max_workers] the cluster
can hold; the training loop re-plans its batch for that size. What is tuned here is how
quickly that happens: how long a group start may wait for a dead node's worker, and how
often a healthy but smaller group looks for room to grow, and which nodes a group may not
use because they failed its health check.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

import ray
from ray.exceptions import RayActorError
from ray.train import FailureConfig, ScalingConfig
from ray.train.v2.api.exceptions import WorkerGroupError

from wildtrain import ray_compat
from wildtrain.checkpoint import reshard
from wildtrain.checkpoint.manifest import Store, read_manifest
from wildtrain.config import Config
from wildtrain.tracking.timeline import Restart

def data_cpus(cfg: Config) -> float:
    """The CPUs Ray Data's reads need beside the training workers, which hold theirs for the
    whole run: one read task (`data.read_cpus`) at a time at least, or the pipeline, and
    with it training, waits forever."""
    return cfg.data.read_cpus


def largest_group(total: dict[str, float], per_worker: dict[str, float], max_workers: int) -> int:
    """The most workers, up to `max_workers`, that resources `total` hold: the size Ray Train
    starts a group at when the whole cluster is free (at most: it also counts per node)."""
    return min([max_workers] + [int(total.get(name, 0) // amount) for name, amount in per_worker.items() if amount > 0])


# How long the end of a run waits for a conversion ahead of a resize to commit.
_CONVERSION_SHUTDOWN_WAIT_S = 60.0


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

    def __init__(self, nodes: list[str], checks: list[dict]) -> None:
        super().__init__(
            f"the health check failed on node(s) {', '.join(nodes)}; re-forming the group without them "
            f"(monitor.exclude_unhealthy)\n{self.MARKER} {json.dumps({'nodes': nodes, 'checks': checks})}"
        )
        self.nodes, self.checks = nodes, checks

    def __reduce__(self):  # Ray pickles it to the controller; the default would pass only the text
        return type(self), (self.nodes, self.checks)


def classify_restart(error: BaseException | None) -> Restart:
    """Why the controller is restarting the group, from its error: Ray's summary of the
    workers' exceptions (truncated), and each worker's own traceback text, whole."""
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
        excluded = [{"event": "node_excluded", "at": at, "node": node, "reason": f"node {node} failed the pre-flight health check; left out of the run"}
                    for node in nodes]
        return Restart("failure", f"health check failed on node(s) {', '.join(nodes)}; left out of the run",
                       planned=True, events=[check for f in found for check in f["checks"]] + excluded)
    return Restart("failure", text.splitlines()[0][:500] if text else "", planned=False)


def excluded_nodes(run_name: str) -> set[str]:
    """The nodes left out of this run, in Ray's key-value store: the controller writes them,
    every worker group reads them when it looks for room to grow."""
    value = ray_compat.kv_get(_exclusion_key(run_name), _KV_NAMESPACE)
    return set(json.loads(value)) if value else set()


def exclude_nodes(run_name: str, nodes: set[str]) -> None:
    nodes = excluded_nodes(run_name) | nodes
    ray_compat.kv_put(_exclusion_key(run_name), json.dumps(sorted(nodes)), _KV_NAMESPACE)


_KV_NAMESPACE = "wildtrain"


def _exclusion_key(run_name: str) -> str:
    return f"excluded_nodes/{run_name}"


def workers_that_fit(nodes: dict[str, dict[str, float]], per_worker: dict[str, float], excluded: set[str]) -> int:
    """How many workers the nodes (id → resources) hold, leaving out the excluded ones."""
    return sum(
        min(int(resources.get(name, 0) // amount) for name, amount in per_worker.items() if amount > 0)
        for node, resources in nodes.items()
        if node not in excluded
    )


def has_room_for_another_worker(per_worker: dict[str, float], excluded: set[str]) -> bool:
    """Whether one node that is not excluded has a worker's resources free (Ray has no public
    per-node view of what is free)."""
    return workers_that_fit(ray_compat.available_resources_per_node(), per_worker, excluded) > 0


def refresh_resource_view() -> None:
    """Make Ray Train's view of the cluster's nodes current.

    Ray 2.60 sizes worker groups from the AutoscalingCoordinator actor's copy of the node
    list, which it refreshes every 20 s. Without a refresh, a group restarted after a node
    died is sized for the dead node too and waits out a whole worker-group start timeout,
    and a node that joined waits up to 20 s to be noticed by the resize check. Asking for a
    recomputed reservation refreshes that copy for every requester."""
    ray_compat.refresh_train_resource_view()


class ResourceView:
    """Refreshes the resource view (`refresh_resource_view`) without letting a failure end
    the run or stop the refreshes: a refresh only saves time, since the coordinator refreshes
    its copy by itself every 20 s. A GCS that times out under load would otherwise end the run
    from a controller hook, or silently end the refresh thread. Each distinct error is logged
    once, not once per retry."""

    def __init__(self, refresh: Callable[[], None] = refresh_resource_view) -> None:
        self._refresh = refresh
        self._logged: set[str] = set()
        self.last = float("-inf")  # time.monotonic() of the last attempt

    def refresh(self) -> bool:
        self.last = time.monotonic()
        try:
            self._refresh()
            return True
        except Exception as e:
            error = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
            if error not in self._logged:
                self._logged.add(error)
                print(f"refreshing Ray's resource view failed ({error}); Ray refreshes it every 20 s "
                      f"by itself and wildtrain keeps retrying", flush=True)
            return False

    def refresh_every(self, interval_s: float) -> threading.Thread:
        def refresh_forever() -> None:
            while True:
                time.sleep(interval_s)
                self.refresh()

        thread = threading.Thread(target=refresh_forever, name="wildtrain-resource-view", daemon=True)
        thread.start()
        return thread


def lost_a_worker_process(error: BaseException | None) -> bool:
    """Whether a failed group lost a worker's process, so a node may be gone, rather than
    only seeing the training function raise. Ray reports a worker whose process (or node)
    died, or that stopped answering, as a failed or timed-out health check wrapping the
    actor's error; an exception raised in the training function arrives as itself."""
    lost = (ray_compat.WorkerHealthCheckFailedError, ray_compat.WorkerHealthCheckTimeoutError, RayActorError)
    return any(isinstance(failure, lost) for failure in getattr(error, "worker_failures", {}).values())


@dataclass(frozen=True)
class FailureBudget:
    """The failures counted against elastic.max_failures (-1: no limit). A failure is known
    by its error: while the cluster lacks capacity, the controller re-enters its RESTARTING
    state, with the same error, at every turn of its loop."""

    max_failures: int
    failures: int = 0
    last_error: Optional[BaseException] = field(default=None, compare=False, repr=False)

    def is_new(self, error: BaseException) -> bool:
        return error is not self.last_error

    def after(self, error: BaseException, counts: bool) -> "FailureBudget":
        if not self.is_new(error):
            return self
        return replace(self, failures=self.failures + int(counts), last_error=error)

    @property
    def exceeded(self) -> bool:
        return 0 <= self.max_failures < self.failures


@dataclass(frozen=True)
class CapacityClock:
    """How long the controller has gone without capacity for a worker group, the time that
    cluster.capacity_wait_s bounds.

    It runs from the moment no group runs until one runs again (a start that succeeds, however
    slowly, ends the wait): while Ray's scaling policy sees room for fewer than min_workers,
    and through start attempts that failed. One kind of failed attempt is not counted: one
    for more than min_workers workers that timed out waiting for room, the first time at
    its size. After a node dies, Ray's resource view still counts it for up to ~30 s, so the
    first attempt may be sized for a group that cannot fit while a smaller one can; its
    time says nothing about the capacity for min_workers. A second timed-out attempt at the
    same size counts (the view is not merely stale), so the wait stays bounded."""

    min_workers: int
    waiting_since: Optional[float] = None  # time.monotonic(); None while a group runs
    attempt_started: Optional[float] = None  # the start attempt in flight, if any
    forgiven_sizes: frozenset[int] = frozenset()  # sizes whose timed-out attempt was not counted

    def running(self) -> "CapacityClock":
        return CapacityClock(self.min_workers)

    def waiting(self, now: float) -> "CapacityClock":
        return self if self.waiting_since is not None else replace(self, waiting_since=now)

    def attempt(self, now: float) -> "CapacityClock":
        return replace(self.waiting(now), attempt_started=now)

    @property
    def in_attempt(self) -> bool:
        return self.attempt_started is not None

    def attempt_failed(self, now: float, size: int, timed_out: bool) -> "CapacityClock":
        clock = replace(self.waiting(now), attempt_started=None)
        if timed_out and size > self.min_workers and size not in self.forgiven_sizes:
            return replace(clock, waiting_since=clock.waiting_since + (now - self.attempt_started),
                           forgiven_sizes=self.forgiven_sizes | {size})
        return clock

    def waited_s(self, now: float) -> float:
        return 0.0 if self.waiting_since is None else now - self.waiting_since


# Controller states in which a worker group exists and runs (or drains, or is resized), and
# those in which the controller has none and waits for a scaling decision that can start one.
_GROUP_STATES = ("RUNNING", "PREEMPTING", "RESIZING")
_WAITING_STATES = ("INITIALIZING", "RESTARTING", "RESCHEDULING")
# While it waits, Ray's controller loop turns without pausing; its scaling policy reads the
# resource view at most once a second, so refreshing it once a second loses nothing and
# keeps the loop from spinning a core.
_WAIT_REFRESH_S = 1.0


class ElasticPolicy(ray_compat.ControllerCallback, ray_compat.WorkerGroupCallback, ray_compat.ReportCallback):
    """What Ray Train's controller does not do by itself, run inside it:

    - after a failure that lost a worker's process, wait (at most `node_grace_s`) for Ray to
      mark the group's lost nodes dead; after any failure, refresh the resource view, so
      the restart is sized for what is alive (a refresh that fails is logged, never fatal);
    - refresh the resource view at the start and every `refresh_interval_s`, so the first
      group is sized for the nodes there are, and returning capacity is seen at the next
      resize check;
    - with `reshard_ahead`, convert each committed checkpoint to the universal format in a
      background thread (one at a time) and commit the copy beside it (`checkpoint.reshard`),
      so a resize, in any store, restores without converting;
    - leave out the nodes a group's health check failed (`UnhealthyNodes`): later groups
      get a label selector that avoids them and are sized for the nodes that are left;
    - end the run when no worker group has run for `capacity_wait_s` (every node gone, say)
      instead of retrying forever (`CapacityClock` says what counts as waiting), or after
      more than `max_failures` failures that were not planned regrows (-1: no limit;
      `FailureBudget`). The error ends the run like any non-retryable failure; its
      checkpoints stay where they are.
    """

    def __init__(self, cfg: Config, node_grace_s: float = 5.0) -> None:
        self.run_name = cfg.run.name
        self.min_workers = cfg.elastic.min_workers
        self.capacity_wait_s = cfg.cluster.capacity_wait_s
        self.reshard_ahead = cfg.cluster.reshard_ahead and cfg.deepspeed.zero_stage > 0
        self.storage_config = cfg.storage
        self.staging_dir = cfg.checkpoint.staging_dir
        self._converting: threading.Thread | None = None
        self.budget = FailureBudget(cfg.elastic.max_failures)
        self.capacity = CapacityClock(cfg.elastic.min_workers)
        self.view = ResourceView()
        self.refresh_interval_s = cfg.elastic.resize_check_interval_s
        self.node_grace_s = node_grace_s
        self.group_nodes: set[str] = set()

    def after_controller_start(self, train_run_context) -> None:
        # The first group too is sized from the coordinator's copy of the node list, which
        # may be up to 20 s old: nodes that joined just before the submission would be missed.
        self.view.refresh()
        self.view.refresh_every(self.refresh_interval_s)

    def after_report(self, training_report, metrics) -> None:
        committed = metrics[0].get("committed_checkpoints", [])
        if not self.reshard_ahead or not committed:
            return
        if self._converting is not None and self._converting.is_alive():
            return  # the next checkpoint will do; the restart converts whatever is missing
        store_uri, name = committed[0].rsplit("/", 1)  # the primary's copy

        def convert() -> None:
            try:
                store = Store.from_uri(store_uri, self.storage_config)
                manifest = read_manifest(store, name)
                if manifest is not None:
                    reshard.convert_in_store(store, name, manifest, self.staging_dir)
            except Exception as e:  # a failed conversion only costs the restart its time
                print(f"converting {committed[0]} ahead of a resize failed: {e}", flush=True)

        self._converting = threading.Thread(target=convert, name="wildtrain-reshard-ahead", daemon=True)
        self._converting.start()

    async def before_controller_shutdown(self) -> None:
        # A conversion cut short leaves no committed copy, only a folder retention removes
        # with its checkpoint; waiting longer would hold up the run's end for a resize that
        # may never come.
        if self._converting is not None:
            self._converting.join(timeout=_CONVERSION_SHUTDOWN_WAIT_S)

    def after_worker_group_start(self, worker_group) -> None:
        self.group_nodes = {w.node_id for w in ray_compat.group_workers(worker_group)}

    def before_controller_execute_resize_decision(self, resize_decision) -> None:
        # Ray sizes the group by every live node's resources; the excluded ones hold none of
        # its workers. (Below min_workers the start waits for capacity, as for dead nodes.)
        excluded = excluded_nodes(self.run_name)
        if excluded:
            alive = {node["NodeID"]: node["Resources"] for node in ray.nodes() if node["Alive"]}
            fit = workers_that_fit(alive, resize_decision.resources_per_worker, excluded)
            resize_decision.num_workers = max(self.min_workers, min(resize_decision.num_workers, fit))

    def on_controller_start_worker_group(self, *, scaling_config, num_workers: int) -> dict[str, str] | None:
        excluded = excluded_nodes(self.run_name)
        return {"ray.io/node-id": f"!in({','.join(sorted(excluded))})"} if excluded else None

    def after_controller_state_update(self, previous_state, current_state) -> None:
        name = ray_compat.state_name(current_state)
        now = time.monotonic()
        if name in _GROUP_STATES:
            self.capacity = self.capacity.running()
            return
        if name == "SCHEDULING":
            self.capacity = self.capacity.attempt(now)
            return
        if name not in _WAITING_STATES:  # shutting down, or done
            return
        self.capacity = self.capacity.waiting(now)
        error = getattr(current_state, "training_failed_error", None)
        if name == "RESTARTING" and self.budget.is_new(error):
            self._after_failure(error)
        elif name == "RESCHEDULING" and self.capacity.in_attempt:
            # The start attempt failed. Too big a group for a stale view, most often: let
            # the next decision see what is alive.
            size = getattr(getattr(previous_state, "scaling_decision", None), "num_workers", self.min_workers)
            timed_out = isinstance(getattr(error, "controller_failure", None), ray_compat.WorkerGroupStartupTimeoutError)
            self.capacity = self.capacity.attempt_failed(now, size, timed_out)
            self.view.refresh()
        else:  # the same wait, another turn of the controller's loop
            time.sleep(max(0.0, self.view.last + _WAIT_REFRESH_S - time.monotonic()))
            self.view.refresh()
        if self.capacity.waited_s(time.monotonic()) > self.capacity_wait_s:
            raise CapacityError(
                f"cluster.capacity_wait_s: no worker group could run for {self.capacity_wait_s:g} s "
                f"(the cluster cannot hold elastic.min_workers workers)"
            )

    def _after_failure(self, error: BaseException) -> None:
        """Once per failure of a running group: leave out the nodes its health check failed,
        count it, and size the restart for the nodes that are alive."""
        restart = classify_restart(error)
        newly_excluded = {e["node"] for e in restart.events if e["event"] == "node_excluded"}
        if newly_excluded:
            exclude_nodes(self.run_name, newly_excluded)
        # Like Ray's own policy, only workers' failures count; a group that could not
        # start in time is the capacity wait's business.
        if restart.fatal:
            raise RuntimeError(restart.cause)
        self.budget = self.budget.after(error, counts=isinstance(error, WorkerGroupError) and not restart.planned)
        if self.budget.exceeded:
            raise RuntimeError(
                f"elastic.max_failures: {self.budget.failures} failures, more than the {self.budget.max_failures} "
                f"allowed; the last: {restart.cause[:300]}"
            )
        if lost_a_worker_process(error):
            self._wait_for_lost_nodes()
        self.view.refresh()

    def _wait_for_lost_nodes(self) -> None:
        """Return once a node of the failed group is marked dead, or after the grace if the
        process died on a node that lives (a hang's exit, an out-of-memory kill)."""
        deadline = time.monotonic() + self.node_grace_s
        while time.monotonic() < deadline:
            try:
                alive = {node["NodeID"] for node in ray.nodes() if node["Alive"]}
            except Exception:  # the GCS is slow to answer: the restart's own retries take over
                return
            if not self.group_nodes <= alive:
                return
            time.sleep(0.2)


def scaling_config(cfg: Config) -> ScalingConfig:
    return ScalingConfig(
        num_workers=(cfg.elastic.min_workers, cfg.elastic.max_workers),
        use_gpu=cfg.cluster.use_gpu,
        resources_per_worker=worker_resources(cfg),
        # Growing is the workers' decision (see PlannedRegrow), not Ray's resize check.
        elastic_resize_monitor_interval_s=365 * 24 * 3600.0,
    )


def failure_config(cfg: Config) -> FailureConfig:
    # Ray would count planned regrows as failures; ElasticPolicy counts the real ones.
    return FailureConfig(max_failures=-1)


def controller_env(cfg: Config) -> None:
    """Ray Train reads its timeouts from the driver's environment and passes them on."""
    os.environ["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] = str(cfg.elastic.worker_start_timeout_s)
    os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = str(cfg.elastic.poll_interval_s)
    # Its watcher tells workers of a node's drain notice, which the training loop does not
    # read; an actor per group start, and a core_worker error line on the console each time.
    os.environ["RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"] = "0"


def worker_env(cfg: Config) -> dict[str, str]:
    return {} if cfg.cluster.use_gpu else {"DS_ACCELERATOR": "cpu"}


def worker_resources(cfg: Config) -> dict[str, float]:
    gpu = {"GPU": 1} if cfg.cluster.use_gpu else {}
    return {"CPU": cfg.cluster.cpus_per_worker, **gpu, **cfg.cluster.worker_resources}


def wait_for_capacity(cfg: Config) -> None:
    """Return once the cluster can hold `min_workers` workers plus the data pipeline;
    otherwise fail after `cluster.capacity_wait_s` instead of letting Ray wait forever. Fail
    at once where the group Ray Train would start takes the CPUs the data reads need."""
    per_worker = worker_resources(cfg)
    data = data_cpus(cfg)
    need = {name: amount * cfg.elastic.min_workers for name, amount in per_worker.items()}
    need["CPU"] += data
    deadline = time.monotonic() + cfg.cluster.capacity_wait_s
    while True:
        total = ray.cluster_resources()
        short = {name: amount for name, amount in need.items() if total.get(name, 0) < amount}
        if not short:
            break
        if time.monotonic() >= deadline:
            wanted = ", ".join(f"{amount:g} {name}" for name, amount in need.items())
            offered = ", ".join(f"{total.get(name, 0):g} {name}" for name in need)
            raise CapacityError(
                f"elastic.min_workers: {cfg.elastic.min_workers} workers need {wanted} "
                f"({data:g} CPU of it for data), but the cluster has offered only {offered} "
                f"for {cfg.cluster.capacity_wait_s:g} s; lower elastic.min_workers or add nodes"
            )
        time.sleep(1.0)
    size = largest_group(total, per_worker, cfg.elastic.max_workers)
    spare = total.get("CPU", 0) - size * per_worker.get("CPU", 0)
    if spare < data:
        raise CapacityError(
            f"elastic.max_workers: a group of {size} workers would hold {size * per_worker.get('CPU', 0):g} "
            f"of the cluster's {total.get('CPU', 0):g} CPUs, leaving {spare:g} for Ray Data's reads, which need "
            f"{data:g} (data.read_cpus); the run would wait forever. Lower elastic.max_workers or add CPUs"
        )
