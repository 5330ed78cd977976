"""What the cluster's resources allow, pure: whether work goes on GPUs (`choose_device`), how
many workers a node holds (`workers_held`) and how a NODE_BUNDLES group's workers fill a
bundle a node (`node_bundles`). Below everything that asks: the driver's choices
(`elastic.scaling`), the worker group that places the bundles (`ray_compat`) and the
evaluations' tasks (`evals.remote`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional


@dataclass(frozen=True)
class DeviceChoice:
    use_gpu: bool
    # One line for the user where the choice leaves the cluster's GPUs idle.
    note: Optional[str] = None


def choose_device(use_gpu: Optional[bool], cluster_gpus: float) -> DeviceChoice:
    """Whether the workers train on GPUs, from `cluster.use_gpu` and the GPUs the cluster
    offers: unset (None), on GPUs exactly when it offers some. Training on CPU beside
    offered GPUs takes an explicit `use_gpu=false` (said in one line); an explicit true on a
    cluster without GPUs stands here, and `elastic.scaling.wait_for_capacity` refuses it if none come."""
    if use_gpu is None:
        return DeviceChoice(cluster_gpus > 0)
    if not use_gpu and cluster_gpus > 0:
        gpus = f"{cluster_gpus:g} GPU{'' if cluster_gpus == 1 else 's'}"
        return DeviceChoice(False, f"cluster.use_gpu=false: training on CPU, beside the cluster's {gpus}")
    return DeviceChoice(use_gpu)


def workers_held(node: Mapping[str, float], per_worker: Mapping[str, float]) -> int:
    """How many workers of `per_worker` a node of total resources `node` holds."""
    return int(min(node.get(name, 0.0) // amount for name, amount in per_worker.items() if amount > 0))


def node_bundles(workers: int, held: list[int]) -> list[int]:
    """How many of `workers` workers each bundle of a NODE_BUNDLES group holds, on nodes
    that hold `held` workers each: the largest nodes filled first, a bundle a node. Workers
    beyond what the nodes hold go in bundles of the largest node's size, placed once such
    nodes join."""
    sizes, left = [], workers
    for size in sorted((h for h in held if h > 0), reverse=True):
        if left == 0:
            break
        sizes.append(min(size, left))
        left -= sizes[-1]
    largest = max(held, default=0) or 1
    while left > 0:
        sizes.append(min(largest, left))
        left -= sizes[-1]
    return sizes
