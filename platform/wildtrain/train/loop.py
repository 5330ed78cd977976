"""The per-worker training function that Ray Train runs on every worker of the group.

It reads in the order it runs: plan the batch for this world size, restore the newest
checkpoint (resharding it if it was saved at another size) into a new engine, then step,
report and checkpoint until the run's last step. A worker group that Ray Train restarts
(a node died, capacity came back) re-enters here at its new size.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
import time
import warnings
from typing import Optional

import numpy as np
import ray.train
import torch
import torch.distributed as dist

from wildtrain import checkpoint, storage
from wildtrain.batching import batch_plan
from wildtrain.checkpoint import universal
from wildtrain.config import Config
from wildtrain.data.stream import RankStream
from wildtrain.elastic import PlannedRegrow, has_room_for_another_worker
from wildtrain.engine import build_engine
from wildtrain.model import Transformer, flops_per_token
from wildtrain.tracking.mfu import Peak, mfu, peak_flops
from wildtrain.train.state import TrainState


def train_loop(config: dict) -> None:
    attempt_started = time.time()
    cfg: Config = config["cfg"]
    # DeepSpeed's ZeRO calls a deprecated collective once per step; the warning says nothing new.
    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*", category=FutureWarning)
    context = ray.train.get_context()
    world_size, rank = context.get_world_size(), context.get_world_rank()
    plan = batch_plan(cfg.train.global_batch_size, cfg.train.micro_batch_size, world_size)
    data = config["data"]

    torch.manual_seed(cfg.train.seed)
    engine, state, restore_timing = _build_and_restore(cfg, plan, world_size, rank)
    restored_step = state.step
    state.world_size = world_size
    # The data position is the step: the stream starts where the restored model stopped.
    stream = RankStream(data.datasets, cfg, rank, world_size, from_step=state.step)
    samples = _SampleRecorder(cfg, rank) if cfg.data.record_samples else None

    tokens_per_step = plan.global_batch_size * cfg.data.seq_len
    window = _MetricsWindow(tokens_per_step, flops_per_token(cfg.model, cfg.data.seq_len), _peak(cfg), world_size, stream)
    growth = _GrowthCheck(world_size < cfg.elastic.max_workers, rank, config["worker_resources"],
                          cfg.elastic.resize_check_interval_s)
    while state.step < cfg.train.steps:
        batch = stream.next_step()
        tokens = torch.from_numpy(batch.tokens).long()
        for micro_batch in tokens.split(plan.micro_batch_size):
            with window.timed("forward_backward"):
                loss = engine(micro_batch[:, :-1], micro_batch[:, 1:])
                engine.backward(loss)
            with window.timed("optimizer"):
                engine.step()
            window.add_loss(loss)
        window.end_step()
        state.step += 1
        state.tokens_seen += tokens_per_step
        if samples is not None:
            samples.record(state.step, batch.sample_ids)

        first_of_attempt = state.step == restored_step + 1
        last = state.step == cfg.train.steps
        grow = not last and growth.room_now()
        log_due = last or first_of_attempt or state.step % cfg.train.log_every == 0
        checkpoint_due = last or grow or state.step % cfg.train.checkpoint_every == 0
        if not (log_due or checkpoint_due):
            continue
        metrics = {"step": state.step, "tokens_seen": state.tokens_seen, "world_size": world_size}
        if log_due:
            epoch = (state.step - 1) // data.steps_per_epoch
            metrics |= window.flush() | {"lr": engine.get_lr()[0], "epoch": epoch}
        if first_of_attempt:
            # What the controller needs to split this attempt's recovery time into its parts.
            metrics |= restore_timing | {
                "restored_step": restored_step,
                "attempt_started_at": attempt_started,
                "first_step_at": time.time(),
            }
        if checkpoint_due:
            # Every optimizer step applied exactly once across restarts, or nothing is saved.
            if engine.global_steps != state.step:
                raise RuntimeError(f"DeepSpeed counted {engine.global_steps} optimizer steps where the run is at {state.step}")
            with window.timed("checkpoint_stall"), tempfile.TemporaryDirectory(prefix="wildtrain-ckpt-") as folder:
                checkpoint.save(engine, folder, f"step_{state.step}", state.to_json(), rank)
                ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(folder))
        else:
            ray.train.report(metrics)
        if grow:
            raise PlannedRegrow(f"room for more than {world_size} workers; regrowing from the checkpoint of step {state.step}")


def _build_and_restore(cfg: Config, plan, world_size: int, rank: int):
    """The engine with the newest checkpoint loaded, the state saved with it, and how long
    restoring and resharding took. A checkpoint saved at another world size is converted to
    DeepSpeed's universal format first (once; the conversion is cached next to it)."""
    reported = ray.train.get_checkpoint()
    if reported is None:
        engine = build_engine(cfg, plan, Transformer(cfg.model))
        return engine, TrainState(world_size=world_size), {"restore_s": 0.0, "reshard_s": 0.0}

    started = time.perf_counter()
    with reported.as_directory() as folder:
        state = TrainState.from_json(checkpoint.read_client_state(folder))
        tag = checkpoint.latest_tag(folder)
        reshard = state.world_size != world_size and cfg.deepspeed.zero_stage > 0
        reshard_s = 0.0
        if reshard:
            with _rank_zero_first(rank):
                reshard_started = time.perf_counter()
                universal.convert(folder, tag)
                reshard_s = time.perf_counter() - reshard_started
        engine = build_engine(cfg, plan, Transformer(cfg.model), load_universal=reshard)
        (universal.load if reshard else checkpoint.load)(engine, folder, tag)
    restore_s = time.perf_counter() - started - reshard_s
    return engine, state, {"restore_s": restore_s, "reshard_s": reshard_s}


@contextlib.contextmanager
def _rank_zero_first(rank: int):
    """Rank 0 runs the block while the others wait; then the others run it (a cache hit)."""
    if rank != 0:
        dist.barrier()
    yield
    if rank == 0:
        dist.barrier()


class _GrowthCheck:
    """While the group is below max size, rank 0 looks for room for another worker every
    `interval_s`, and every rank learns the answer at the same step."""

    def __init__(self, below_max: bool, rank: int, per_worker: dict, interval_s: float) -> None:
        self.below_max = below_max
        self.rank = rank
        self.per_worker = per_worker
        self.interval_s = interval_s
        self.next_look = time.monotonic() + interval_s

    def room_now(self) -> bool:
        if not self.below_max:
            return False
        room = False
        if self.rank == 0 and time.monotonic() >= self.next_look:
            self.next_look = time.monotonic() + self.interval_s
            room = has_room_for_another_worker(self.per_worker)
        decision = torch.tensor([int(room)])
        dist.broadcast(decision, src=0)
        return bool(decision.item())


class _SampleRecorder:
    """Writes the sample ids of every global batch to <run>/samples/step_<n>.json (rank 0,
    gathered from all ranks in rank order); a step redone after a restore overwrites its
    file, so the folder holds the batches of the run's final lineage."""

    def __init__(self, cfg: Config, rank: int) -> None:
        self.folder = storage.join(storage.resolve(cfg.run.storage), cfg.run.name, "samples")
        self.rank = rank
        self.storage = cfg.storage

    def record(self, step: int, ids: np.ndarray) -> None:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, ids.tolist())
        if self.rank == 0:
            record = {"step": step, "world_size": len(gathered), "sample_ids": [i for rank in gathered for i in rank]}
            storage.write_text(storage.join(self.folder, f"step_{step:08d}.json"), json.dumps(record), self.storage)


def _peak(cfg: Config) -> Optional[Peak]:
    device = torch.cuda.get_device_name() if cfg.cluster.use_gpu else "cpu"
    return peak_flops(device, cfg.cluster.peak_flops_per_device)


class _MetricsWindow:
    """Loss, throughput, MFU and where the time went since the last report: means per step
    of `time/<phase>_s` (data wait from the stream, forward+backward, optimizer, checkpoint
    stall); the loss is averaged over all ranks."""

    PHASES = ("forward_backward", "optimizer", "checkpoint_stall")

    def __init__(self, tokens_per_step: int, flops_per_token: float, peak: Optional[Peak], world_size: int,
                 stream: RankStream) -> None:
        self.tokens_per_step = tokens_per_step
        self.flops_per_token = flops_per_token
        self.peak = peak
        self.world_size = world_size
        self.stream = stream
        self._reset()

    def _reset(self) -> None:
        self.loss_sum = torch.zeros(())
        self.micro_steps = 0
        self.optimizer_steps = 0
        self.phase_s = dict.fromkeys(self.PHASES, 0.0)
        self.stream.wait_s = 0.0
        self.started = time.perf_counter()

    @contextlib.contextmanager
    def timed(self, phase: str):
        started = time.perf_counter()
        try:
            yield
        finally:
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # kernels run asynchronously; time them, not their launch
            self.phase_s[phase] += time.perf_counter() - started

    def add_loss(self, loss: torch.Tensor) -> None:
        self.loss_sum += loss.detach().float().cpu()
        self.micro_steps += 1

    def end_step(self) -> None:
        self.optimizer_steps += 1

    def flush(self) -> dict:
        loss = self.loss_sum / max(1, self.micro_steps)
        if dist.is_initialized():
            dist.all_reduce(loss)
            loss /= dist.get_world_size()
        elapsed = time.perf_counter() - self.started
        steps = max(1, self.optimizer_steps)
        tokens_per_s = steps * self.tokens_per_step / elapsed
        metrics = {
            "loss": float(loss),
            "step_time_s": elapsed / steps,
            "tokens_per_s": tokens_per_s,
            "time/data_wait_s": self.stream.wait_s / steps,
        }
        metrics |= {f"time/{phase}_s": seconds / steps for phase, seconds in self.phase_s.items()}
        if self.peak is not None:
            metrics["mfu"] = mfu(self.flops_per_token, tokens_per_s, self.peak, self.world_size)
        self._reset()
        return metrics
