"""What Ray Train's controller does not do by itself, as callbacks that run inside it, one
per concern: the driver's storage settings, what happens to the run read once and told to
its consumers in order (`ControllerEvents`), restarts (failures counted, lost nodes awaited,
capacity waited for, the resource view kept fresh), nodes left out, checkpoints converted
ahead of a resize, and checkpoints evaluated beside training."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import dataclass, replace
from typing import Callable, Optional, Sequence

import ray

from wildtrain import ray_compat
from wildtrain.checkpoint import reshard
from wildtrain.checkpoint.format import step_of
from wildtrain.checkpoint.store import Store, read_manifest
from wildtrain.config import Config
from wildtrain.controller_events import (
    Consumer,
    GroupStarted,
    Noted,
    Reported,
    Stage,
    StateChanged,
    in_stage_order,
)
from wildtrain.elastic.nodes import (
    ResourceView,
    alive_nodes,
    exclude_nodes,
    excluded_nodes,
    workers_that_fit,
)
from wildtrain.elastic.restarts import CapacityClock, FailureBudget, decide, interpret, seen
from wildtrain.elastic.signals import CapacityError
from wildtrain.events import EvalFailed, EvalSkipped, Event, Waiting
from wildtrain.ray_compat import alive_node_totals
from wildtrain.tracking.controller.mlflow_run import MlflowRecorder
from wildtrain.tracking.controller.progress import ProgressLines
from wildtrain.tracking.controller.timeline import Timeline
from wildtrain.worker_report import rank_zero

# How long the end of a run waits for a conversion ahead of a resize to commit.
_CONVERSION_SHUTDOWN_WAIT_S = 60.0


# While it waits, Ray's controller loop turns without pausing; its scaling policy reads the
# resource view at most once a second, so refreshing it once a second loses nothing and
# keeps the loop from spinning a core.
_WAIT_REFRESH_S = 1.0


def controller_callbacks(cfg: Config, mlflow: MlflowRecorder, evaluation=None) -> list:
    """The controller callbacks of a run; `mlflow` records to its MLflow run; `evaluation`
    (an `evals.remote.EvalPlan`), where eval.tasks are set."""
    policy = RestartPolicy(cfg, mlflow.record_event)
    callbacks = [ControllerEvents([ProgressLines(cfg.train.steps), mlflow, policy]), policy, NodeExclusion(cfg)]
    if cfg.checkpoint.reshard_ahead and cfg.deepspeed.zero_stage > 0:
        callbacks.append(ReshardAhead(cfg))
    if evaluation is not None:
        callbacks.append(EvalEvery(cfg, evaluation, mlflow))
    return callbacks


class ControllerEvents(ray_compat.ControllerCallback, ray_compat.WorkerGroupCallback, ray_compat.ReportCallback):
    """The one reader of what happens to the run in the controller: a worker group's start,
    each change of the controller's state (`restarts.interpret`, once), and each of rank 0's
    reports, with the run's elastic timeline (`Timeline`) kept from them. Each is told, typed
    (`controller_events`), to `consumers` in the order of their stage: the progress lines,
    the MLflow record, the restart policy."""

    def __init__(self, consumers: Sequence[Consumer]) -> None:
        self.consumers = in_stage_order(consumers)
        self.timeline = Timeline()

    def after_worker_group_start(self, worker_group) -> None:
        workers = ray_compat.group_workers(worker_group)
        started = GroupStarted([w.node_id for w in workers], [w.pid for w in workers])
        self.timeline.group_started(started.nodes)
        for consumer in self.consumers:
            consumer.group_started(started)

    def after_controller_state_update(self, previous_state, current_state) -> None:
        transition = interpret(seen(previous_state), seen(current_state))
        entries = ()
        kind = transition.interruption
        if kind is not None and not transition.again:
            interruption = self.timeline.interrupted(kind, time.time(), transition.cause)
            # Once per failed group, even within one outage: a failed health check's results, the nodes left out.
            carried = tuple(Noted(event) for event in transition.events)
            entries = carried if interruption is None else (interruption, *carried)
        change = StateChanged(transition, entries)
        for consumer in self.consumers:
            consumer.state_changed(change)

    def after_report(self, training_report, metrics) -> None:
        report = rank_zero(metrics)
        reported = Reported(report, self.timeline.reported(report))
        for consumer in self.consumers:
            consumer.reported(reported)

    def after_controller_finish(self, result) -> None:
        self._ended()

    def before_controller_abort(self) -> None:
        self._ended()

    def _ended(self) -> None:
        for consumer in self.consumers:
            consumer.ended()


class StorageSettings(ray_compat.ControllerCallback):
    """Gives the controller's process the storage settings the driver resolved
    (`storage.handover_env`), before anything in it reads the store. Ray starts the
    controller with the cluster node's environment and a fixed list of Ray's own variables,
    and has no runtime env for it as it has for workers. What the controller starts in turn
    gets them from it: a reshard's subprocess by inheritance, an evaluation's task from
    `evals.remote.submit`. Goes first among the run's callbacks."""

    def __init__(self, env: dict[str, str]) -> None:
        self._env = env  # holds the keys: never in a repr or a log

    def after_controller_start(self, train_run_context) -> None:
        os.environ.update(self._env)


class RestartPolicy(Consumer, ray_compat.ControllerCallback, ray_compat.WorkerGroupCallback):
    """How the controller restarts a worker group (`restarts.decide` decides on what
    `ControllerEvents` tells, this acts, once the change is said and recorded):

    - after a failure that lost a worker's process, wait (at most `node_grace_s`) for Ray to
      mark the group's lost nodes dead; after any failure, refresh the resource view, so
      the restart is sized for what is alive (a refresh that fails is logged, never fatal);
    - refresh the resource view at the start, so the first group is sized for the nodes
      there are (a regrow's restart refreshes it as any restart does; nothing reads it
      while a group runs, since growing is the workers' decision);
    - leave out the nodes a group's health check failed (`UnhealthyNodes`), for
      `NodeExclusion` to keep later groups off them;
    - end a group's start that is still creating its workers 2 x `worker_start_timeout_s`
      after it began (room for the placement group is waited for at most once that
      long) once a node alive at its start is dead: a node lost between the placement
      and the workers' creation would hold them, and the controller, forever
      (`ray_compat.kill_pending_actors`); Ray then retries the start as after any failed
      one. A start that is only slow goes on;
    - end the run when no worker group has run for `capacity_wait_s` (every node gone, say)
      instead of retrying forever (`CapacityClock` says what counts as waiting), or after
      more than `max_failures` failures that were not planned regrows (-1: no limit;
      `FailureBudget`). The error ends the run like any non-retryable failure; its
      checkpoints stay where they are. A wait for room is recorded (`Waiting`) once a group
      runs again.
    """

    stage = Stage.ACT

    def __init__(self, cfg: Config, record_event: Callable[[Event], None], node_grace_s: float = 5.0) -> None:
        self.run_name = cfg.run.name
        self.capacity_wait_s = cfg.elastic.capacity_wait_s
        self.budget = FailureBudget(cfg.elastic.max_failures)
        self.capacity = CapacityClock(cfg.elastic.min_workers)
        self.view = ResourceView()
        self.node_grace_s = node_grace_s
        self.start_deadline_s = 2 * cfg.elastic.worker_start_timeout_s
        self.group_nodes: set[str] = set()
        self.record_event = record_event

    def after_controller_start(self, train_run_context) -> None:
        # The first group too is sized from the coordinator's copy of the node list, which
        # may be up to 20 s old: nodes that joined just before the submission would be missed.
        self.view.refresh()

    @contextlib.contextmanager
    def on_worker_group_start(self):
        started = threading.Event()
        threading.Thread(
            target=self._end_a_stuck_start, args=(started,), name="wildtrain-start-watchdog", daemon=True
        ).start()
        try:
            yield
        finally:
            started.set()

    def _end_a_stuck_start(self, started: threading.Event) -> None:
        """Past the deadline, end the start once a node alive when it began is dead: its
        workers would wait for that node forever. A start that is only slow (workers'
        processes starting on a loaded node, a runtime env being built) is left to finish."""
        try:
            alive_at_start: Optional[set[str]] = alive_nodes()
        except Exception:  # noqa: BLE001 - the GCS is slow to answer: past the deadline, end the start
            alive_at_start = None
        if started.wait(self.start_deadline_s):
            return
        said_failed = False
        while True:
            try:
                lost = alive_at_start is None or bool(alive_at_start - alive_nodes())
                killed = ray_compat.kill_pending_actors() if lost else 0
            except Exception as e:  # noqa: BLE001 - the GCS is slow to answer: look again
                if not said_failed:
                    print(
                        f"a worker group start outlasted {self.start_deadline_s:g} s; ending it failed: {e}", flush=True
                    )
                said_failed, lost, killed = True, False, 0
            if killed:
                print(
                    f"a worker group start outlasted {self.start_deadline_s:g} s (2 x elastic.worker_start_timeout_s) "
                    f"with {killed} worker(s) not yet created, a node lost: ended, to be retried",
                    flush=True,
                )
            if lost or started.wait(1.0):
                return

    def group_started(self, started: GroupStarted) -> None:
        self.group_nodes = set(started.nodes)

    def state_changed(self, change: StateChanged) -> None:
        decision = decide(change.transition, self.budget, self.capacity, time.monotonic())
        self.budget, self.capacity = decision.budget, decision.capacity
        if decision.waited_s is not None:
            wall = time.time()
            self.record_event(Waiting(wall, wall - decision.waited_s, wall))
        if decision.exclude:
            exclude_nodes(self.run_name, set(decision.exclude))
        if decision.end is not None:
            raise RuntimeError(decision.end)
        if decision.await_lost_nodes:
            self._wait_for_lost_nodes()
        if decision.paced:
            time.sleep(max(0.0, self.view.last + _WAIT_REFRESH_S - time.monotonic()))
        if decision.refresh:
            self.view.refresh()
        if decision.bounded and self.capacity.waited_s(time.monotonic()) > self.capacity_wait_s:
            raise CapacityError(
                f"elastic.capacity_wait_s: no worker group could run for {self.capacity_wait_s:g} s "
                f"(the cluster cannot hold elastic.min_workers workers)"
            )

    def _wait_for_lost_nodes(self) -> None:
        """Return once a node of the failed group is marked dead, or after the grace if the
        process died on a node that lives (a hang's exit, an out-of-memory kill)."""
        deadline = time.monotonic() + self.node_grace_s
        while time.monotonic() < deadline:
            try:
                alive = alive_nodes()
            except Exception:  # the GCS is slow to answer: the restart's own retries take over
                return
            if not self.group_nodes <= alive:
                return
            time.sleep(0.2)


class NodeExclusion(ray_compat.ControllerCallback, ray_compat.WorkerGroupCallback):
    """Keeps worker groups off the nodes left out of the run (`RestartPolicy` records them)."""

    def __init__(self, cfg: Config) -> None:
        self.run_name = cfg.run.name
        self.min_workers = cfg.elastic.min_workers

    def before_controller_execute_resize_decision(self, resize_decision) -> None:
        # Ray sizes the group by every live node's resources; the excluded ones hold none of
        # its workers. (Below min_workers the start waits for capacity, as for dead nodes.)
        excluded = excluded_nodes(self.run_name)
        if excluded:
            alive = alive_node_totals()
            request = ray_compat.resize_request(resize_decision)
            fit = workers_that_fit(alive, request.per_worker, excluded)
            ray_compat.resize_to(resize_decision, max(self.min_workers, min(request.workers, fit)))

    def on_controller_start_worker_group(self, *, scaling_config, num_workers: int) -> dict[str, str] | None:
        excluded = excluded_nodes(self.run_name)
        return {"ray.io/node-id": f"!in({','.join(sorted(excluded))})"} if excluded else None


class ReshardAhead(ray_compat.ReportCallback, ray_compat.ControllerCallback):
    """Converts each committed checkpoint to the universal format in a background thread (one
    at a time) and commits the copy beside it (`checkpoint.reshard`), so a resize, in any
    store, restores without converting."""

    def __init__(self, cfg: Config) -> None:
        self.storage_config = cfg.storage
        self.staging_dir = cfg.checkpoint.staging_dir
        self._converting: threading.Thread | None = None

    def after_report(self, training_report, metrics) -> None:
        committed = rank_zero(metrics).committed_checkpoints
        if not committed:
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


def eval_due(step: int, every_checkpoints: int, checkpoint_every: int, last_step: int) -> bool:
    """Whether the committed checkpoint of `step` is evaluated (eval.every_checkpoints): a
    multiple of every_checkpoints x checkpoint.every, or the last step. By step rather
    than by count, so a restart, a resize's extra checkpoint or a resubmission moves nothing."""
    return step == last_step or step % (every_checkpoints * checkpoint_every) == 0


@dataclass(frozen=True)
class EvalQueue:
    """Which checkpoint is evaluated: one evaluation at a time (each holds resources of its
    own, and a backlog would outlive its checkpoints' retention), and at most one waiting,
    the newest due: an older waiting one is skipped."""

    running: Optional[int] = None  # the step being evaluated
    waiting: Optional[int] = None  # the step due next

    def due(self, step: int) -> tuple["EvalQueue", Optional[int], Optional[int]]:
        """The queue once `step` is due; the step to start now, and the step skipped."""
        if self.running is None:
            return replace(self, running=step), step, None
        return replace(self, waiting=step), None, self.waiting

    def finished(self) -> tuple["EvalQueue", Optional[int]]:
        """The queue once the running evaluation ended; the step to start now."""
        return EvalQueue(running=self.waiting), self.waiting


# Beyond eval.timeout_s per evaluation left, what the end of a run allows for the export and logging.
_EVAL_SHUTDOWN_SLACK_S = 60.0


class EvalEvery(ray_compat.ReportCallback, ray_compat.ControllerCallback):
    """Evaluates the committed checkpoints `eval_due` names with lm-eval beside training:
    each a Ray task on resources of its own (`evals.remote.submit`), watched by a thread
    here, one at a time (`EvalQueue`). Its metrics go to the run's MLflow run at the
    checkpoint's step; a failure, whole or of some tasks, is an `EvalFailed` event and never
    the run's: no report waits for an evaluation. The end of the run waits for the
    evaluation in flight and the one due after it (eval.timeout_s each), the last
    checkpoint's among them."""

    def __init__(self, cfg: Config, plan, mlflow) -> None:
        self.cfg = cfg
        self.plan = plan
        self.mlflow = mlflow  # its Tracker and events: the run's one MLflow client in the controller
        self._lock: threading.Lock | None = None  # made in the controller: a lock does not pickle
        self._queue = EvalQueue()
        self._runner: threading.Thread | None = None
        self._closed = False  # the run's tracking is closed: nothing more is logged

    def after_controller_start(self, train_run_context) -> None:
        self._lock = threading.Lock()

    def after_report(self, training_report, metrics) -> None:
        committed = {step_of(uri.rsplit("/", 1)[-1]) for uri in rank_zero(metrics).committed_checkpoints}
        settings, train = self.plan.settings, self.cfg.train
        for step in sorted(s for s in committed if s is not None):
            if eval_due(step, settings.every_checkpoints, self.cfg.checkpoint.every, train.steps):
                self._due(step)

    def _due(self, step: int) -> None:
        with self._lock:
            self._queue, start, skipped = self._queue.due(step)
        if skipped is not None:
            self.mlflow.record_event(
                EvalSkipped(time.time(), skipped, f"step {step} came due before the evaluation in flight ended")
            )
        if start is not None:
            self._runner = threading.Thread(target=self._run, args=(start,), name="wildtrain-eval", daemon=True)
            self._runner.start()

    def _run(self, step: Optional[int]) -> None:
        while step is not None:
            self._evaluate(step)
            with self._lock:
                self._queue, step = self._queue.finished()

    def _evaluate(self, step: int) -> None:
        from ray.exceptions import GetTimeoutError

        from wildtrain.evals.remote import failure_reason, log_evaluation, submit
        from wildtrain.export import run_info

        tasks, timeout_s = list(self.plan.tasks), self.plan.settings.timeout_s
        ref = None
        try:
            ref = submit(run_info(self.cfg), step, self.plan)
            evaluated = ray.get(ref, timeout=timeout_s)
        except GetTimeoutError:
            ray.cancel(ref, force=True)
            reason = f"not done within eval.timeout_s ({timeout_s:g} s, waiting for its resources included)"
        except Exception as e:  # noqa: BLE001 - an evaluation's failure is never the run's
            reason = failure_reason(e)
        else:
            if not self._closed:
                log_evaluation(self.mlflow.tracking, evaluated)
                print(
                    f"evaluated step {evaluated.step} in {evaluated.seconds:.1f} s: "
                    + ", ".join(
                        f"{name} {value:.4g}" for name, value in evaluated.metrics.items() if "_stderr" not in name
                    ),
                    flush=True,
                )
            tasks = list(evaluated.failed)
            if not tasks:
                return
            reason = (
                "; ".join(f"{t}: {r}" for t, r in evaluated.failed.items())
                if len(tasks) > 1
                else evaluated.failed[tasks[0]]
            )
        if not self._closed:
            self.mlflow.record_event(EvalFailed(time.time(), step, tasks, reason))

    async def before_controller_shutdown(self) -> None:
        # Training is over (its workers are gone): the evaluations left have its resources too.
        runner = self._runner
        if runner is not None and runner.is_alive():
            with self._lock:
                left = sum(s is not None for s in (self._queue.running, self._queue.waiting))
            print(f"waiting for {left} evaluation{'s' if left > 1 else ''} of checkpoints", flush=True)
            runner.join(timeout=left * self.plan.settings.timeout_s + _EVAL_SHUTDOWN_SLACK_S)
            if runner.is_alive():
                print("an evaluation outlasted eval.timeout_s at the run's end; its results are not logged", flush=True)
        self._closed = True

    def before_controller_abort(self) -> None:
        self._closed = True
