"""Ray's private symbols that wildtrain relies on still exist with the attributes it reads,
and only `ray_compat` reads them: a Ray upgrade that moves or renames one fails here, in
seconds, instead of misreading a failure in a run's controller."""

import dataclasses
import inspect
import logging
import re
import threading
import time
import types
from pathlib import Path

from ray import cloudpickle as ray_cloudpickle
from ray._common import utils as ray_common_utils
from ray._private import state as private_state
from ray._private import worker as private_worker
from ray.data._internal.cluster_autoscaler import default_autoscaling_coordinator as coordinator
from ray.exceptions import ActorDiedError
from ray.experimental import internal_kv
from ray.train.torch import TorchTrainer
from ray.train.torch import config as torch_config
from ray.train.v2._internal.execution import context as train_context
from ray.train.v2._internal.execution.callback import ControllerCallback, ReportCallback, WorkerGroupCallback
from ray.train.v2._internal.execution.controller import state as controller_state
from ray.train.v2._internal.execution.controller.controller import TrainController
from ray.train.v2._internal.execution.scaling_policy.scaling_policy import ResizeDecision
from ray.train.v2._internal.execution.worker_group.placement_group_handle import PlacementGroupHandle
from ray.train.v2._internal.execution.worker_group.poll import WorkerGroupPollStatus, WorkerStatus
from ray.train.v2._internal.execution.worker_group.state import WorkerGroupState
from ray.train.v2._internal.execution.worker_group.thread_runner import ThreadRunner
from ray.train.v2._internal.execution.worker_group.worker import Worker
from ray.train.v2._internal.execution.worker_group.worker_group import WorkerGroup
from ray.train.v2.api import data_parallel_trainer
from ray.train.v2.api.exceptions import ControllerError

from wildtrain import ray_compat
from wildtrain.elastic import restarts
from wildtrain.elastic.signals import UnhealthyNodes
from wildtrain.events import HealthCheck
from wildtrain.ray_compat import (
    ControllerState,
    WorkerGroupStartupTimeoutError,
    WorkerHealthCheckFailedError,
    WorkerHealthCheckTimeoutError,
)


def test_every_name_the_compat_module_exports_exists():
    assert all(hasattr(ray_compat, name) for name in ray_compat.__all__)


def test_the_train_context_still_exposes_the_report_queue_and_indexes():
    fields = {f.name for f in dataclasses.fields(train_context.TrainContext)}
    assert {"current_report_index", "report_call_index"} <= fields
    assert callable(train_context.TrainContext.get_result_queue)
    assert callable(train_context.get_train_context)
    assert train_context.__file__.endswith("context.py")


def test_the_private_functions_used_still_exist():
    assert callable(private_worker.get_dashboard_url)
    assert callable(private_state.available_resources_per_node)
    assert callable(internal_kv._internal_kv_get) and callable(internal_kv._internal_kv_put)
    assert callable(coordinator.get_or_create_autoscaling_coordinator)
    assert callable(ray_common_utils.get_default_ray_temp_dir)


def test_the_controller_hooks_keep_their_names_and_signatures():
    assert list(inspect.signature(ControllerCallback.after_controller_state_update).parameters) == [
        "self",
        "previous_state",
        "current_state",
    ]
    assert "worker_group" in inspect.signature(WorkerGroupCallback.after_worker_group_start).parameters
    assert list(inspect.signature(ReportCallback.after_report).parameters)[:3] == ["self", "training_report", "metrics"]


def _group_error(*errors: Exception):
    """A worker group's failure, as Ray's controller makes it from a poll of its workers."""
    statuses = {rank: WorkerStatus(running=False, error=e) for rank, e in enumerate(errors)}
    return WorkerGroupPollStatus(statuses).get_worker_group_error()


def test_controller_state_reads_each_state_ray_makes():
    failed, decision = _group_error(ValueError("bad batch")), ResizeDecision(3, {"CPU": 2.0})
    read = ray_compat.controller_state
    assert read(controller_state.InitializingState()) == ControllerState("INITIALIZING")
    assert read(controller_state.SchedulingState(decision)) == ControllerState("SCHEDULING", workers=3)
    assert read(controller_state.RunningState()) == ControllerState("RUNNING")
    assert read(controller_state.ResizingState(decision)) == ControllerState("RESIZING", workers=3)
    for name, state in {
        "RESTARTING": controller_state.RestartingState,
        "RESCHEDULING": controller_state.ReschedulingState,
        "ERRORED": controller_state.ErroredState,
    }.items():
        held = read(state(failed))
        assert (held.name, held.workers) == (name, None) and held.error is failed
    assert read(controller_state.ShuttingDownState(controller_state.FinishedState())) == ControllerState(
        "SHUTTING_DOWN"
    )
    assert read(controller_state.FinishedState()) == ControllerState("FINISHED")
    assert read(controller_state.AbortedState()) == ControllerState("ABORTED")


def test_interpret_knows_every_state_of_rays_controller():
    """A state Ray adds would otherwise read as the end of the run."""
    assert {t.state_name for t in controller_state.TrainControllerStateType} == set(restarts.CONTROLLER_STATES)


def test_the_errors_of_a_failed_group_read_as_ray_makes_them():
    died = WorkerHealthCheckFailedError("A worker health check failed.", failure=ActorDiedError())
    crashed = _group_error(ValueError("bad batch"), RuntimeError("Connection closed by peer"))
    lost = _group_error(RuntimeError("Connection closed by peer"), died)
    hung = _group_error(WorkerHealthCheckTimeoutError("no answer"))
    # What the controller's loop makes of a group whose start timed out.
    timed_out = ControllerError(WorkerGroupStartupTimeoutError(num_workers=2))

    assert {rank: str(e) for rank, e in ray_compat.worker_failures(crashed).items()} == {
        0: "bad batch",
        1: "Connection closed by peer",
    }
    assert ray_compat.worker_failures(timed_out) == {} and ray_compat.worker_failures(None) == {}
    assert ray_compat.counts_as_failure(crashed) and not ray_compat.counts_as_failure(timed_out)
    assert ray_compat.start_timed_out(timed_out)
    assert not ray_compat.start_timed_out(ControllerError(ValueError("a callback failed")))
    assert not ray_compat.start_timed_out(crashed) and not ray_compat.start_timed_out(None)
    assert ray_compat.lost_a_worker_process(lost) and ray_compat.lost_a_worker_process(hung)
    assert not ray_compat.lost_a_worker_process(crashed) and not ray_compat.lost_a_worker_process(timed_out)


def test_a_workers_exception_reaches_the_controller_as_the_one_it_raised():
    """The controller reads signals by their type and fields (`elastic.restarts.classify_restart`),
    never from text: Ray must hand it each worker's exception itself, not its traceback's text."""
    check = HealthCheck(1.0, "matmul", 1, "slow", False, "0.2x")

    def train_fn():
        raise UnhealthyNodes(["slow"], [check])

    runner = ThreadRunner()  # how a Ray Train worker runs the training function
    runner.run(train_fn)
    while runner.is_running():
        time.sleep(0.01)
    # The worker's poll answers with its status, serialized across to the controller.
    status = ray_cloudpickle.loads(ray_cloudpickle.dumps(WorkerStatus(running=False, error=runner.get_error())))
    failed = WorkerGroupPollStatus({0: status}).get_worker_group_error()
    (raised,) = ray_compat.worker_failures(failed).values()
    assert isinstance(raised, UnhealthyNodes) and (raised.nodes, raised.checks) == (["slow"], [check])


def test_a_resize_decision_is_read_and_resized_where_ray_reads_its_size_after_the_hook():
    decision = ResizeDecision(num_workers=4, resources_per_worker={"CPU": 2.0})
    assert ray_compat.resize_request(decision) == ray_compat.ResizeRequest(4, {"CPU": 2.0})
    ray_compat.resize_to(decision, 2)
    assert ray_compat.resize_request(decision).workers == 2
    source = inspect.getsource(TrainController._execute_resize_decision)
    assert source.index('"before_controller_execute_resize_decision"') < source.index(
        "num_workers=decision.num_workers"
    )


# Reads of Ray Train's controller states, scaling decisions and errors (and of the Ray core
# errors its worker groups carry), and imports of Ray's private modules.
_RAY_READS = re.compile(
    r"(?<!ray_compat)\.(training_failed_error|scaling_decision|controller_failure|worker_failures|health_check_failure|_state_type"
    r"|state_name|num_workers|resources_per_worker)\b"
    r"|[\"'](training_failed_error|scaling_decision|controller_failure|worker_failures|_state_type|num_workers)[\"']"
    r"|\bresize_decision\.\w+"
    r"|isinstance\([^)]*\b(ray_compat\.\w+|WorkerGroupError|ControllerError|TrainingFailedError|PreemptionError"
    r"|NCCLHangError|RayActorError|ActorDiedError|WorkerHealthCheck\w*Error|WorkerGroupStartupTimeoutError"
    r"|(Initializing|Scheduling|Rescheduling|Running|Preempting|Restarting|Resizing|ShuttingDown|Errored|Finished"
    r"|Aborted)State)\b"
    r"|ray\.train\.v2\._internal|ray\.train\.v2\.api\.exceptions|ray\._private|ray\.experimental"
)


def test_no_module_but_ray_compat_reads_rays_controller_states_or_errors():
    for removed in (
        'error = getattr(current_state, "training_failed_error", None)',
        'size = getattr(getattr(previous_state, "scaling_decision", None), "num_workers", 1)',
        "resize_decision.num_workers = max(self.min_workers, fit)",
        "return any(isinstance(failure, lost) for failure in getattr(error, 'worker_failures', {}).values())",
        "counts=isinstance(error, WorkerGroupError) and not restart.planned",
        "timed_out = isinstance(error, ray_compat.WorkerGroupStartupTimeoutError)",
        "from ray.train.v2.api.exceptions import WorkerGroupError",
    ):
        assert _RAY_READS.search(removed), removed  # what the scan is for
    package = Path(ray_compat.__file__).parent
    found = [
        f"{path.relative_to(package)}:{number}: {line.strip()}"
        for path in sorted(package.rglob("*.py"))
        if path.name != "ray_compat.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if _RAY_READS.search(line)
    ]
    assert found == [], "read these through ray_compat"


def test_workers_carry_what_group_workers_and_worker_slot_read():
    fields = {f.name for f in dataclasses.fields(Worker)}
    assert {"distributed_context", "metadata", "placement_group_bundle_index"} <= fields
    assert "placement_group_handle" in {f.name for f in dataclasses.fields(WorkerGroupState)}
    assert isinstance(inspect.getattr_static(PlacementGroupHandle, "placement_group"), property)


def test_ray_train_still_makes_its_controller_and_places_its_workers_where_node_bundles_step_in():
    """`NodeBundleWorkerGroup` replaces the placement group Ray Train's worker group makes and
    the bundle each worker goes in, through the controller's class and its worker group's."""
    assert data_parallel_trainer.TrainController is TrainController, "the name the trainer makes its controller of"
    starts = data_parallel_trainer.DataParallelTrainer._initialize_and_run_controller
    assert "(TrainController)" in inspect.getsource(starts)
    assert TrainController.worker_group_cls is WorkerGroup
    assert issubclass(ray_compat.NodeBundleController, TrainController)
    assert list(inspect.signature(WorkerGroup._create_placement_group).parameters) == [
        "self",
        "scaling_config",
        "worker_group_context",
    ]
    assert list(inspect.signature(WorkerGroup._create_workers).parameters)[:5] == [
        "self",
        "num_workers",
        "placement_group",
        "resources_per_worker",
        "placement_group_bundle_indices",
    ]
    start = inspect.getsource(WorkerGroup._start_impl)
    assert "self._create_placement_group(" in start
    assert "placement_group_bundle_indices" not in start, "a start places worker i in bundle i unless told"


def test_every_hook_our_callbacks_define_is_one_ray_calls_with_those_parameters():
    """A hook Ray renamed would never be called, silently: each of ours must still be a
    method of a Ray callback base, taking the same parameters."""
    from wildtrain.elastic.controller import ControllerEvents, NodeExclusion, ReshardAhead, RestartPolicy

    bases = (ControllerCallback, ReportCallback, WorkerGroupCallback)
    for ours in (ControllerEvents, RestartPolicy, NodeExclusion, ReshardAhead):
        hooks = [name for name in vars(ours) if name.startswith(("after_", "before_", "on_"))]
        assert hooks, ours
        for name in hooks:
            rays = [getattr(base, name) for base in bases if hasattr(base, name)]
            assert rays, f"{ours.__name__}.{name} is not a hook of Ray's callbacks"
            assert list(inspect.signature(getattr(ours, name)).parameters) == list(
                inspect.signature(rays[0]).parameters
            ), f"{ours.__name__}.{name} no longer matches Ray's signature"


def test_ray_data_info_lines_and_progress_bar_notice_leave_the_console_and_stay_in_the_log_file():
    ray_compat.quiet_ray_data()
    ray_compat.quiet_ray_data()  # each attempt's workers call it
    handlers = logging.getLogger("ray.data").handlers
    [console] = [h for h in handlers if h.name == "console"]
    assert console.level == logging.WARNING and len(console.filters) == 2  # Ray Data's own, and ours
    files = [h for h in handlers if h.name == "file"]
    assert files and all(h.level < logging.INFO for h in files)

    def shown(level: int, message: str) -> bool:
        record = logging.getLogger("ray.data._internal.progress").makeRecord(
            "ray.data._internal.progress", level, __file__, 0, message, (), None
        )
        return record.levelno >= console.level and bool(console.filter(record))

    assert not shown(logging.INFO, "Starting execution of Dataset dataset_0")
    assert not shown(logging.WARNING, "Progress bars disabled. To enable, set `ray.data.DataContext...`")
    assert shown(logging.WARNING, "Ray Data cannot schedule its read tasks: no CPUs left")


def test_the_trainer_starts_no_dataset_manager_without_datasets_and_ray_still_builds_one():
    def names(trainer) -> list[str]:
        return [type(c).__name__ for c in trainer._create_default_callbacks()]

    # Ray still adds it by that method (else dropping it would have stopped mattering) ...
    assert "DatasetsCallback" in names(TorchTrainer(lambda: None))
    # ... and wildtrain's trainer leaves it out, keeping everything else.
    ours = names(ray_compat.TrainerWithoutDatasets(lambda: None))
    assert "DatasetsCallback" not in ours
    assert ours == [name for name in names(TorchTrainer(lambda: None)) if name != "DatasetsCallback"]
    assert "DatasetsCallback" in names(ray_compat.TrainerWithoutDatasets(lambda: None, datasets={"rows": [1]}))


def test_ray_data_still_pins_its_stats_actor_to_the_node_of_the_process_that_asks_first():
    """`keep_ray_data_stats_here` relies on it: the driver asks first, so it lives on the driver's node."""
    from ray.data._internal.stats import get_or_create_stats_actor

    source = inspect.getsource(get_or_create_stats_actor)
    assert "get_if_exists=True" in source and 'lifetime="detached"' in source
    assert "ray.get_runtime_context().get_node_id()" in source


def test_a_stuck_worker_group_start_can_still_be_ended():
    """`kill_pending_actors` lists actors from the GCS and kills them by id, looking for Ray
    Train's worker class by name; the wait it ends has no timeout of its own in Ray 2.60
    (when one comes, RestartPolicy's start watchdog can go), and the start runs every
    callback's `on_worker_group_start` around it."""
    from ray._raylet import ActorID, CoreWorker
    from ray.train.v2._internal.execution.worker_group.worker import RayTrainWorker
    from ray.train.v2._internal.execution.worker_group.worker_group import WorkerGroup

    assert RayTrainWorker.__name__ == ray_compat.TRAIN_WORKER_CLASS
    assert callable(private_state.actors) and callable(ActorID.from_hex) and hasattr(CoreWorker, "kill_actor")
    assert "ray.get([actor.get_metadata.remote() for actor in actors])" in inspect.getsource(
        WorkerGroup._create_workers
    )
    assert "callback.on_worker_group_start" in inspect.getsource(WorkerGroup._start_impl)


def test_a_worker_death_can_be_masked_and_the_report_gates_narrowed_where_ray_reads_them():
    """What keeps a group going without a dead worker (`elastic.survivors`): its status masked
    in the poll's callbacks, before the controller decides on it; Ray's report consolidation
    narrowed to the survivors, as Ray narrows it for a preemption."""
    from ray.train.v2._internal.execution.checkpoint.report_handler import ReportCallbackHandler
    from ray.train.v2._internal.execution.worker_group.worker_group import WorkerGroup

    died = WorkerHealthCheckFailedError("A worker health check failed.", failure=ActorDiedError())
    assert ray_compat.worker_lost(died) and not ray_compat.worker_lost(ValueError("bad batch"))
    status = WorkerGroupPollStatus(
        {0: WorkerStatus(running=False), 1: WorkerStatus(running=False, error=died), 2: WorkerStatus(running=False)}
    )
    assert status.errors and not TrainController._is_training_succeeded(status)
    ray_compat.mask_worker_deaths(status, {1})
    assert not status.errors and TrainController._is_training_succeeded(status)
    # A rank whose joiner failed: its death stands, shown with the joiner's error (running ranks keep theirs).
    status.worker_statuses[1] = WorkerStatus(running=False, error=died)
    joiner_failed = RuntimeError("the worker that joined on rank 1's slot failed")
    ray_compat.show_worker_errors(status, {1: joiner_failed, 0: RuntimeError("not failed")})
    assert status.errors == {1: joiner_failed} and not TrainController._is_training_succeeded(status)
    poll = inspect.getsource(WorkerGroup.poll_status)
    assert poll.index("callback.after_worker_group_poll_status") < poll.index("return worker_group_poll_status")

    group = types.SimpleNamespace(_callbacks=[ReportCallbackHandler(report_callbacks=[])])  # what narrowing touches
    ray_compat.narrow_report_gates(group, [1, 2])
    assert group._callbacks[0]._get_required_ranks() == [1, 2]
    assert "self._callbacks = " in inspect.getsource(WorkerGroup.__init__)


def test_a_report_past_the_barrier_lands_in_rays_result_queue_in_order_as_ray_s_own_report_would(monkeypatch):
    """An in-process group's workers report past Ray's barrier (`report_without_barrier`):
    without a synchronization actor to ask, the report still goes to the worker's result
    queue as Ray's own would, through its train-context callbacks, and the report indexes
    that `reports_collected` reads move as Ray's report moves them."""
    import contextlib
    import queue

    from ray.train.v2._internal.execution.training_report import _TrainingReport

    entered = []

    class Callback:
        @contextlib.contextmanager
        def on_report(self):
            entered.append("report")
            yield

    execution = train_context.ExecutionContext(
        synchronization_actor=None,
        result_queue=queue.Queue(maxsize=1),
        training_thread_runner=None,
        train_context_callbacks=[Callback()],
    )
    rank_1 = types.SimpleNamespace(world_rank=1)  # all `_wait_then_report` reads of it, for its log line
    context = train_context.TrainContext(
        None, rank_1, execution, None, None, None, None, report_order_condition=threading.Condition()
    )
    monkeypatch.setattr(train_context, "_train_context", context)
    ray_compat.report_without_barrier({"step": 1})
    assert entered == ["report"] and not ray_compat.reports_collected()
    reported = execution.result_queue.get_nowait()
    assert isinstance(reported, _TrainingReport)
    assert (reported.checkpoint, reported.metrics, reported.validation) == (None, {"step": 1}, False)
    assert ray_compat.reports_collected()
    assert (context.report_call_index, context.current_report_index) == (1, 1)
    # Ray's own report asks the barrier, which has no rank 0 to hand out when rank 0 died.
    report = inspect.getsource(train_context.TrainContext.report)
    assert report.index("self.report_call_index += 1") < report.index("_sync_checkpoint_dir_name_across_ranks(")
    assert report.index("_sync_checkpoint_dir_name_across_ranks(") < report.index(
        "self._wait_then_report(training_report, report_call_index)"
    )
    assert "if 0 not in expected" in inspect.getsource(train_context.SynchronizationActor.set_required_ranks)


def test_the_backends_shutdown_leaves_out_the_workers_shown_lost_and_ray_still_shuts_down_through_it():
    """`ProcessGroupConfig`: a group's backend shutdown runs on the workers its latest
    poll did not show lost, as Ray shows a lost one or as the survivors show one in its place
    (masked, relayed, or with its joiner's error); Ray's own asks every worker, and logs a
    traceback for each dead one, even after a run that went on without it and finished."""
    from ray.train.v2._internal.callbacks.backend_setup import BackendSetupCallback
    from ray.train.v2._internal.execution.worker_group.state import WorkerGroupContext
    from ray.train.v2._internal.execution.worker_group.worker_group import WorkerGroup

    died = WorkerHealthCheckFailedError("A worker health check failed.", failure=ActorDiedError())
    statuses = {rank: WorkerStatus(running=False, error=died) for rank in range(4)}
    statuses[4] = WorkerStatus(running=False)  # finished, alive
    statuses[5] = WorkerStatus(running=False, error=ValueError("bad batch"))  # raised, alive
    status = WorkerGroupPollStatus(statuses)
    ray_compat.mask_worker_deaths(status, {0})
    ray_compat.relay_report(None, status, 1, None)
    ray_compat.show_worker_errors(status, {2: RuntimeError("the worker that joined on rank 2's slot failed")})
    ray_compat.show_worker_errors(status, {5: RuntimeError("shown in its place")})
    assert status.errors.keys() == {2, 3, 5} and status.worker_statuses[1].running

    group = WorkerGroup.__new__(WorkerGroup)  # a started group, as far as its backend's shutdown reads it
    group._worker_group_context = WorkerGroupContext("attempt", None, 6, {"CPU": 1})
    workers = [Worker(actor=None, metadata=None, resources={"CPU": 1}) for _ in range(6)]
    group._worker_group_state = WorkerGroupState(0.0, None, workers, None)
    group._latest_poll_status = None
    assert ray_compat.live_workers(group).get_workers() == workers, "before any poll: every worker"
    group._latest_poll_status = status
    live = ray_compat.live_workers(group)
    assert live.get_workers() == workers[4:] and len(live) == 2
    assert live.get_resources_per_worker() == {"CPU": 1}

    # Where Ray makes the backend of the config it was given, calls its shutdown, and logs a failure.
    assert "BackendSetupCallback(self.backend_config)" in inspect.getsource(TorchTrainer._create_default_callbacks)
    assert "backend_config.backend_cls()" in inspect.getsource(BackendSetupCallback.__init__)
    shutdown = inspect.getsource(BackendSetupCallback.before_execution_group_shutdown)
    assert "self._backend.on_shutdown(execution_group, self._backend_config)" in shutdown
    assert "Graceful shutdown of backend failed" in shutdown and "exc_info=True" in shutdown
    # The group's latest poll is the one its callbacks masked, still readable as it shuts down.
    poll = inspect.getsource(WorkerGroup.poll_status)
    assert poll.index("callback.after_worker_group_poll_status") < poll.index("self._latest_poll_status = ")
    group_shutdown = inspect.getsource(WorkerGroup.shutdown)
    assert group_shutdown.index("callback.before_worker_group_shutdown(self)") < group_shutdown.index(
        "self._clear_state()"
    )


def test_the_process_group_backend_does_what_rays_torch_backend_does_for_env_rendezvous():
    """`ProcessGroupConfig` stands in for Ray's TorchConfig without importing torch where it
    does not train: its backend runs the steps of Ray's for `env://`, through Ray's own
    worker functions, with the same CUDA-device sharing, context and framework."""
    ours = ray_compat.ProcessGroupConfig(backend="gloo", timeout_s=5)
    rays = torch_config.TorchConfig(backend="gloo", timeout_s=5)
    assert ours.backend_cls.share_cuda_visible_devices is rays.backend_cls.share_cuda_visible_devices is True
    assert ours.framework == rays.framework
    assert rays.train_func_context is torch_config.TorchConfigContextManager
    start = inspect.getsource(torch_config._TorchBackend.on_start)
    for step in (
        "worker_group.execute_single(\n                0, get_address_and_port",
        'os.environ["MASTER_ADDR"] = addr',
        'os.environ["MASTER_PORT"] = str(port)',
        'url = "env://"',
        "worker_group.execute(_set_torch_distributed_env_vars)",
        "_setup_torch_process_group,",
    ):
        assert step in start, step
    assert list(inspect.signature(torch_config._setup_torch_process_group).parameters) == [
        "backend",
        "world_rank",
        "world_size",
        "init_method",
        "timeout_s",
    ]
    assert list(inspect.signature(torch_config._shutdown_torch).parameters) == ["destroy_process_group"]
    shutdown = inspect.getsource(torch_config._TorchBackend.on_shutdown)
    assert "_shutdown_torch,\n            destroy_process_group=len(worker_group) > 1" in shutdown
    assert "TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S" in shutdown
