"""The driver's side: whether the run trains on GPUs, the scaling and failure configs Ray
Train gets, the environment of its controller and workers, and the wait for a cluster that
can hold the smallest group."""

from __future__ import annotations

import os
import time
from dataclasses import replace
from typing import Mapping

import ray
from ray.train import FailureConfig, ScalingConfig

from wildtrain.config import ClusterConfig, ConfigError, DataConfig, ElasticConfig, EvalConfig
from wildtrain.elastic.signals import CapacityError
from wildtrain.elastic.survivor_env import SURVIVOR_ENV
from wildtrain.resources import DeviceChoice, choose_device, workers_held


def resolve_device(cluster: ClusterConfig, offered: Mapping[str, float]) -> tuple[ClusterConfig, DeviceChoice]:
    """`cluster` with `use_gpu` decided (`choose_device`) for a cluster offering the
    resources `offered` (`ray.cluster_resources()`). The driver resolves it once, before
    anything uses it, and hands the resolved config to the workers: they, the scaling
    config, the collectives' backend and the engine all follow that one answer."""
    choice = choose_device(cluster.use_gpu, offered.get("GPU", 0.0))
    return replace(cluster, use_gpu=choice.use_gpu), choice


def trains_on_gpu(cluster: ClusterConfig) -> bool:
    """The resolved `cluster.use_gpu`. Unresolved, it is a bug: read as false it would train
    on CPU without a word, which is what resolving it prevents."""
    if cluster.use_gpu is None:
        raise RuntimeError(
            "cluster.use_gpu is still unset (auto): resolve_device() decides it against the cluster "
            "before anything uses it"
        )
    return cluster.use_gpu


def choose_placement(
    strategy: str, per_worker: Mapping[str, float], nodes: list[Mapping[str, float]], in_process: bool
) -> str:
    """The worker group's placement strategy: `strategy` (`cluster.placement_strategy`) unless
    it is auto. A PACK group's bundle whose node died fits the other nodes by their totals,
    and Ray 2.60's GCS retries it without pause until a node can take it, a core of the
    head's CPU for as long as an in-process group runs smaller (bench/pg_storm.py); the
    restart path removes the group instead. A bundle fits no node that holds one of its
    group's bundles in STRICT_SPREAD, so Ray waits for a node to register. So auto takes, where
    some of `nodes` (each node's total resources) can hold a worker of `per_worker`:
    NODE_BUNDLES for a group that recovers `in_process` (each node's workers in one bundle of
    their own, STRICT_SPREAD: `node_bundles`); else STRICT_SPREAD where no node holds two
    (PACK would place them alike); and PACK otherwise."""
    if strategy != "auto":
        return strategy
    most = max((workers_held(node, per_worker) for node in nodes), default=0)
    if most > 0 and in_process:
        return "NODE_BUNDLES"
    return "STRICT_SPREAD" if most == 1 else "PACK"


def resolve_placement(
    cluster: ClusterConfig, elastic: ElasticConfig, nodes: list[Mapping[str, float]]
) -> ClusterConfig:
    """`cluster` with `placement_strategy` decided (`choose_placement`) for a cluster of
    `nodes` (each node's total resources), as the driver hands it to Ray Train."""
    strategy = choose_placement(cluster.placement_strategy, worker_resources(cluster), nodes, elastic.in_process)
    return replace(cluster, placement_strategy=strategy)


def data_cpus(data: DataConfig) -> float:
    """The CPUs Ray Data's reads need beside the training workers, which hold theirs for the
    whole run: one read task (`data.read_cpus`) at a time at least, or the pipeline, and
    with it training, waits forever."""
    return data.read_cpus


def spare_cpus(data: DataConfig, evaluation: EvalConfig) -> float:
    """The CPUs a training group leaves free: Ray Data's reads', and, while eval.tasks are
    set, an evaluation's (eval.num_cpus). An evaluation that took the reads' CPU would hold
    it to its end, and training would wait for its data meanwhile."""
    return data_cpus(data) + (evaluation.num_cpus if evaluation.tasks else 0.0)


def largest_group(total: dict[str, float], per_worker: dict[str, float], max_workers: int) -> int:
    """The most workers, up to `max_workers`, that resources `total` hold: the size Ray Train
    starts a group at when the whole cluster is free (at most: it also counts per node)."""
    return min([max_workers] + [int(total.get(name, 0) // amount) for name, amount in per_worker.items() if amount > 0])


def scaling_config(cluster: ClusterConfig, elastic: ElasticConfig) -> ScalingConfig:
    if cluster.placement_strategy == "auto":
        raise RuntimeError(
            "cluster.placement_strategy is still auto: resolve_placement() decides it against the "
            "cluster before Ray Train gets it"
        )
    return ScalingConfig(
        num_workers=(elastic.min_workers, elastic.max_workers),
        use_gpu=trains_on_gpu(cluster),
        resources_per_worker=worker_resources(cluster),
        # NODE_BUNDLES: STRICT_SPREAD over bundles of a node's workers (ray_compat.NodeBundleWorkerGroup).
        placement_strategy="STRICT_SPREAD" if node_bundled(cluster) else cluster.placement_strategy,
        # Growing is the workers' decision (see PlannedRegrow), not Ray's resize check.
        elastic_resize_monitor_interval_s=365 * 24 * 3600.0,
    )


def node_bundled(cluster: ClusterConfig) -> bool:
    """Whether the worker group places a bundle a node (`choose_placement`'s NODE_BUNDLES)."""
    return cluster.placement_strategy == "NODE_BUNDLES"


def failure_config() -> FailureConfig:
    # Ray would count planned regrows as failures; the RestartPolicy counts the real ones.
    return FailureConfig(max_failures=-1)


def controller_env(elastic: ElasticConfig) -> None:
    """Ray Train reads its timeouts from the driver's environment and passes them on."""
    os.environ["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] = str(elastic.worker_start_timeout_s)
    os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = str(elastic.poll_interval_s)
    # Its watcher tells workers of a node's drain notice, which the training loop does not
    # read; an actor per group start, and a core_worker error line on the console each time.
    os.environ["RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"] = "0"


def backend(cluster: ClusterConfig) -> str:
    """The process groups' backend of the training workers."""
    return "nccl" if trains_on_gpu(cluster) else "gloo"


def worker_env(cluster: ClusterConfig, elastic: ElasticConfig) -> dict[str, str]:
    if not trains_on_gpu(cluster):
        return {"DS_ACCELERATOR": "cpu"}
    return dict(SURVIVOR_ENV) if elastic.in_process else {}


def worker_resources(cluster: ClusterConfig) -> dict[str, float]:
    gpu = {"GPU": 1} if trains_on_gpu(cluster) else {}
    return {"CPU": cluster.cpus_per_worker, **gpu, **cluster.worker_resources}


def shortfall(
    elastic: ElasticConfig,
    data: DataConfig,
    evaluation: EvalConfig,
    need: Mapping[str, float],
    total: Mapping[str, float],
) -> Exception:
    """The error of a capacity wait that ended with `total` short of `need`: a config error
    naming cluster.use_gpu where the workers need GPUs and the cluster offered none at all,
    else a capacity error naming elastic.min_workers."""
    wait = f"{elastic.capacity_wait_s:g} s"
    if need.get("GPU", 0) > 0 and total.get("GPU", 0) == 0:
        return ConfigError(
            f"cluster.use_gpu: true, but the cluster has offered no GPU for {wait}; unset it to train "
            f"on what the cluster offers (cluster.use_gpu=null), or add GPU nodes"
        )
    wanted = ", ".join(f"{amount:g} {name}" for name, amount in need.items())
    offered = ", ".join(f"{total.get(name, 0):g} {name}" for name in need)
    return CapacityError(
        f"elastic.min_workers: {elastic.min_workers} workers need {wanted} "
        f"({spare_cpus(data, evaluation):g} CPU of it for data{' and evaluations' if evaluation.tasks else ''}), "
        f"but the cluster has offered only {offered} "
        f"for {wait}; lower elastic.min_workers or add nodes"
    )


def wait_for_capacity(cluster: ClusterConfig, elastic: ElasticConfig, data: DataConfig, evaluation: EvalConfig) -> None:
    """Return once the cluster can hold `min_workers` workers plus the CPUs they leave free
    (`spare_cpus`); otherwise fail after `elastic.capacity_wait_s` (`shortfall`) instead of
    letting Ray wait forever. Fail at once where the group Ray Train would start takes the
    CPUs the data reads (and evaluations) need."""
    per_worker = worker_resources(cluster)
    reserved = spare_cpus(data, evaluation)
    need = {name: amount * elastic.min_workers for name, amount in per_worker.items()}
    need["CPU"] += reserved
    deadline = time.monotonic() + elastic.capacity_wait_s
    while True:
        total = ray.cluster_resources()
        short = {name: amount for name, amount in need.items() if total.get(name, 0) < amount}
        if not short:
            break
        if time.monotonic() >= deadline:
            raise shortfall(elastic, data, evaluation, need, total)
        time.sleep(1.0)
    size = largest_group(total, per_worker, elastic.max_workers)
    spare = total.get("CPU", 0) - size * per_worker.get("CPU", 0)
    if spare < reserved:
        if evaluation.tasks:
            left_for = (
                f"Ray Data's reads (data.read_cpus {data.read_cpus:g}) and an evaluation "
                f"(eval.num_cpus {evaluation.num_cpus:g}), which need {reserved:g}; training would wait for its data"
            )
        else:
            left_for = f"Ray Data's reads, which need {reserved:g} (data.read_cpus); the run would wait forever"
        raise CapacityError(
            f"elastic.max_workers: a group of {size} workers would hold {size * per_worker.get('CPU', 0):g} "
            f"of the cluster's {total.get('CPU', 0):g} CPUs, leaving {spare:g} for {left_for}. "
            "Lower elastic.max_workers or add CPUs"
        )
