"""Ray's private symbols that wildtrain relies on still exist with the attributes it reads:
a Ray upgrade that moves one fails here, in seconds."""

import dataclasses
import inspect
import logging

from ray._private import state as private_state
from ray._private import worker as private_worker
from ray.data._internal.cluster_autoscaler import default_autoscaling_coordinator as coordinator
from ray.experimental import internal_kv
from ray.train.v2._internal.execution import context as train_context
from ray.train.v2._internal.execution.callback import ControllerCallback, ReportCallback, WorkerGroupCallback
from ray.train.v2._internal.execution.controller import state as controller_state
from ray.train.v2._internal.execution.worker_group.worker import Worker

from wildtrain import ray_compat


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


def test_the_controller_hooks_keep_their_names_and_signatures():
    assert list(inspect.signature(ControllerCallback.after_controller_state_update).parameters) == [
        "self", "previous_state", "current_state"]
    assert "worker_group" in inspect.signature(WorkerGroupCallback.after_worker_group_start).parameters
    assert list(inspect.signature(ReportCallback.after_report).parameters)[:3] == ["self", "training_report", "metrics"]


def test_controller_states_carry_the_name_state_name_reads():
    running = controller_state.RunningState()
    assert ray_compat.state_name(running) == "RUNNING"


def test_workers_carry_what_group_workers_reads():
    fields = {f.name for f in dataclasses.fields(Worker)}
    assert {"distributed_context", "metadata"} <= fields


def test_every_hook_our_callbacks_define_is_one_ray_calls_with_those_parameters():
    """A hook Ray renamed would never be called, silently: each of ours must still be a
    method of a Ray callback base, taking the same parameters."""
    from wildtrain.elastic.controller import NodeExclusion, ReshardAhead, RestartPolicy
    from wildtrain.tracking.mlflow_run import MlflowCallback

    bases = (ControllerCallback, ReportCallback, WorkerGroupCallback)
    for ours in (RestartPolicy, NodeExclusion, ReshardAhead, MlflowCallback):
        hooks = [name for name in vars(ours) if name.startswith(("after_", "before_", "on_"))]
        assert hooks, ours
        for name in hooks:
            rays = [getattr(base, name) for base in bases if hasattr(base, name)]
            assert rays, f"{ours.__name__}.{name} is not a hook of Ray's callbacks"
            assert list(inspect.signature(getattr(ours, name)).parameters) == list(inspect.signature(rays[0]).parameters), \
                f"{ours.__name__}.{name} no longer matches Ray's signature"


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
            "ray.data._internal.progress", level, __file__, 0, message, (), None)
        return record.levelno >= console.level and bool(console.filter(record))

    assert not shown(logging.INFO, "Starting execution of Dataset dataset_0")
    assert not shown(logging.WARNING, "Progress bars disabled. To enable, set `ray.data.DataContext...`")
    assert shown(logging.WARNING, "Ray Data cannot schedule its read tasks: no CPUs left")

