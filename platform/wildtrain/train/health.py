"""Pre-flight health check of every new worker group, before its first step.

Each rank times a short burst of matmuls on its device; the group times all-reduces of a
buffer. A rank whose matmul rate is below `min_ratio` of the group's median (a throttled GPU,
a node whose cores someone else is using) fails the check. Every rank's result becomes a
`health` event (node, check, passed, detail) in MLflow, which the cluster report card counts.
With `monitor.exclude_unhealthy`, the nodes of failed ranks are left out of the run
(`nodes_to_exclude`; the exclusion itself is `elastic.controller`'s).
`judge` and `nodes_to_exclude` are pure; `measure_matmul` and `measure_allreduce` do the timing.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

import torch

from wildtrain.events import HealthCheck
from wildtrain.train import collectives


@dataclass(frozen=True)
class RankHealth:
    rank: int
    node: str
    matmul_flops_per_s: float


@dataclass(frozen=True)
class Burst:
    """How much work the check times on one kind of device. Each burst runs for a fixed
    time rather than a fixed count: twenty 512³ fp32 matmuls are ~0.1 ms of an H200's peak,
    launch jitter and not a measurement, and would exclude healthy GPUs."""

    matmul_size: int
    dtype: torch.dtype
    budget_s: float  # matmuls repeat until this much time has passed
    allreduce_bytes: int  # large enough that bus bandwidth, not latency, sets the time
    allreduce_repeats: int


def burst_for(device_type: str) -> Burst:
    if device_type == "cuda":
        # bf16 on the tensor cores, as training runs; 8192³ is ~1 ms at an H200's peak, so the
        # budget holds ~100 of them. 64 MB is past the size where NCCL reaches its bus bandwidth.
        return Burst(8192, torch.bfloat16, 0.1, 64 << 20, 5)
    # A CPU rank (gloo) has no bf16 matmul worth timing; 4 MB keeps the all-reduce short
    # on the few cores a CPU worker has.
    return Burst(512, torch.float32, 0.1, 4 << 20, 3)


def measure_matmul(device: torch.device, extra_s: float = 0.0, budget_s: float | None = None) -> float:
    """FLOP/s of this rank's device over `budget_s` (the device's `Burst` budget by default)
    of square matmuls; `extra_s` is added to each (a chaos drill's slow rank, as it is to
    each forward pass)."""
    burst = burst_for(device.type)
    budget_s = burst.budget_s if budget_s is None else budget_s
    n = burst.matmul_size
    a = torch.randn(n, n, device=device, dtype=burst.dtype)
    b = torch.randn(n, n, device=device, dtype=burst.dtype)
    torch.mm(a, b)  # allocation, kernel selection and thread start-up are not the device's speed
    _sync(device)
    # Each chunk is sized from the rate so far to end near the budget: a sync per chunk
    # rather than per matmul, so the launches stay queued.
    done, chunk, elapsed = 0, 1, 0.0
    started = time.perf_counter()
    while elapsed < budget_s:
        for _ in range(chunk):
            torch.mm(a, b)
            if extra_s:
                time.sleep(extra_s)
        _sync(device)
        done += chunk
        elapsed = time.perf_counter() - started
        chunk = max(1, math.ceil((budget_s - elapsed) / (elapsed / done)))
    return done * 2.0 * n**3 / elapsed


def measure_allreduce(device: torch.device) -> float:
    """Bus bandwidth in GB/s of all-reducing a buffer over the group (the NCCL-tests
    convention: bytes × 2(n-1)/n per second)."""
    burst = burst_for(device.type)
    world = collectives.world_size()
    buffer = torch.ones(burst.allreduce_bytes // 4, device=device)
    collectives.sum_(buffer)  # the first call sets up the communicator and its buffers
    _sync(device)
    started = time.perf_counter()
    for _ in range(burst.allreduce_repeats):
        collectives.sum_(buffer)
    _sync(device)
    seconds = (time.perf_counter() - started) / burst.allreduce_repeats
    return burst.allreduce_bytes * 2 * (world - 1) / max(world, 1) / seconds / 1e9


def judge(ranks: list[RankHealth], allreduce_gb_per_s: float, min_ratio: float, at: float) -> list[HealthCheck]:
    """The results of one group's check."""
    median = statistics.median(r.matmul_flops_per_s for r in ranks)
    checks = []
    for r in ranks:
        ratio = r.matmul_flops_per_s / median if median > 0 else 1.0
        checks.append(
            HealthCheck(
                at,
                "matmul",
                r.rank,
                r.node,
                passed=ratio >= min_ratio,
                detail=f"{r.matmul_flops_per_s / 1e9:.1f} GFLOP/s, {ratio:.2f}x the group median",
            )
        )
    checks.append(
        HealthCheck(
            at,
            "allreduce",
            -1,
            "group",
            passed=True,
            detail=f"{allreduce_gb_per_s:.2f} GB/s bus bandwidth, {len(ranks)} ranks",
        )
    )
    return checks


def nodes_to_exclude(checks: list[HealthCheck], min_workers: int) -> list[str]:
    """The nodes of the ranks that failed the check, or none if leaving them out would
    leave fewer than `min_workers` ranks: a slow group beats no group."""
    ranks = [c for c in checks if c.check == "matmul"]
    failed = sorted({c.node for c in ranks if not c.passed})
    kept = sum(c.node not in failed for c in ranks)
    return failed if failed and kept >= min_workers else []


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
