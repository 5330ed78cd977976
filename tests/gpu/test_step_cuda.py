"""The CUDA-only paths of the factored step on one GPU with NCCL (world size 1, no Ray):
batches on the device through pinned memory, every collective of the helper on NCCL,
ZeRO-1 and ZeRO-2 (compiled) and ZeRO-3 (built partitioned on the GPU) training with bf16 and
fused AdamW, micro-batches' gradients summed in fp32 at ZeRO-1 and ZeRO-2, and the async
checkpoint capture restored exactly (bench/gpu_smoke.py). Two ranks: test_two_ranks_cuda.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]
SEQ_LEN = 64
BATCH = 8


def test_every_collective_runs_on_nccl(cuda_group):
    from wildtrain.train import collectives as c

    assert c.small_tensor_device("nccl") == cuda_group
    assert c.all_ranks(True) and not c.all_ranks(False)
    assert c.any_rank(True) and not c.any_rank(False)
    assert c.broadcast_flag(True) is True
    assert c.broadcast_object({"step": 3}) == {"step": 3}
    assert c.all_gather_object("node-a") == ["node-a"]
    assert c.all_gather_floats(2.5) == [2.5] and c.all_gather_floats([1.0, 2.0]) == [[1.0, 2.0]]
    loss = c.mean_over_ranks(torch.tensor(4.0, device=cuda_group))
    assert loss.device == cuda_group and loss.item() == 4.0  # the loss stays on the GPU
    assert c.mean_over_ranks(torch.tensor(4.0)).device == cuda_group  # a CPU value is moved, not refused
    with pytest.raises(ValueError, match="cpu tensor cannot be all-reduced over a 'nccl'"):
        c.sum_(torch.ones(4))


def test_health_check_measures_the_gpu(cuda_group):
    from wildtrain.tracking.worker.mfu import peak_flops
    from wildtrain.train import health

    rate = health.measure_matmul(cuda_group)
    assert rate > 1e13, "bf16 on the tensor cores: tens of TFLOP/s at least, on any GPU"
    peak = peak_flops(torch.cuda.get_device_name())
    if peak is not None:  # a burst timed before its kernels ran would beat the chip
        assert rate < 1.1 * peak.flops_per_s
    # The all-reduce bandwidth needs two ranks: test_two_ranks_cuda.py.


def test_batches_reach_the_device_through_pinned_buffers(cuda_group):
    from wildtrain.train.step import DeviceBatches

    host = [np.full((BATCH, SEQ_LEN + 1), i, dtype=np.int32) for i in range(4)]
    batches = DeviceBatches(iter(host), cuda_group)
    assert batches.pinned
    for i, (tokens, item) in enumerate(batches):
        assert tokens.device == cuda_group and tokens.dtype == torch.int64
        assert item is host[i] and torch.equal(tokens.cpu(), torch.from_numpy(host[i]).long())
    assert all(b is not None and b.is_pinned() for b in batches._buffers)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_step_trains_in_bf16_on_the_gpu(cuda_group, stage):
    pytest.importorskip("deepspeed")
    from tests.helpers.models import engine_settings
    from wildtrain.batching import batch_plan
    from wildtrain.config import Config, ModelConfig
    from wildtrain.engine import build_engine, build_model
    from wildtrain.model import flops_per_token
    from wildtrain.tracking.worker.mfu import peak_flops
    from wildtrain.train.step import DeviceBatches, StepMetrics, train_step

    cfg = Config()
    cfg.model = ModelConfig(dim=256, n_layers=2, n_heads=4, max_seq_len=SEQ_LEN, activation_checkpointing=stage == 3)
    cfg.deepspeed.zero_stage = stage
    if stage == 3:
        cfg.model.compile = True  # off by default under ZeRO-3 (engine.compiles); asked for, it compiles
    cfg.train.global_batch_size, cfg.train.micro_batch_size = BATCH, BATCH // 2
    plan = batch_plan(BATCH, BATCH // 2, 1)
    torch.manual_seed(0)
    model = build_model(engine_settings(cfg), plan, cuda_group)
    if stage == 3:  # built partitioned, on the GPU
        assert all(p.numel() == 0 and p.ds_tensor.device == cuda_group for p in model.parameters())
    engine = build_engine(engine_settings(cfg), plan, model, cuda_group)
    assert engine.is_compiled, "on by default on CUDA under ZeRO-1 and ZeRO-2; asked for under ZeRO-3"
    assert engine.bfloat16_enabled()
    # bf16 weights; gradients summed over micro-batches and reduced over ranks in fp32.
    assert engine.get_data_types() == (torch.bfloat16, torch.float32)
    assert engine.communication_data_type == torch.float32
    assert all(group.get("fused") for group in engine.optimizer.optimizer.param_groups)
    tokens = np.random.default_rng(0).integers(0, 257, (BATCH, SEQ_LEN + 1), dtype=np.int32)
    window = StepMetrics(
        BATCH * SEQ_LEN, flops_per_token(cfg.model, SEQ_LEN), peak_flops(torch.cuda.get_device_name()), 1, cuda_group
    )
    losses = []
    for tokens_on_device, _ in DeviceBatches((tokens for _ in range(10)), cuda_group):
        train_step(engine, plan, tokens_on_device, window)
        losses.append(window.flush())
    assert losses[-1]["loss"] < losses[0]["loss"] - 0.5
    last = losses[-1]
    assert all(last[f"time/{p}_s"] > 0 for p in ("forward", "backward", "optimizer"))
    assert sum(last[f"time/{p}_s"] for p in ("forward", "backward", "optimizer")) <= last["step_time_s"] * 1.05
    assert window.busy_s > 0


@pytest.mark.parametrize("stage", [1, 2])
def test_micro_batches_gradients_are_summed_in_fp32_on_the_gpu(cuda_group, stage):
    # With overlap_comm's side stream and sized buckets, which the CPU's test has not.
    pytest.importorskip("deepspeed")
    from tests.helpers.grad_accum import accumulation_errors

    measured = accumulation_errors(stage, cuda_group)
    assert measured["data_types"] == (torch.bfloat16, torch.float32)
    assert measured["errors"]["fp32"] == 0.0 and measured["errors"]["bf16"] > 0.0, measured


def test_gpu_smoke_restores_the_async_checkpoint_exactly():
    pytest.importorskip("deepspeed")
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "gpu_smoke.py"),
            "--device",
            "cuda",
            "--steps",
            "5",
            "--preset",
            "tiny",
            "--seq-len",
            "128",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count(" exact") >= 2


def test_the_async_capture_copies_into_pinned_buffers_on_its_own_stream(tmp_path):
    from wildtrain.checkpoint.async_save import AsyncSaver, CheckpointMeta

    weights = torch.randn(1024, 1024, device="cuda")
    saver = AsyncSaver(
        [str(tmp_path / "store")], str(tmp_path / "staging"), rank=0, world_size=1, attempt="g1", device=weights.device
    )
    assert saver._copy_stream is not None
    meta = CheckpointMeta(step=1, tag="step_1", world_size=1, zero_stage=0)
    saver.save_state(meta, {"state.pt": {"w": weights}})
    expected = weights.cpu()
    weights.add_(1.0)  # training goes on at once: the capture must hold the values it copied
    assert saver.close(60)
    spare = saver._buffers._spare  # the host copies, kept for the next save
    assert spare and all(buffer.is_pinned() for buffer in spare.values())
    [outcome] = saver.drain()
    assert outcome.status == "saved"
    restored = torch.load(tmp_path / "store" / outcome.name / "state.pt")
    assert torch.equal(restored["w"], expected)
