"""The one place that reaches into Ray's private or developer-only APIs (Ray 2.60), and
the one place that reads Ray Train's controller states, scaling decisions and errors.

Each use here has no public equivalent; `tests/unit/test_ray_compat.py` imports every
symbol and checks the attributes used, so a Ray upgrade that moves them fails in
seconds rather than in the middle of a run. The attributes are read directly, never with
a default: a renamed one must fail that test (or the controller), not make a failure look
like a start that timed out, or no failure at all.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
from dataclasses import dataclass
from typing import Optional

import ray
from ray._private import ray_constants
from ray.exceptions import GetTimeoutError, RayActorError
from ray.experimental import internal_kv
from ray.train._internal.utils import get_address_and_port
from ray.train.backend import Backend, BackendConfig
from ray.train.constants import DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S, TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S
from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
from ray.train.v2._internal.exceptions import (
    UserExceptionWithTraceback,
    WorkerGroupStartupTimeoutError,
    WorkerHealthCheckFailedError,
    WorkerHealthCheckTimeoutError,
)
from ray.train.v2._internal.execution import context as _train_context
from ray.train.v2._internal.execution.callback import (
    ControllerCallback,
    ReportCallback,
    WorkerGroupCallback,
)
from ray.train.v2._internal.execution.checkpoint.report_handler import ReportCallbackHandler
from ray.train.v2._internal.execution.controller import TrainController
from ray.train.v2._internal.execution.controller import state as _states
from ray.train.v2._internal.execution.training_report import _TrainingReport
from ray.train.v2._internal.execution.worker_group import DefaultPlacementGroupHandle, ExecutionGroup, WorkerGroup
from ray.train.v2._internal.execution.worker_group.poll import WorkerStatus
from ray.train.v2._internal.util import TrainingFramework, invoke_context_managers
from ray.train.v2.api import data_parallel_trainer as _trainer_module
from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer
from ray.train.v2.api.exceptions import ControllerError, WorkerGroupError
from ray.util.placement_group import PlacementGroup, placement_group

from wildtrain.resources import node_bundles, workers_held

logger = logging.getLogger(__name__)

# Ray Train's developer callback hooks (the controller's state changes, worker-group starts,
# reports) and what wildtrain reads of its controller's states, scaling decisions and errors,
# for the elastic policy and MLflow; the errors its worker groups fail with, for tests to
# stand in for what a failed group carries.
__all__ = [
    "UserExceptionWithTraceback",
    "ControllerCallback",
    "ReportCallback",
    "WorkerGroupCallback",
    "WorkerGroupStartupTimeoutError",
    "WorkerHealthCheckFailedError",
    "WorkerHealthCheckTimeoutError",
    "available_resources_per_node",
    "ControllerState",
    "controller_state",
    "counts_as_failure",
    "dashboard_url",
    "default_temp_dir",
    "group_workers",
    "keep_ray_data_stats_here",
    "kv_get",
    "kv_put",
    "kill_pending_actors",
    "live_workers",
    "lost_a_worker_process",
    "mask_worker_deaths",
    "narrow_report_gates",
    "quiet_ray_data",
    "quiet_report_log",
    "refresh_train_resource_view",
    "relay_report",
    "report_without_barrier",
    "reports_collected",
    "resize_request",
    "resize_to",
    "show_worker_errors",
    "start_timed_out",
    "worker_failures",
    "worker_lost",
    "worker_slot",
    "ProcessGroupConfig",
    "TrainerWithoutDatasets",
]


def reports_collected() -> bool:
    """On a worker: whether the controller has taken every report this worker handed to
    `ray.train.report` (Ray's result queue holds one; the controller empties it at each poll)."""
    context = _train_context.get_train_context()
    return context.current_report_index == context.report_call_index and context.get_result_queue().empty()


def report_without_barrier(metrics: dict) -> None:
    """`ray.train.report(metrics)` past Ray's report barrier, for an in-process group's
    workers. For a report without a checkpoint the barrier only hands every rank the folder
    name rank 0 wrote, and Ray never releases it without rank 0 (`set_required_ranks` of its
    `SynchronizationActor`), where the generations go on without a dead rank 0."""
    context = _train_context.get_train_context()
    with invoke_context_managers(
        [callback.on_report for callback in context.execution_context.train_context_callbacks]
    ):
        context.report_call_index += 1
        context._wait_then_report(
            _TrainingReport(checkpoint=None, metrics=metrics, validation=False), context.report_call_index
        )


def quiet_report_log() -> None:
    """Ray Train logs every report's whole metrics dict at INFO, under a logger named by its
    file path, which RunConfig's LoggingConfig does not reach; our progress lines say it."""
    logging.getLogger(_train_context.__file__).setLevel(logging.WARNING)


class _ProgressBarsOffNotice(logging.Filter):
    """Ray Data's warning, once per process, that the progress bars a dataset turned off
    (`data.stream`: they would bury the progress lines) are off."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Progress bars disabled.")


_PROGRESS_BARS_OFF_NOTICE = _ProgressBarsOffNotice()


def quiet_ray_data() -> None:
    """Ray Data's INFO lines (execution plans, "Starting execution", progress dumps) and its
    notice that progress bars are off only in its log file, not on this process's console,
    where from every worker they drown the progress lines. Ray Data names its console
    handler in the logging config it applies on import (again only in its tasks' processes)."""
    importlib.import_module("ray.data")  # applies Ray Data's logging config

    for handler in logging.getLogger("ray.data").handlers:
        if handler.name == "console":
            handler.setLevel(logging.WARNING)
            handler.addFilter(_PROGRESS_BARS_OFF_NOTICE)  # once: addFilter skips a filter it has


def keep_ray_data_stats_here() -> None:
    """Start Ray Data's stats actor (one per cluster, detached) on this process's node unless
    one is alive. Ray Data pins it to the node of the first process that reads, a worker's:
    when that node dies, a new one starts beside the survivors as they re-form, taking CPU
    from them (docs/benchmarks.md). The driver's node lives as long as the run."""
    from ray.data._internal.stats import get_or_create_stats_actor  # Ray Data's import only where used

    get_or_create_stats_actor()


class TrainerWithoutDatasets(DataParallelTrainer):
    """Ray Train's trainer (a `ProcessGroupConfig` makes it TorchTrainer's, without torch
    imported where it does not train), less the dataset manager it starts for every worker group
    whether or not it was given datasets: a process of its own importing Ray Train, CPU
    taken from every attempt's start (docs/decisions/ray-internals.md), and wildtrain's
    workers read their datasets themselves (`data.stream`), never through
    `get_dataset_shard`. With `bundle_per_node`, its worker groups place a bundle a node
    (`NodeBundleWorkerGroup`)."""

    def __init__(self, *args, bundle_per_node: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.bundle_per_node = bundle_per_node

    def _create_default_callbacks(self):
        callbacks = super()._create_default_callbacks()
        return callbacks if self.datasets else [c for c in callbacks if not isinstance(c, DatasetsCallback)]

    def _initialize_and_run_controller(self, **controller_init_kwargs):
        # Ray Train makes its controller actor of the class its module names at the call.
        controller = NodeBundleController if self.bundle_per_node else TrainController
        with _module_attribute(_trainer_module, "TrainController", controller):
            return super()._initialize_and_run_controller(**controller_init_kwargs)


@contextlib.contextmanager
def _module_attribute(module, name: str, value):
    before = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, before)


class NodeBundleWorkerGroup(WorkerGroup):
    """Ray Train's worker group placed a bundle a node, STRICT_SPREAD (NODE_BUNDLES): each
    holds one node's workers (`resources.node_bundles`), each worker placed in it by index. A
    bundle lost with its node then fits no node left, and Ray 2.60's GCS waits for a node to
    register rather than retrying it without pause (bench/pg_storm.py --several)."""

    def _create_placement_group(self, scaling_config, worker_group_context):
        per_worker = worker_group_context.resources_per_worker
        held = [workers_held(totals, per_worker) for totals in alive_node_totals().values()]
        self._bundle_sizes = node_bundles(worker_group_context.num_workers, held)
        bundles = [{name: amount * size for name, amount in per_worker.items()} for size in self._bundle_sizes]
        # Ray Train's label selectors are per worker (the nodes left out: elastic.controller.NodeExclusion).
        selectors = worker_group_context.label_selector
        first_workers = [sum(self._bundle_sizes[:index]) for index in range(len(bundles))]
        return DefaultPlacementGroupHandle(
            placement_group(
                bundles,
                strategy="STRICT_SPREAD",
                bundle_label_selector=[selectors[first] for first in first_workers] if selectors else None,
            )
        )

    def _create_workers(
        self, num_workers, placement_group, resources_per_worker, placement_group_bundle_indices=None, **kwargs
    ):
        if placement_group_bundle_indices is None:  # a group's start: its workers by their node's bundle
            placement_group_bundle_indices = [
                index for index, size in enumerate(self._bundle_sizes) for _ in range(size)
            ]
        return super()._create_workers(
            num_workers, placement_group, resources_per_worker, placement_group_bundle_indices, **kwargs
        )


class NodeBundleController(TrainController):
    worker_group_cls = NodeBundleWorkerGroup


def dashboard_url() -> Optional[str]:
    """The dashboard of the cluster this process joined, if it has one."""
    return ray._private.worker.get_dashboard_url() or None


def default_temp_dir() -> str:
    """Ray's default temporary folder, where `ray.cluster_utils.Cluster` records its address
    whatever temporary folder its head was given."""
    from ray._common.utils import get_default_ray_temp_dir

    return get_default_ray_temp_dir()


def kv_get(key: str, namespace: str) -> Optional[bytes]:
    return internal_kv._internal_kv_get(key, namespace=namespace)


def kv_put(key: str, value: str, namespace: str) -> None:
    internal_kv._internal_kv_put(key, value, overwrite=True, namespace=namespace)


def alive_node_totals() -> dict[str, dict[str, float]]:
    """The total resources of each node Ray counts alive, by node id."""
    return {node["NodeID"]: node["Resources"] for node in ray.nodes() if node["Alive"]}


def available_resources_per_node() -> dict[str, dict[str, float]]:
    """What is free on each node (Ray has no public per-node view of it)."""
    from ray._private.state import available_resources_per_node as per_node

    return per_node()


def refresh_train_resource_view(timeout_s: float = 10) -> None:
    """Make the AutoscalingCoordinator, which Ray Train sizes worker groups from, recompute
    its copy of the node list (refreshed by itself only every 20 s)."""
    from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
        get_or_create_autoscaling_coordinator,
    )

    coordinator = get_or_create_autoscaling_coordinator()
    ray.get(coordinator.get_reserved_resources.remote("wildtrain-refresh", recompute=True), timeout=timeout_s)


# The class name of Ray Train's worker actors (its `RayTrainWorker`), as the GCS lists it.
TRAIN_WORKER_CLASS = "RayTrainWorker"


def kill_pending_actors(class_name: str = TRAIN_WORKER_CLASS) -> int:
    """Kill this job's actors of `class_name` (Ray Train's workers) still waiting to be
    created; how many. Ray Train 2.60 waits for a group's actors without a timeout once its
    placement group is ready (`WorkerGroup._create_workers`): where a node died in between,
    they and the controller wait forever. A killed actor fails that wait, which Ray reports
    as a failed start and retries. Called in the controller's process, which owns them."""
    from ray._private.state import actors
    from ray._raylet import ActorID

    job = ray.get_runtime_context().get_job_id()
    core_worker = ray._private.worker.global_worker.core_worker
    killed = 0
    for state in ("PENDING_CREATION", "DEPENDENCIES_UNREADY"):
        for actor in actors(job_id=ray.JobID.from_hex(job), actor_state_name=state).values():
            if actor["ActorClassName"] == class_name:
                core_worker.kill_actor(ActorID.from_hex(actor["ActorID"]), True)
                killed += 1
    return killed


@dataclass(frozen=True)
class ControllerState:
    """What wildtrain reads of a Ray Train controller state."""

    name: str  # INITIALIZING, SCHEDULING, RUNNING, RESTARTING, ...
    # The failure the state holds (RESTARTING, RESCHEDULING, ERRORED): a `WorkerGroupError`
    # or a `ControllerError`. Its identity tells a new failure from one seen again.
    error: Optional[BaseException] = None
    workers: Optional[int] = None  # the group size Ray decided on (SCHEDULING, RESIZING)


_FAILED_STATES = (_states.RestartingState, _states.ReschedulingState, _states.ErroredState)
_SCALING_STATES = (_states.SchedulingState, _states.ResizingState)


def controller_state(state) -> ControllerState:
    """A controller state, as `after_controller_state_update` hands it to callbacks."""
    error = state.training_failed_error if isinstance(state, _FAILED_STATES) else None
    workers = resize_request(state.scaling_decision).workers if isinstance(state, _SCALING_STATES) else None
    return ControllerState(state._state_type.state_name, error, workers)


@dataclass(frozen=True)
class ResizeRequest:
    """A group size Ray's scaling policy decided on, before the controller starts the group."""

    workers: int
    per_worker: dict[str, float]  # the resources of each worker


def resize_request(decision) -> ResizeRequest:
    return ResizeRequest(decision.num_workers, decision.resources_per_worker)


def resize_to(decision, workers: int) -> None:
    """Start the group at `workers` rather than the size decided (in
    `before_controller_execute_resize_decision`, the one hook that may change it)."""
    decision.num_workers = workers


def worker_failures(error: Optional[BaseException]) -> dict[int, BaseException]:
    """Each failed worker's exception, by rank, of a worker group's failure; none for
    another error (a group that could not start, or None). An exception the training
    function raised is the one it raised, with its fields: the worker pickles it to the
    controller with its traceback's text, and Ray unwraps it (`WorkerGroupPollStatus.errors`)."""
    return error.worker_failures if isinstance(error, WorkerGroupError) else {}


def counts_as_failure(error: Optional[BaseException]) -> bool:
    """Whether the error is the workers' own, which Ray's failure policy counts (and
    wildtrain's, unless planned), rather than the controller's (a group that could not start)."""
    return isinstance(error, WorkerGroupError)


def start_timed_out(error: Optional[BaseException]) -> bool:
    """Whether a group's start failed because its workers found no room in time."""
    return isinstance(error, ControllerError) and isinstance(error.controller_failure, WorkerGroupStartupTimeoutError)


def lost_a_worker_process(error: Optional[BaseException]) -> bool:
    """Whether a failed group lost a worker's process, so a node may be gone, rather than
    only seeing the training function raise. Ray reports a worker whose process (or node)
    died, or that stopped answering, as a failed or timed-out health check wrapping the
    actor's error; an exception raised in the training function arrives as itself."""
    return any(worker_lost(failure) for failure in worker_failures(error).values())


def worker_lost(failure: BaseException) -> bool:
    """Whether one worker's failure is the loss of its process (see `lost_a_worker_process`)."""
    return isinstance(failure, (WorkerHealthCheckFailedError, WorkerHealthCheckTimeoutError, RayActorError))


@dataclass(frozen=True)
class GroupWorker:
    rank: int
    node_id: str
    pid: int


def group_workers(worker_group) -> list[GroupWorker]:
    """The workers of a started group, in rank order."""
    workers = [
        GroupWorker(w.distributed_context.world_rank, w.metadata.node_id, w.metadata.pid)
        for w in worker_group.get_workers()
    ]
    return sorted(workers, key=lambda w: w.rank)


def worker_slot(worker_group, rank: int) -> tuple[PlacementGroup, int]:
    """The placement group of a started group and the bundle in it that Ray placed the worker
    of `rank` on: Ray places a bundle whose node died again once a node has room."""
    worker = next(w for w in worker_group.get_workers() if w.distributed_context.world_rank == rank)
    return worker_group._worker_group_state.placement_group_handle.placement_group, worker.placement_group_bundle_index


def narrow_report_gates(worker_group, ranks: list[int]) -> None:
    """Let the reports of `ranks` alone through the controller's report consolidation, as Ray
    2.60 narrows it for a preempted node's lost workers. Ray's other gate, the workers'
    barrier, is left as it is: an in-process group's workers report past it
    (`report_without_barrier`)."""
    _report_handler(worker_group).set_required_ranks(ranks)


def relay_report(worker_group, poll_status, rank: int, metrics: Optional[dict]) -> None:
    """Show the controller the lost worker of `rank` as running in a poll's status, and hand
    Ray's consolidation `metrics` (if any: a joiner's, `elastic.relay`) as its next report,
    which it takes at the next poll (it looks at one before every other callback)."""
    poll_status.worker_statuses[rank] = _LostWorkerStatus(running=True)
    if metrics is not None:
        report = _TrainingReport(checkpoint=None, metrics=metrics, validation=False)
        _report_handler(worker_group)._training_report_queues[rank].append(report)


def _report_handler(worker_group) -> ReportCallbackHandler:
    return next(c for c in worker_group._callbacks if isinstance(c, ReportCallbackHandler))


@dataclass
class _LostWorkerStatus(WorkerStatus):
    """A status shown to the controller in place of a worker whose process is lost, so that
    the group's shutdown still knows it lost (`TorchConfigOfLiveWorkers`)."""


def _shown_lost(status: WorkerStatus) -> bool:
    """Whether a poll's status is of a worker whose process is lost: as Ray shows it, or as
    shown in its place (masked, relayed or with a joiner's error)."""
    return isinstance(status, _LostWorkerStatus) or worker_lost(status.error)


def mask_worker_deaths(poll_status, ranks: set[int]) -> None:
    """Show the controller the workers of `ranks` as ended without error in a poll's status,
    before it decides on it: their deaths are the group's own business (it went on without
    them), not a failure for Ray to restart the group for."""
    for rank in ranks:
        poll_status.worker_statuses[rank] = _LostWorkerStatus(running=False)


def show_worker_errors(poll_status, errors: dict[int, Exception]) -> None:
    """Show the controller `errors` in place of those of the same failed ranks in a poll's
    status, before it decides on it: where the error it would record says less."""
    for rank, error in errors.items():
        shown = poll_status.worker_statuses[rank]
        if shown.error is not None:
            status = _LostWorkerStatus if _shown_lost(shown) else WorkerStatus
            poll_status.worker_statuses[rank] = status(running=False, error=error)


class _Workers(ExecutionGroup):
    """Some of a started worker group's workers, as a group to run functions on."""

    def __init__(self, group: WorkerGroup, workers: list) -> None:
        self._group, self._workers = group, workers

    def _assert_active(self) -> None:
        self._group._assert_active()

    def get_workers(self) -> list:
        return self._workers

    def get_resources_per_worker(self) -> dict:
        return self._group.get_resources_per_worker()


def live_workers(worker_group: WorkerGroup) -> _Workers:
    """The workers of a group but those its latest poll showed lost (all before any poll)."""
    poll = worker_group.get_latest_poll_status()
    lost = set() if poll is None else {rank for rank, status in poll.worker_statuses.items() if _shown_lost(status)}
    return _Workers(worker_group, [w for rank, w in enumerate(worker_group.get_workers()) if rank not in lost])


@dataclass
class ProcessGroupConfig(BackendConfig):
    """What wildtrain uses of Ray's TorchConfig: a torch process group of each worker group,
    rendezvoused at rank 0's address (`env://`), made without importing torch in the
    processes that never train. Ray's TorchConfig and its backend import torch at their
    tops, and the driver (which makes the config) and Ray Train's controller (which runs the
    backend) would each import it before every run's first step (docs/benchmarks.md#start-up).
    The workers set up and shut down their process groups with Ray's own functions."""

    backend: str = "gloo"
    timeout_s: int = 1800

    @property
    def backend_cls(self):
        return _ProcessGroupBackend

    @property
    def train_func_context(self):
        return _device_context

    @property
    def framework(self):
        return TrainingFramework.TORCH


@contextlib.contextmanager
def _device_context():
    """Ray's TorchConfig's context around the training function: the worker's CUDA device."""
    from ray.train.torch.config import TorchConfigContextManager  # a worker, which imports torch anyway

    with TorchConfigContextManager():
        yield


def _join_process_group(address: str, port: int, backend: str, rank: int, world_size: int, timeout_s: int) -> None:
    from ray.train.torch import config  # a worker, which imports torch anyway

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = address, str(port)
    config._set_torch_distributed_env_vars()
    config._setup_torch_process_group(backend, rank, world_size, "env://", timeout_s)


def _leave_process_group(destroy: bool) -> None:
    from ray.train.torch.config import _shutdown_torch  # a worker, which imports torch anyway

    _shutdown_torch(destroy_process_group=destroy)


class _ProcessGroupBackend(Backend):
    """Ray's `_TorchBackend`, for `env://` on the backend the config names, in a module
    that does not import torch; and its shutdown runs on the workers still alive only: Ray's
    asks every worker, and a lost one's ActorDiedError puts a traceback on the console
    (`BackendSetupCallback`), even of a run that went on without it and finished. A genuine
    failure there still shows as Ray's warning."""

    share_cuda_visible_devices = True

    def on_start(self, worker_group, backend_config: ProcessGroupConfig) -> None:
        address, port = worker_group.execute_single(0, get_address_and_port)
        world_size = len(worker_group)
        ray.get(
            [
                worker_group.execute_single_async(
                    rank,
                    _join_process_group,
                    address,
                    port,
                    backend_config.backend,
                    rank,
                    world_size,
                    backend_config.timeout_s,
                )
                for rank in range(world_size)
            ]
        )

    def on_shutdown(self, worker_group, backend_config: ProcessGroupConfig) -> None:
        futures = live_workers(worker_group).execute_async(_leave_process_group, destroy=len(worker_group) > 1)
        timeout_s = ray_constants.env_integer(
            TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S, DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S
        )
        try:
            ray.get(futures, timeout=timeout_s)
        except GetTimeoutError:
            logger.warning(f"Torch process group shutdown timed out after {timeout_s} seconds")
