"""The per-worker training function that Ray Train runs on every worker of the group.

It reads in the order it runs: plan the batch for this world size, build the engine,
restore the last checkpoint, then step, report and checkpoint until the run's last step.
A worker group restarted by Ray Train (a node died, capacity came back) re-enters here
at its new size and continues from the newest checkpoint.
"""

from __future__ import annotations

import tempfile
import time
import warnings

import ray.train
import torch
import torch.distributed as dist

from wildtrain import checkpoint
from wildtrain.config import Config
from wildtrain.data.dataset import micro_batches
from wildtrain.engine import batch_plan, build_engine
from wildtrain.model import Transformer
from wildtrain.train.state import TrainState


def train_loop(config: dict) -> None:
    cfg: Config = config["cfg"]
    # DeepSpeed's ZeRO calls a deprecated collective once per step; the warning says nothing new.
    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*", category=FutureWarning)
    context = ray.train.get_context()
    world_size, rank = context.get_world_size(), context.get_world_rank()
    plan = batch_plan(cfg.train.global_batch_size, cfg.train.micro_batch_size, world_size)

    torch.manual_seed(cfg.train.seed)
    engine = build_engine(cfg, plan, Transformer(cfg.model))
    state = _restore(engine, world_size)
    state.world_size = world_size

    batches = micro_batches(ray.train.get_dataset_shard("train"), plan.micro_batch_size, state.data)
    tokens_per_step = plan.global_batch_size * cfg.data.seq_len
    window = _MetricsWindow()

    while state.step < cfg.train.steps:
        for _ in range(plan.grad_accum_steps):
            state.data, tokens = next(batches)
            loss = engine(tokens[:, :-1], tokens[:, 1:])
            engine.backward(loss)
            engine.step()
            window.add_loss(loss)
        window.end_step()
        state.step += 1
        state.tokens_seen += tokens_per_step

        last = state.step == cfg.train.steps
        log_due = last or state.step % cfg.train.log_every == 0
        checkpoint_due = last or state.step % cfg.train.checkpoint_every == 0
        if not (log_due or checkpoint_due):
            continue
        metrics = {"step": state.step, "tokens_seen": state.tokens_seen, "world_size": world_size}
        if log_due:
            metrics |= window.flush(tokens_per_step) | {"lr": engine.get_lr()[0], "epoch": state.data.epoch}
        if checkpoint_due:
            with tempfile.TemporaryDirectory(prefix="wildtrain-ckpt-") as folder:
                checkpoint.save(engine, folder, f"step_{state.step}", state.to_json(), rank)
                ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(folder))
        else:
            ray.train.report(metrics)


def _restore(engine, world_size: int) -> TrainState:
    """The state of the newest checkpoint Ray Train holds for this run, loaded into `engine`;
    a fresh state when there is none."""
    reported = ray.train.get_checkpoint()
    if reported is None:
        return TrainState(world_size=world_size)
    with reported.as_directory() as folder:
        state = TrainState.from_json(checkpoint.read_client_state(folder))
        if state.world_size != world_size:
            raise NotImplementedError(
                f"checkpoint saved at world size {state.world_size}, restoring at {world_size}: "
                "resharding is not supported yet"
            )
        checkpoint.load(engine, folder)
    return state


class _MetricsWindow:
    """Loss and throughput since the last report; the loss is averaged over all ranks."""

    def __init__(self) -> None:
        self.loss_sum = torch.zeros(())
        self.micro_steps = 0
        self.optimizer_steps = 0
        self.started = time.perf_counter()

    def add_loss(self, loss: torch.Tensor) -> None:
        self.loss_sum += loss.detach().float().cpu()
        self.micro_steps += 1

    def end_step(self) -> None:
        self.optimizer_steps += 1

    def flush(self, tokens_per_step: int) -> dict:
        loss = self.loss_sum / max(1, self.micro_steps)
        if dist.is_initialized():
            dist.all_reduce(loss)
            loss /= dist.get_world_size()
        elapsed = time.perf_counter() - self.started
        steps = max(1, self.optimizer_steps)
        metrics = {"loss": float(loss), "step_time_s": elapsed / steps, "tokens_per_s": steps * tokens_per_step / elapsed}
        self.__init__()
        return metrics
