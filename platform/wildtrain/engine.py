"""DeepSpeed from our config: the batch plan for a world size, the LR schedule, the engine.

The global batch (sequences per optimizer step) is fixed by the config and never changes
with the world size, so a run that shrinks and grows still trains the same thing. DeepSpeed
0.19 has no elasticity block any more, so the plan that keeps it constant is computed here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from wildtrain.config import Config, OptimConfig


class BatchPlanError(ValueError):
    pass


@dataclass(frozen=True)
class BatchPlan:
    world_size: int
    micro_batch_size: int
    grad_accum_steps: int

    @property
    def global_batch_size(self) -> int:
        return self.world_size * self.micro_batch_size * self.grad_accum_steps


def batch_plan(global_batch_size: int, max_micro_batch_size: int, world_size: int) -> BatchPlan:
    """The plan with the largest micro-batch <= `max_micro_batch_size` that hits the global
    batch exactly: the largest micro-batch wastes the least time in gradient accumulation,
    and an inexact global batch would make the trained model depend on failures."""
    for micro in range(min(max_micro_batch_size, global_batch_size // world_size), 0, -1):
        per_micro_step = micro * world_size
        if global_batch_size % per_micro_step == 0:
            return BatchPlan(world_size, micro, global_batch_size // per_micro_step)
    raise BatchPlanError(
        f"a global batch of {global_batch_size} sequences cannot be split evenly over "
        f"{world_size} workers with micro-batches of at most {max_micro_batch_size}"
    )


def unservable_world_sizes(global_batch_size: int, max_micro_batch_size: int, min_world: int, max_world: int) -> list[int]:
    bad = []
    for world in range(min_world, max_world + 1):
        try:
            batch_plan(global_batch_size, max_micro_batch_size, world)
        except BatchPlanError:
            bad.append(world)
    return bad


def lr_at(step: int, optim: OptimConfig, total_steps: int) -> float:
    """Linear warm-up to `lr`, then a cosine decay to `min_lr` at `total_steps`.

    A function of the optimizer step alone, so a restart at any world size resumes the
    schedule exactly where it was."""
    if step < optim.warmup_steps:
        return optim.lr * (step + 1) / optim.warmup_steps
    decay_steps = max(1, total_steps - optim.warmup_steps)
    progress = min(1.0, (step - optim.warmup_steps) / decay_steps)
    return optim.min_lr + 0.5 * (optim.lr - optim.min_lr) * (1 + math.cos(math.pi * progress))


def deepspeed_config(cfg: Config, plan: BatchPlan, on_cuda: bool, load_universal: bool = False) -> dict:
    ds = {
        "train_batch_size": plan.global_batch_size,
        "train_micro_batch_size_per_gpu": plan.micro_batch_size,
        "gradient_accumulation_steps": plan.grad_accum_steps,
        "gradient_clipping": cfg.optim.grad_clip,
        "zero_optimization": {"stage": cfg.deepspeed.zero_stage},
        "steps_per_print": 10**9,  # progress is ours to print, once, from the controller
        "wall_clock_breakdown": False,
    }
    if on_cuda:
        ds["bf16"] = {"enabled": True}
    if load_universal:
        # The checkpoint to load was saved at another world size and converted to
        # DeepSpeed's universal (world-size independent) format.
        ds["checkpoint"] = {"load_universal": True}
    return ds


def build_engine(cfg: Config, plan: BatchPlan, model: torch.nn.Module, load_universal: bool = False):
    """Wrap `model` in a DeepSpeed engine with AdamW and the warm-up + cosine schedule.

    The optimizer is torch's AdamW rather than DeepSpeed's by-name optimizers: those need
    compiled ops that the CPU build (DS_BUILD_OPS=0) does not have."""
    import deepspeed

    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.optim.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.optim.lr,
        betas=(cfg.optim.beta1, cfg.optim.beta2),
        eps=cfg.optim.eps,
    )
    # LambdaLR multiplies the base lr; dividing by it keeps lr_at the single source of truth.
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_at(step, cfg.optim, cfg.train.steps) / cfg.optim.lr
    )
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        lr_scheduler=schedule,
        config=deepspeed_config(cfg, plan, on_cuda=torch.cuda.is_available(), load_universal=load_universal),
    )
    return engine
