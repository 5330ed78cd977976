"""What DeepSpeed sums a step's micro-batches' gradients in, measured: the bf16 gradients of
each micro-batch from a copy of the engine's bf16 model, summed in fp32 and in bf16, against
the gradient the engine holds at the step's boundary (`deepspeed.utils.safe_get_full_grad`).
For tests/unit/test_grad_accum_dtype.py (CPU) and tests/gpu/test_step_cuda.py (CUDA)."""

from __future__ import annotations

import torch

from wildtrain.batching import batch_plan
from wildtrain.config import Config, ModelConfig
from wildtrain.engine import deepspeed_config, import_deepspeed
from wildtrain.model import Transformer
from wildtrain.train.step import model_inputs

MICRO_BATCHES = 4


def accumulation_errors(stage: int, device: torch.device) -> dict:
    """The engine's (bf16 weights, fp32 accumulation as `deepspeed_config` asks on CUDA)
    largest difference from the fp32 and from the bf16 sum of the micro-batches' gradients,
    with its optimizer's class; in a process group of one rank."""
    deepspeed = import_deepspeed()
    from deepspeed.utils import safe_get_full_grad

    cfg = Config()
    cfg.model = ModelConfig(dim=64, n_layers=2, n_heads=4, vocab_size=257, max_seq_len=32)
    cfg.deepspeed.zero_stage = stage
    plan = batch_plan(2 * MICRO_BATCHES, 2, 1)
    torch.manual_seed(0)
    model = Transformer(cfg.model).to(device)
    config = deepspeed_config(cfg.deepspeed, cfg.optim, plan, on_cuda=True)
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=config)
    # The engine's weights as it holds them: bf16 parameters, buffers (rotary tables) as they were.
    reference = Transformer(cfg.model).to(device)
    for param in reference.parameters():
        param.data = param.data.bfloat16()
    reference.load_state_dict(engine.module.state_dict())
    tokens = torch.randint(0, 257, (plan.global_batch_size, 17), generator=torch.Generator().manual_seed(1)).to(device)
    in_fp32 = {name: torch.zeros_like(p, dtype=torch.float32) for name, p in reference.named_parameters()}
    in_bf16 = {name: torch.zeros_like(p) for name, p in reference.named_parameters()}
    for micro_batch in tokens.split(plan.micro_batch_size):
        reference.zero_grad()
        (reference(**model_inputs(micro_batch)) / plan.grad_accum_steps).backward()
        for name, param in reference.named_parameters():
            in_fp32[name] += param.grad.float()
            in_bf16[name] += param.grad
        engine.backward(engine(**model_inputs(micro_batch)))
        if not engine.is_gradient_accumulation_boundary():
            engine.step()
    errors = {"fp32": 0.0, "bf16": 0.0}
    for name, param in engine.module.named_parameters():
        held = safe_get_full_grad(param).float()
        errors["fp32"] = max(errors["fp32"], (held - in_fp32[name]).abs().max().item())
        errors["bf16"] = max(errors["bf16"], (held - in_bf16[name].float()).abs().max().item())
    return {"optimizer": type(engine.optimizer).__name__, "errors": errors, "data_types": engine.get_data_types()}
