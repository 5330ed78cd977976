"""Pre-flight health check of every new worker group, before its first step.

Each rank times a short burst of matmuls on its device; the group times all-reduces of a
buffer. A rank whose matmul rate is below `min_ratio` of the group's median (a throttled GPU,
a node whose cores someone else is using) fails the check. Every rank's result becomes a
`health` event (node, check, passed, detail) in MLflow, which the cluster report card counts.
With `monitor.exclude_unhealthy`, the nodes of failed ranks are left out of the run
(`nodes_to_exclude`; the exclusion itself is `elastic.ElasticPolicy`'s).
`judge` and `nodes_to_exclude` are pure; `measure_matmul` and `measure_allreduce` do the timing.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

MATMUL_SIZE = 512
MATMUL_REPEATS = 20
ALLREDUCE_BYTES = 16 << 20
ALLREDUCE_REPEATS = 3


@dataclass(frozen=True)
class RankHealth:
    rank: int
    node: str
    matmul_flops_per_s: float


def measure_matmul(device: torch.device, extra_s: float = 0.0) -> float:
    """FLOP/s of this rank's device over a burst of square matmuls; `extra_s` is added to
    each (a chaos drill's slow rank, as it is to each forward pass)."""
    a = torch.randn(MATMUL_SIZE, MATMUL_SIZE, device=device)
    b = torch.randn(MATMUL_SIZE, MATMUL_SIZE, device=device)
    torch.mm(a, b)  # allocation and thread start-up are not the device's speed
    _sync(device)
    started = time.perf_counter()
    for _ in range(MATMUL_REPEATS):
        torch.mm(a, b)
        time.sleep(extra_s)
    _sync(device)
    return MATMUL_REPEATS * 2.0 * MATMUL_SIZE**3 / (time.perf_counter() - started)


def measure_allreduce(device: torch.device) -> float:
    """Bus bandwidth in GB/s of all-reducing a buffer over the group (the NCCL-tests
    convention: bytes × 2(n-1)/n per second)."""
    world = dist.get_world_size()
    buffer = torch.ones(ALLREDUCE_BYTES // 4, device=device)
    dist.all_reduce(buffer)
    _sync(device)
    started = time.perf_counter()
    for _ in range(ALLREDUCE_REPEATS):
        dist.all_reduce(buffer)
    _sync(device)
    seconds = (time.perf_counter() - started) / ALLREDUCE_REPEATS
    return ALLREDUCE_BYTES * 2 * (world - 1) / max(world, 1) / seconds / 1e9


def judge(ranks: list[RankHealth], allreduce_gb_per_s: float, min_ratio: float, at: float) -> list[dict]:
    """The `health` events of one group's check."""
    median = statistics.median(r.matmul_flops_per_s for r in ranks)
    events = []
    for r in ranks:
        ratio = r.matmul_flops_per_s / median if median > 0 else 1.0
        events.append({
            "event": "health", "at": at, "check": "matmul", "rank": r.rank, "node": r.node,
            "passed": ratio >= min_ratio,
            "detail": f"{r.matmul_flops_per_s / 1e9:.1f} GFLOP/s, {ratio:.2f}x the group median",
        })
    events.append({"event": "health", "at": at, "check": "allreduce", "rank": -1, "node": "group",
                   "passed": True, "detail": f"{allreduce_gb_per_s:.2f} GB/s bus bandwidth, {len(ranks)} ranks"})
    return events


def nodes_to_exclude(events: list[dict], min_workers: int) -> list[str]:
    """The nodes of the ranks that failed the check, or none if leaving them out would
    leave fewer than `min_workers` ranks: a slow group beats no group."""
    ranks = [e for e in events if e["check"] == "matmul"]
    failed = sorted({e["node"] for e in ranks if not e["passed"]})
    kept = sum(e["node"] not in failed for e in ranks)
    return failed if failed and kept >= min_workers else []


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
