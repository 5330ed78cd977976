"""The per-worker training function that Ray Train runs on every worker of the group.

It reads in the order it runs: plan the batch for this world size, restore the newest
checkpoint (resharding it if it was saved at another size) into a new engine, then step,
report and checkpoint until the run's last step. A worker group that Ray Train restarts
(a node died, capacity came back) re-enters here at its new size.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
import time
import warnings
from dataclasses import dataclass
from typing import Optional

import numpy as np
import psutil
import ray.train
import ray.train.torch
import torch

from wildtrain import checkpoint, ray_compat, storage
from wildtrain.batching import batch_plan
from wildtrain.checkpoint import async_save, reshard, universal
from wildtrain.checkpoint.async_save import AsyncSaver, CheckpointMeta, SaveOutcome
from wildtrain.checkpoint.manifest import (
    Candidate, CommitError, Store, needs_universal, new_attempt_token, restore,
)
from wildtrain.checkpoint.retention import RetentionPolicy
from wildtrain.config import Config, config_hash
from wildtrain.data.manifest import ShardCorrupt
from wildtrain.data.stream import RankStream
from wildtrain.elastic import (
    FinalCheckpointFailed, PlannedRegrow, RunCannotContinue, UnhealthyNodes, excluded_nodes, has_room_for_another_worker,
)
from wildtrain.engine import build_engine, build_model
from wildtrain.model import flops_per_token
from wildtrain.tracking.mfu import Peak, peak_flops
from wildtrain.tracking.stragglers import StragglerDetector
from wildtrain.train import collectives, health
from wildtrain.train.state import TrainState
from wildtrain.train.step import DeviceBatches, StepMetrics, train_step
from wildtrain.train.watchdog import HangWatchdog


def train_loop(config: dict) -> None:
    attempt_started = time.time()
    cfg: Config = config["cfg"]
    # DeepSpeed's ZeRO calls a deprecated collective once per step; the warning says nothing new.
    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*", category=FutureWarning)
    ray_compat.quiet_report_log()
    ray_compat.quiet_ray_data()
    context = ray.train.get_context()
    world_size, rank = context.get_world_size(), context.get_world_rank()
    plan = batch_plan(cfg.train.global_batch_size, cfg.train.micro_batch_size, world_size)
    data = config["data"]

    torch.manual_seed(cfg.train.seed)
    # Ray Train set this worker's CUDA device; NCCL's collectives and the batches go there.
    device = ray.train.torch.get_device() if cfg.cluster.use_gpu else torch.device("cpu")
    # From here to the first step (health check, restore, engine build) under the start-up bound.
    watchdog = HangWatchdog(cfg.monitor.hang_timeout_s, cfg.monitor.startup_timeout_s, hang_dump_folder(cfg), rank,
                            cfg.storage)
    # The health check first: a group that is about to re-form without a node should not
    # download and load a checkpoint before it finds out.
    monitor = _Monitor(cfg, rank, world_size, device)
    if monitor.unhealthy_nodes:
        raise UnhealthyNodes(monitor.unhealthy_nodes, monitor.take_events())
    health_checked = time.time()
    stores = checkpoint_stores(cfg)
    engine, state, restored = _build_and_restore(cfg, plan, world_size, rank, stores)
    restored_at = time.time()
    restored_step = state.step
    state.world_size = world_size
    saver = AsyncSaver(
        stores, cfg.checkpoint.staging_dir, rank=rank, world_size=world_size,
        attempt=collectives.broadcast_object(new_attempt_token()),
        policy=cfg.checkpoint.policy, timeout_s=cfg.checkpoint.timeout_s, verify_upload=cfg.checkpoint.verify_upload,
        retention=RetentionPolicy(cfg.checkpoint.keep_last, cfg.checkpoint.keep_every),
        known_good=[restored.candidate.key] if restored.candidate else [], commit_when_released=True,
        reports_collected=ray_compat.reports_collected,
    )
    reported_step = state.step  # the newest step whose report the controller has for sure
    # The data position is the step: the stream starts where the restored model stopped.
    stream = RankStream(data.datasets, cfg, rank, world_size, from_step=state.step)
    samples = _SampleRecorder(cfg, rank) if cfg.data.record_samples else None

    tokens_per_step = plan.global_batch_size * cfg.data.seq_len
    window = StepMetrics(tokens_per_step, flops_per_token(cfg.model, cfg.data.seq_len), _peak(cfg), world_size, device,
                         data_wait=stream)
    # Each step's batch is copied to the device while the step before it trains.
    batches = DeviceBatches((stream.next_step() for _ in range(cfg.train.steps - state.step)), device,
                            tokens=lambda step: step.tokens)
    slow_forward_s = cfg.chaos.slow_step_s if monitor.slowed_by_chaos else 0.0  # a drill (chaos.*), off by default
    growth = _GrowthCheck(world_size < cfg.elastic.max_workers, rank, config["worker_resources"],
                          cfg.elastic.resize_check_interval_s, cfg.run.name)
    try:
        while state.step < cfg.train.steps:
            try:
                tokens, batch = next(batches)
            except ShardCorrupt as e:
                raise RunCannotContinue(f"{e}; to train on without it, resubmit with data.skip_bad_shards=true "
                                        "and data.allow_order_change=true (the rows of later steps change)") from None
            train_step(engine, plan, tokens, window, slow_forward_s)
            state.step += 1
            state.tokens_seen += tokens_per_step
            watchdog.progress(state.step)
            monitor.step_done(state.step, window)
            if samples is not None:
                samples.record(state.step, batch.sample_ids)

            first_of_attempt = state.step == restored_step + 1
            last = state.step == cfg.train.steps
            log_due = last or first_of_attempt or state.step % cfg.train.log_every == 0
            # Looked for at report steps only, which synchronize the ranks anyway: no collective per step.
            grow = not last and log_due and growth.room_now()
            checkpoint_due = last or grow or state.step % cfg.train.checkpoint_every == 0
            if not (log_due or checkpoint_due):
                continue
            if checkpoint_due:
                # Every optimizer step applied exactly once across restarts, or nothing is saved.
                if engine.global_steps != state.step:
                    raise RuntimeError(f"DeepSpeed counted {engine.global_steps} optimizer steps where the run is at {state.step}")
                # A save that must commit waits on storage up to checkpoint.timeout_s, longer than a hang.
                commit_wait = (watchdog.waiting(f"the commit of step {state.step}", up_to_s=cfg.checkpoint.timeout_s)
                               if last or grow else contextlib.nullcontext())
                with window.timed("checkpoint_stall"), commit_wait:
                    # The last save is retried; a regrow's is not: training on at this size is no loss.
                    committed = _save(saver, engine, cfg, state, world_size, must_commit=last or grow, retry=last)
                if grow and not committed:
                    # Regrowing now would restart from an older checkpoint and redo steps, and a
                    # regrow is no failure, so storage trouble plus free room would loop.
                    grow = False
                    monitor.events.append({"event": "regrow_postponed", "at": time.time(), "step": state.step,
                                           "reason": f"the checkpoint of step {state.step} did not commit; "
                                                     "training on at this size"})
                elif last and not committed:
                    newest = saver.last_commit or (storage.join(*restored.candidate.key) if restored.candidate else None)
                    raise FinalCheckpointFailed(state.step, collectives.broadcast_object(newest) or "none")
            metrics = {"step": state.step, "tokens_seen": state.tokens_seen, "world_size": world_size}
            if log_due:
                epoch = (state.step - 1) // data.steps_per_epoch
                metrics |= window.flush() | {"lr": engine.get_lr()[0], "epoch": epoch}
                monitor.export(metrics)
            events = monitor.take_events()
            if first_of_attempt:
                # What the controller needs to split this attempt's recovery (and start-up) time into its parts.
                metrics |= restored.timing | {
                    "restored_step": restored_step,
                    "worker_started_at": psutil.Process().create_time(),
                    "attempt_started_at": attempt_started,
                    "health_checked_at": health_checked,
                    "restored_at": restored_at,
                    "first_step_at": time.time(),
                }
                events += restored.events
            ray.train.report(metrics | _saves_report(saver.drain(), events))
            # Ray's result queue holds one report: this one is in, so the previous one is out;
            # this one's save commits once the controller polls (`reports_collected`).
            saver.release(reported_step)
            saver.reported(state.step)
            reported_step = state.step
            if grow:
                raise PlannedRegrow(f"room for more than {world_size} workers; regrowing from the checkpoint of step {state.step}")
    finally:
        watchdog.stop()


def hang_dump_folder(cfg: Config) -> str:
    return storage.join(storage.resolve(cfg.run.storage), cfg.run.name, "hangs")


def checkpoint_stores(cfg: Config) -> list[Store]:
    """The checkpoint stores of the run, primary first, reached with the run's storage config."""
    primary = cfg.checkpoint.store or storage.join(storage.resolve(cfg.run.storage), cfg.run.name, "checkpoints")
    uris = [primary] + ([cfg.checkpoint.replica] if cfg.checkpoint.replica else [])
    return [Store.from_uri(uri, cfg.storage) for uri in uris]


@dataclass
class _Restored:
    candidate: Optional[Candidate]
    timing: dict  # restore_s, reshard_s, engine_build_s: the controller splits the recovery time with them
    events: list[dict]  # committed checkpoints passed over, and why


def _build_and_restore(cfg: Config, plan, world_size: int, rank: int, stores: list[Store]):
    """The engine with the newest good committed checkpoint loaded, the state saved with it,
    and what the restore did. A checkpoint saved at another world size is loaded from its
    universal copy in the store, which rank 0 makes unless the controller made it ahead."""
    started = time.perf_counter()
    reshard_s = 0.0
    engine_build_s = 0.0

    def new_engine(load_universal: bool = False):
        nonlocal engine_build_s
        building = time.perf_counter()
        engine = build_engine(cfg, plan, build_model(cfg, plan), load_universal=load_universal)
        engine_build_s = time.perf_counter() - building
        return engine

    def universal_copy(store: Store, candidate: Candidate):
        nonlocal reshard_s
        converting = time.perf_counter()
        copy = None
        if rank == 0:
            try:
                copy = reshard.convert_in_store(store, candidate.name, candidate.manifest, cfg.checkpoint.staging_dir)
            except Exception as e:  # the candidate is passed over like one that fails verification
                copy = f"converting it to the universal format failed: {e}"
        copy = collectives.broadcast_object(copy)
        reshard_s += time.perf_counter() - converting
        if isinstance(copy, str):
            raise CommitError(copy)
        return copy

    local = tempfile.mkdtemp(prefix=f"wildtrain-restore-rank{rank}-")
    try:
        restored = restore(stores, local, rank=rank, world_size=world_size, agree=collectives.all_ranks,
                           listing=lambda list_them: collectives.broadcast_object(list_them() if rank == 0 else None),
                           universal_copy=universal_copy)
        if restored is None:
            engine = new_engine()
            return engine, TrainState(world_size=world_size), _Restored(
                None, {"restore_s": 0.0, "reshard_s": 0.0, "engine_build_s": engine_build_s}, [])
        events = [{"event": "checkpoint_fallback", "at": time.time(), "store": s.store, "checkpoint": s.name,
                   "step": s.step, "reason": s.reason} for s in restored.skipped]
        state = TrainState.from_json(checkpoint.read_client_state(restored.folder))
        universal_load = needs_universal(restored.manifest, world_size)
        engine = new_engine(load_universal=universal_load)
        (universal.load if universal_load else checkpoint.load)(engine, restored.folder, restored.manifest.tag)
    finally:
        shutil.rmtree(local, ignore_errors=True)
    timing = {"restore_s": time.perf_counter() - started - reshard_s, "reshard_s": reshard_s, "engine_build_s": engine_build_s}
    return engine, state, _Restored(restored.candidate, timing, events)


# A final save that did not commit is tried again after this, then 4x longer each time
# (at most a minute): a store's blip passes within seconds, an outage within minutes.
FIRST_COMMIT_RETRY_S = 5.0


def _save(saver: AsyncSaver, engine, cfg: Config, state: TrainState, world_size: int, must_commit: bool,
          retry: bool = False) -> bool:
    """Capture this rank's part of the checkpoint and let it commit in the background. With
    `must_commit` (the last step, a planned regrow) wait for the commit, and with `retry`
    try a save that failed again, with backoff, for up to checkpoint.timeout_s in all;
    whether it committed (the same answer on every rank). Without, False: the commit is yet
    to come."""
    meta = CheckpointMeta(step=state.step, tag=f"step_{state.step}", world_size=world_size,
                          zero_stage=cfg.deepspeed.zero_stage, data_position={"step": state.step, "seed": cfg.train.seed},
                          config_hash=config_hash(cfg))
    if not must_commit:
        # Skipping is collective: one rank still busy with the previous save skips it for all.
        skip = collectives.any_rank(saver.admission().action == "skip")
        saver.save_engine(engine, meta, state.to_json(), blocked_elsewhere=skip)
        return False
    deadline = time.monotonic() + cfg.checkpoint.timeout_s
    backoff_s = FIRST_COMMIT_RETRY_S
    while True:
        # Queued behind a save in flight; skipped only when a staging disk is full.
        skip = collectives.any_rank(saver.admission(policy="queue").action == "skip")
        saver.save_engine(engine, meta, state.to_json(), blocked_elsewhere=skip, policy="queue")
        if not skip:
            saver.release(state.step)  # the last report, or the regrow's, follows right after
            saver.flush(max(0.0, deadline - time.monotonic()))
        committed = collectives.broadcast_object(saver.committed(state.step))  # rank 0 commits; its word counts
        if committed or not retry or time.monotonic() + backoff_s > deadline:
            return committed
        print(f"the checkpoint of step {state.step} did not commit; trying again in {backoff_s:g} s", flush=True)
        time.sleep(backoff_s)
        backoff_s = min(4 * backoff_s, 60.0)


def _saves_report(outcomes: list[SaveOutcome], events: list[dict]) -> dict:
    """Metrics and events for the saves that ended since the last report: the controller
    logs them (rank 0's), and converts each committed local checkpoint ahead of a resize."""
    report = async_save.metrics(outcomes)
    events = events + [
        {"event": f"checkpoint_{o.status}", "at": time.time(), "step": o.step, "checkpoint": o.name,
         "reason": o.reason, "failure": o.failure, "disk_full": str(o.disk_full) if o.disk_full else ""}
        for o in outcomes if o.status != "saved"
    ]
    committed = [f"{store}/{o.name}" for o in outcomes if o.status in ("saved", "partial") for store in o.stored]
    return report | {"events": events, "committed_checkpoints": committed}


class _GrowthCheck:
    """While the group is below max size, rank 0 looks for room for another worker at most
    every `interval_s` (on a node not left out of the run), and every rank learns the answer
    at the same step: each rank calls `room_now` at the same steps."""

    def __init__(self, below_max: bool, rank: int, per_worker: dict, interval_s: float, run_name: str) -> None:
        self.below_max = below_max
        self.rank = rank
        self.per_worker = per_worker
        self.interval_s = interval_s
        self.run_name = run_name
        self.next_look = time.monotonic() + interval_s

    def room_now(self) -> bool:
        if not self.below_max:
            return False
        room = False
        if self.rank == 0 and time.monotonic() >= self.next_look:
            self.next_look = time.monotonic() + self.interval_s
            room = has_room_for_another_worker(self.per_worker, excluded_nodes(self.run_name))
        return collectives.broadcast_flag(room)


class _SampleRecorder:
    """Writes the sample ids of every global batch to <run>/samples/step_<n>.json (rank 0,
    gathered from all ranks in rank order); a step redone after a restore overwrites its
    file, so the folder holds the batches of the run's final lineage."""

    def __init__(self, cfg: Config, rank: int) -> None:
        self.folder = storage.join(storage.resolve(cfg.run.storage), cfg.run.name, "samples")
        self.rank = rank
        self.storage = cfg.storage

    def record(self, step: int, ids: np.ndarray) -> None:
        gathered = collectives.all_gather_object(ids.tolist())
        if self.rank == 0:
            record = {"step": step, "world_size": len(gathered), "sample_ids": [i for rank in gathered for i in rank]}
            storage.write_text(storage.join(self.folder, f"step_{step:08d}.json"), json.dumps(record), self.storage)


def _peak(cfg: Config) -> Optional[Peak]:
    device = torch.cuda.get_device_name() if cfg.cluster.use_gpu else "cpu"
    return peak_flops(device, cfg.cluster.peak_flops_per_device)


class _Monitor:
    """Per-worker monitoring besides the metrics window: the new group's health check (and,
    with monitor.exclude_unhealthy, the nodes to leave out, known to every rank), stragglers
    (every rank's forward time gathered every `monitor.straggler_every` steps, judged on
    rank 0) and the live numbers exported through Ray's metrics API, so the Ray dashboard
    shows them per worker."""

    def __init__(self, cfg: Config, rank: int, world_size: int, device: torch.device) -> None:
        from ray.util.metrics import Gauge

        self.cfg = cfg
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.detector = StragglerDetector(cfg.monitor.straggler_factor, cfg.monitor.straggler_patience)
        self.nodes = collectives.all_gather_object(ray.get_runtime_context().get_node_id())
        self.slowed_by_chaos = cfg.chaos.slows(rank, ray.get_runtime_context().get_node_labels())
        self.busy_at_last_check = 0.0
        self.events: list[dict] = self._preflight()
        excluded = health.nodes_to_exclude(self.events, cfg.elastic.min_workers) if cfg.monitor.exclude_unhealthy else []
        self.unhealthy_nodes: list[str] = collectives.broadcast_object(excluded)
        tags = {"run": cfg.run.name, "rank": str(rank)}
        self.gauges = {
            key: Gauge(f"wildtrain_{key.replace('/', '_')}", description=f"wildtrain {key} of the newest report",
                       tag_keys=tuple(tags)).set_default_tags(tags)
            for key in ("loss", "tokens_per_s", "step_time_s", "mfu", "time/data_wait_s")
        }

    def _preflight(self) -> list[dict]:
        """The new group's health check (train/health.py); its events, on rank 0."""
        cfg = self.cfg
        drill_s = cfg.chaos.slow_step_s if self.slowed_by_chaos else 0.0
        rates = collectives.all_gather_floats(health.measure_matmul(self.device, drill_s))
        bandwidth = health.measure_allreduce(self.device)
        if self.rank != 0:
            return []
        ranks = [health.RankHealth(r, self.nodes[r], float(rate)) for r, rate in enumerate(rates)]
        return health.judge(ranks, bandwidth, cfg.monitor.health_min_ratio, time.time())

    def step_done(self, step: int, window: StepMetrics) -> None:
        if step % self.cfg.monitor.straggler_every:
            return
        busy_s = window.busy_s  # on CUDA this waits for the device: only on check steps
        gathered = collectives.all_gather_floats(busy_s - self.busy_at_last_check)
        self.busy_at_last_check = busy_s
        if self.rank != 0:
            return
        for slow in self.detector.observe([float(t) for t in gathered]):
            event = {"event": "straggler", "at": time.time(), "step": step, "rank": slow.rank,
                     "node": self.nodes[slow.rank], "factor": round(slow.factor, 2), "intervals": slow.intervals,
                     "reason": f"rank {slow.rank} on node {self.nodes[slow.rank]} {slow.factor:.1f}x slower than the median"}
            self.events.append(event)

    def export(self, metrics: dict) -> None:
        for key, gauge in self.gauges.items():
            if key in metrics:
                gauge.set(metrics[key])

    def take_events(self) -> list[dict]:
        events, self.events = self.events, []
        return events
