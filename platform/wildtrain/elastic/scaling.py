"""The driver's side: the scaling and failure configs Ray Train gets, the environment of
its controller and workers, and the wait for a cluster that can hold the smallest group."""

from __future__ import annotations

import os
import time

import ray
from ray.train import FailureConfig, ScalingConfig

from wildtrain.config import Config
from wildtrain.elastic.signals import CapacityError


def data_cpus(cfg: Config) -> float:
    """The CPUs Ray Data's reads need beside the training workers, which hold theirs for the
    whole run: one read task (`data.read_cpus`) at a time at least, or the pipeline, and
    with it training, waits forever."""
    return cfg.data.read_cpus


def largest_group(total: dict[str, float], per_worker: dict[str, float], max_workers: int) -> int:
    """The most workers, up to `max_workers`, that resources `total` hold: the size Ray Train
    starts a group at when the whole cluster is free (at most: it also counts per node)."""
    return min([max_workers] + [int(total.get(name, 0) // amount) for name, amount in per_worker.items() if amount > 0])


def scaling_config(cfg: Config) -> ScalingConfig:
    return ScalingConfig(
        num_workers=(cfg.elastic.min_workers, cfg.elastic.max_workers),
        use_gpu=cfg.cluster.use_gpu,
        resources_per_worker=worker_resources(cfg),
        # Growing is the workers' decision (see PlannedRegrow), not Ray's resize check.
        elastic_resize_monitor_interval_s=365 * 24 * 3600.0,
    )


def failure_config(cfg: Config) -> FailureConfig:
    # Ray would count planned regrows as failures; the RestartPolicy counts the real ones.
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
