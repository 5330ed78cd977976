"""Ray Train wiring for a worker group that shrinks when nodes die and grows back.

Ray Train restarts the group at whatever size in [min_workers, max_workers] the cluster
can hold; the training loop re-plans its batch for that size. What is tuned here is how
quickly that happens: how long a group start may wait for a dead node's worker, and how
often a healthy but smaller group looks for room to grow.
"""

from __future__ import annotations

import os
import time

import ray
from ray.train import FailureConfig, ScalingConfig
from ray.train.v2._internal.execution.callback import ControllerCallback

from wildtrain.config import Config

# Ray Data's read and tokenize tasks need CPUs the training workers do not hold;
# without one to spare the data pipeline waits forever.
DATA_CPUS = 1


class CapacityError(RuntimeError):
    pass


class CapacityWatch(ControllerCallback):
    """Ends the run when no worker group has run for `capacity_wait_s` (every node gone,
    say); Ray Train alone would retry forever. It runs in the controller, whose retries
    change its state every `elastic.worker_start_timeout_s`, so the wait is checked at
    least that often. The error ends the run like any non-retryable failure; the run's
    checkpoints stay where they are."""

    def __init__(self, capacity_wait_s: float) -> None:
        self.capacity_wait_s = capacity_wait_s
        self.last_running = time.monotonic()

    def after_controller_state_update(self, previous_state, current_state) -> None:
        if current_state._state_type.state_name in ("RUNNING", "INITIALIZING"):
            self.last_running = time.monotonic()
        elif not current_state.is_terminal() and time.monotonic() - self.last_running > self.capacity_wait_s:
            raise CapacityError(
                f"cluster.capacity_wait_s: no worker group could run for {self.capacity_wait_s:g} s "
                f"(the cluster cannot hold elastic.min_workers workers)"
            )


def scaling_config(cfg: Config) -> ScalingConfig:
    return ScalingConfig(
        num_workers=(cfg.elastic.min_workers, cfg.elastic.max_workers),
        use_gpu=cfg.cluster.use_gpu,
        resources_per_worker=worker_resources(cfg),
        elastic_resize_monitor_interval_s=cfg.elastic.resize_check_interval_s,
    )


def failure_config(cfg: Config) -> FailureConfig:
    return FailureConfig(max_failures=cfg.elastic.max_failures)


def controller_env(cfg: Config) -> None:
    """Ray Train reads its timeouts from the driver's environment and passes them on."""
    os.environ["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] = str(cfg.elastic.worker_start_timeout_s)
    os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = str(cfg.elastic.poll_interval_s)


def worker_env(cfg: Config) -> dict[str, str]:
    return {} if cfg.cluster.use_gpu else {"DS_ACCELERATOR": "cpu"}


def worker_resources(cfg: Config) -> dict[str, float]:
    return {"CPU": cfg.cluster.cpus_per_worker, **cfg.cluster.worker_resources}


def wait_for_capacity(cfg: Config) -> None:
    """Return once the cluster can hold `min_workers` workers plus the data pipeline;
    otherwise fail after `cluster.capacity_wait_s` instead of letting Ray wait forever."""
    need = {name: amount * cfg.elastic.min_workers for name, amount in worker_resources(cfg).items()}
    need["CPU"] += DATA_CPUS
    if cfg.cluster.use_gpu:
        need["GPU"] = cfg.elastic.min_workers
    deadline = time.monotonic() + cfg.cluster.capacity_wait_s
    while True:
        total = ray.cluster_resources()
        short = {name: amount for name, amount in need.items() if total.get(name, 0) < amount}
        if not short:
            return
        if time.monotonic() >= deadline:
            wanted = ", ".join(f"{amount:g} {name}" for name, amount in need.items())
            offered = ", ".join(f"{total.get(name, 0):g} {name}" for name in need)
            raise CapacityError(
                f"elastic.min_workers: {cfg.elastic.min_workers} workers need {wanted} "
                f"({DATA_CPUS} CPU of it for data), but the cluster has offered only {offered} "
                f"for {cfg.cluster.capacity_wait_s:g} s; lower elastic.min_workers or add nodes"
            )
        time.sleep(1.0)
