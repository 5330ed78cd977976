"""DeepSpeed from our config: the LR schedule and the engine for a batch plan
(`wildtrain.batching`)."""

from __future__ import annotations

import math

import torch

from wildtrain.batching import BatchPlan
from wildtrain.config import Config, OptimConfig


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
