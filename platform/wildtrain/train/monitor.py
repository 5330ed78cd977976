"""Per-worker monitoring besides the metrics window: the new group's health check,
stragglers, and the live numbers the Ray dashboard shows per worker."""

from __future__ import annotations

import time

import ray
import torch

from wildtrain.config import ChaosConfig, MonitorConfig
from wildtrain.events import Event, HealthCheck, Straggler
from wildtrain.tracking.worker.stragglers import StragglerDetector, cannot_observe
from wildtrain.train import collectives, health
from wildtrain.train.step import StepMetrics


class Monitor:
    """The new group's health check (and, with monitor.exclude_unhealthy, the nodes to leave
    out, known to every rank), stragglers (`StragglerWatch`) and the live numbers exported
    through Ray's metrics API. Its events ride in the next report. `check_health` off: the
    group's members trained together a step ago (survivors re-formed in-process), and a
    check would lengthen their recovery by its seconds."""

    def __init__(
        self,
        monitor: MonitorConfig,
        chaos: ChaosConfig,
        rank: int,
        device: torch.device,
        *,
        run_name: str,
        min_workers: int,
        zero_stage: int,
        check_health: bool = True,
    ) -> None:
        """`run_name` labels the live numbers; `min_workers` (elastic.min_workers) bounds the
        nodes left out; `zero_stage` decides whether stragglers can be seen."""
        self.settings, self.chaos = monitor, chaos
        self.rank = rank
        self.device = device
        self.nodes = collectives.all_gather_object(ray.get_runtime_context().get_node_id())
        self.stragglers = StragglerWatch(monitor, zero_stage, self.nodes)
        self.slowed_by_chaos = chaos.slows(rank, ray.get_runtime_context().get_node_labels())
        # Rank 0's results on every rank: where rank 0's node takes its report before the
        # controller collected it, the next rank's stands in.
        self.events: list[Event] = collectives.broadcast_object(self._preflight()) if check_health else []
        self.unhealthy_nodes: list[str] = (
            health.nodes_to_exclude(self.events, min_workers) if monitor.exclude_unhealthy else []
        )
        self.live = LiveGauges(run_name, rank)

    def _preflight(self) -> list[HealthCheck]:
        """The new group's health check (train/health.py); its results, judged on rank 0."""
        drill_s = self.chaos.slow_step_s if self.slowed_by_chaos else 0.0
        rates = collectives.all_gather_floats(health.measure_matmul(self.device, drill_s))
        bandwidth = health.measure_allreduce(self.device)
        if self.rank != 0:
            return []
        ranks = [health.RankHealth(r, self.nodes[r], float(rate)) for r, rate in enumerate(rates)]
        return health.judge(ranks, bandwidth, self.settings.health_min_ratio, time.time())

    def step_done(self, step: int, window: StepMetrics) -> None:
        self.events += self.stragglers.step_done(step, window)

    def export(self, metrics: dict) -> None:
        self.live.set(metrics)

    def take_events(self) -> list[Event]:
        events, self.events = self.events, []
        return events


class StragglerWatch:
    """Every rank's busy time gathered every `monitor.straggler_every` steps and judged on
    every rank alike (not under ZeRO-3, see `tracking.worker.stragglers`). The controller
    logs rank 0's reports; where rank 0's node takes one before the controller collected it,
    the next rank's report stands in, and carries the same stragglers."""

    def __init__(self, monitor: MonitorConfig, zero_stage: int, nodes: list[str]) -> None:
        self.every, self.nodes = monitor.straggler_every, nodes
        # None: the busy times cannot show a straggler (the driver records why, once).
        self.detector = (
            None
            if cannot_observe(zero_stage)
            else StragglerDetector(monitor.straggler_factor, monitor.straggler_patience)
        )
        self.busy_at_last_check = 0.0

    def step_done(self, step: int, window: StepMetrics) -> list[Straggler]:
        if self.detector is None or step % self.every:
            return []
        busy_s = window.busy_s  # on CUDA this waits for the device: only on check steps
        gathered = collectives.all_gather_floats(busy_s - self.busy_at_last_check)
        self.busy_at_last_check = busy_s
        at = time.time()
        return [
            Straggler(
                at,
                step,
                slow.rank,
                self.nodes[slow.rank],
                round(slow.factor, 2),
                slow.intervals,
                f"rank {slow.rank} on node {self.nodes[slow.rank]} {slow.factor:.1f}x slower than the median",
            )
            for slow in self.detector.observe([float(t) for t in gathered])
        ]


class LiveGauges:
    """A worker's live numbers on Ray's metrics endpoint (and so its dashboard), one series
    per run and rank: `ray_wildtrain_loss{run=..., rank=...}` and the like."""

    KEYS = ("loss", "tokens_per_s", "step_time_s", "mfu", "time/data_wait_s")

    def __init__(self, run: str, rank: int) -> None:
        from ray.util.metrics import Gauge

        tags = {"run": run, "rank": str(rank)}
        self.gauges = {
            key: Gauge(
                f"wildtrain_{key.replace('/', '_')}",
                description=f"wildtrain {key} of the newest report",
                tag_keys=tuple(tags),
            ).set_default_tags(tags)
            for key in self.KEYS
        }

    def set(self, metrics: dict) -> None:
        for key, gauge in self.gauges.items():
            if key in metrics:
                gauge.set(metrics[key])
