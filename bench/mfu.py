"""MFU of our engine against a plain PyTorch reference, side by side, on one device.

For each preset: the same batch trained by
    wildtrain  engine.build_model + build_engine (DeepSpeed ZeRO-1, bf16 and compile on
               CUDA, fused AdamW) through train.step.train_step and DeviceBatches
    plain      the same Transformer in plain PyTorch: bf16 autocast, torch.compile, fused
               AdamW, gradient clipping; the reference our engine must come close to
printing tokens/s, MFU (tracking.worker.mfu, model.flops) and peak memory of each. Then, for the
last preset, the checkpoint stall of its full training state (weights + Adam moments)
through AsyncSaver, against the device-to-host copy time of the same number of bytes.

The plain PyTorch run is the reference. Goals: our engine >= 55% MFU at 1.3B, stall
<= 0.5 s. Figures on an H200: docs/benchmarks.md, models and GPUs.

Usage: python bench/mfu.py [--device cuda|cpu] [--presets 125m,1.3b] [--steps 20]
(CPU defaults: the tiny preset, short sequences; the test suite runs it with --steps 3.)
"""

from __future__ import annotations

import argparse
import gc
import resource
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from progress import STARTED, say  # first: its clock starts with the script


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda when available")
    parser.add_argument("--presets", default=None, help="comma-separated (default: 125m,1.3b on cuda, tiny on cpu)")
    parser.add_argument("--steps", type=int, default=20, help="measured steps per run")
    parser.add_argument("--warmup", type=int, default=None, help="unmeasured steps first (default: 5 cuda, 1 cpu)")
    parser.add_argument("--seq-len", type=int, default=None, help="default: 2048 on cuda, 64 on cpu")
    parser.add_argument("--batch", type=int, default=None, help="sequences per step (default: 8 on cuda, 2 on cpu)")
    parser.add_argument("--no-compile", action="store_true", help="eager mode for both")
    parser.add_argument("--saves", type=int, default=2, help="saves for the stall: the first allocates its buffers")
    return parser.parse_args()


ARGS = _args()
import torch  # noqa: E402
from one_process import on_cuda  # noqa: E402

ON_CUDA = on_cuda(ARGS.device)

import numpy as np  # noqa: E402

from wildtrain.batching import batch_plan  # noqa: E402
from wildtrain.checkpoint.async_save import AsyncSaver, CheckpointMeta  # noqa: E402
from wildtrain.checkpoint.store import Store  # noqa: E402
from wildtrain.config import Config, load_config  # noqa: E402
from wildtrain.engine import EngineSettings, build_engine, build_model, import_deepspeed, lr_at  # noqa: E402
from wildtrain.model import Transformer, flops_per_token, param_count  # noqa: E402
from wildtrain.tracking.worker.mfu import Peak, device_peak, mfu  # noqa: E402
from wildtrain.train.step import DeviceBatches, StepMetrics, train_step  # noqa: E402

DEVICE = torch.device("cuda", 0) if ON_CUDA else torch.device("cpu")
SEQ_LEN = ARGS.seq_len or (2048 if ON_CUDA else 64)
BATCH = ARGS.batch or (8 if ON_CUDA else 2)
WARMUP = ARGS.warmup if ARGS.warmup is not None else (5 if ON_CUDA else 1)
COMPILE = not ARGS.no_compile and ON_CUDA  # compiling on CPU costs more than a few steps gain


@dataclass
class Row:
    preset: str
    impl: str
    tokens_per_s: float
    mfu: float
    peak_gb: float
    step_ms: float


def _config(preset: str) -> Config:
    return load_config(
        [
            f"model={preset}",
            "deepspeed.zero_stage=1",
            f"data.seq_len={SEQ_LEN}",
            f"train.global_batch_size={BATCH}",
            f"train.micro_batch_size={BATCH}",
            f"model.compile={str(COMPILE).lower()}",
            "elastic.min_workers=1",
            "elastic.max_workers=1",
        ]
    )


def _tokens(cfg: Config) -> np.ndarray:
    return np.random.default_rng(0).integers(0, cfg.model.vocab_size, (BATCH, SEQ_LEN + 1), dtype=np.int32)


def _reset_memory() -> None:
    gc.collect()
    if ON_CUDA:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak_gb() -> float:
    """Peak device memory of the run on CUDA; on CPU the process's peak RSS so far."""
    if ON_CUDA:
        return torch.cuda.max_memory_allocated() / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def ours(preset: str, peak: Peak):
    """Our engine's row, and the engine (for the checkpoint stall)."""
    cfg = _config(preset)
    plan = batch_plan(BATCH, BATCH, 1)
    settings = EngineSettings(cfg.model, cfg.optim, cfg.deepspeed, cfg.train.steps, cfg.elastic.collective_timeout_s)
    say("  wildtrain: building the DeepSpeed engine")
    _reset_memory()
    torch.manual_seed(0)
    engine = build_engine(settings, plan, build_model(settings, plan, DEVICE), DEVICE)
    tokens = _tokens(cfg)
    window = StepMetrics(BATCH * SEQ_LEN, flops_per_token(cfg.model, SEQ_LEN), peak, 1, DEVICE)
    for step, (batch, _) in enumerate(DeviceBatches((tokens for _ in range(WARMUP + ARGS.steps)), DEVICE), start=1):
        train_step(engine, plan, batch, window)
        if step == WARMUP:
            warm = window.flush()  # compiling and allocating: start-up, not throughput
            say(f"  wildtrain: {WARMUP} warm-up steps, {warm['step_time_s']:.2f} s/step, loss {warm['loss']:.3f}")
    metrics = window.flush()
    say(f"  wildtrain: {metrics['tokens_per_s']:.0f} tokens/s, loss {metrics['loss']:.3f}")
    row = Row(preset, "wildtrain", metrics["tokens_per_s"], metrics["mfu"], _peak_gb(), metrics["step_time_s"] * 1e3)
    return row, engine, cfg


def plain(preset: str, peak: Peak) -> Row:
    say(f"  plain: the same model in plain PyTorch{', compiling' if COMPILE else ''}")
    cfg = _config(preset)
    _reset_memory()
    torch.manual_seed(0)
    model = Transformer(cfg.model).to(DEVICE)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.optim.weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=cfg.optim.lr,
        betas=(cfg.optim.beta1, cfg.optim.beta2),
        eps=cfg.optim.eps,
        fused=ON_CUDA,
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_at(step, cfg.optim, cfg.train.steps) / cfg.optim.lr
    )  # the engine's schedule
    forward = torch.compile(model) if COMPILE else model
    tokens = torch.from_numpy(_tokens(cfg)).to(DEVICE).long()

    def step() -> torch.Tensor:
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16, enabled=ON_CUDA):
            loss = forward(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.optim.grad_clip)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    for _ in range(WARMUP):
        step()
    _sync()
    say(f"  plain: {WARMUP} warm-up steps done")
    started = time.perf_counter()
    for _ in range(ARGS.steps):
        loss = step()
    _sync()
    seconds = (time.perf_counter() - started) / ARGS.steps
    tokens_per_s = BATCH * SEQ_LEN / seconds
    say(f"  plain: {tokens_per_s:.0f} tokens/s, loss {loss.item():.3f}")
    row = Row(
        preset,
        "plain",
        tokens_per_s,
        mfu(flops_per_token(cfg.model, SEQ_LEN), tokens_per_s, peak, 1),
        _peak_gb(),
        seconds * 1e3,
    )
    return row


def _sync() -> None:
    if ON_CUDA:
        torch.cuda.synchronize()


def checkpoint_stall(engine, cfg: Config) -> None:
    """The training thread's stall per AsyncSaver capture of the whole state, against one
    device-to-host copy of as many bytes into pinned memory: the floor a capture can reach."""
    say(f"checkpoint stall: {ARGS.saves} saves of {cfg.model.name}'s full state")
    work = Path(tempfile.mkdtemp(prefix="wildtrain-bench-mfu-"))
    store = Store.from_uri(str(work / "store"))
    # No read-back verification: the stall, not the upload, is measured here.
    saver = AsyncSaver(
        [store], str(work / "staging"), rank=0, world_size=1, attempt="mfu", verify_upload=False, device=DEVICE
    )
    stalls, size = [], 0
    try:
        for i in range(ARGS.saves):
            step = engine.global_steps + i  # a name per save; the state is the same
            saver.save_engine(
                engine,
                CheckpointMeta(step=step, tag=f"step_{step}", world_size=1, zero_stage=1, data_position={"step": step}),
                "{}",
            )
            if not saver.flush(timeout_s=1800):
                raise RuntimeError("a checkpoint save did not finish within 30 minutes")
            [outcome] = saver.drain()
            if outcome.status != "saved":
                raise RuntimeError(f"checkpoint save {outcome.status}: {outcome.reason}")
            stalls.append(outcome.stall_s)
            size = outcome.bytes
            say(
                f"  save {i + 1}: stall {outcome.stall_s:.2f} s ({'allocating' if i == 0 else 'reused'} host buffers), "
                f"{size / 1e9:.2f} GB written in {outcome.background_s:.1f} s"
            )
            shutil.rmtree(work / "store", ignore_errors=True)  # one checkpoint on disk at a time
    finally:
        saver.close()
        shutil.rmtree(work, ignore_errors=True)
    source = torch.empty(size, dtype=torch.uint8, device=DEVICE)
    target = torch.empty(size, dtype=torch.uint8, pin_memory=ON_CUDA)
    target.copy_(source, non_blocking=True)  # first touch of the pages is not the copy
    _sync()
    started = time.perf_counter()
    target.copy_(source, non_blocking=True)
    _sync()
    copy_s = time.perf_counter() - started
    del source, target
    print(
        f"\ncheckpoint stall, {cfg.model.name} full state ({size / 1e9:.2f} GB: weights + Adam moments): "
        f"{stalls[-1]:.3f} s per save (first {stalls[0]:.3f} s); device-to-host copy of the same bytes "
        f"{copy_s:.3f} s ({size / copy_s / 1e9:.1f} GB/s); stall / copy {stalls[-1] / copy_s:.1f}x",
        flush=True,
    )


def main() -> int:
    say(f"starting DeepSpeed on a process group of one ({'nccl' if ON_CUDA else 'gloo'})")
    deepspeed = import_deepspeed()

    if ON_CUDA:
        torch.cuda.set_device(DEVICE)
    deepspeed.init_distributed(dist_backend="nccl" if ON_CUDA else "gloo", verbose=False)
    peak = device_peak(DEVICE)
    if peak is None:
        sys.exit(f"no peak FLOP/s known for {torch.cuda.get_device_name(DEVICE)}: add it to tracking/worker/mfu.py")
    presets = (ARGS.presets or ("125m,1.3b" if ON_CUDA else "tiny")).split(",")
    say(
        f"{DEVICE} ({peak.source}, {peak.flops_per_s / 1e12:.1f} TFLOP/s peak), batch {BATCH}x{SEQ_LEN}, "
        f"{'compiled' if COMPILE else 'eager'}, {ARGS.steps} steps after {WARMUP} warm-up"
    )
    rows = []
    for preset in presets:
        say(f"{preset}: {param_count(load_config([f'model={preset}']).model) / 1e6:.1f}M parameters")
        # The reference first: what DeepSpeed keeps referenced after its engine is dropped
        # would otherwise count towards the reference's peak memory.
        reference = plain(preset, peak)
        torch._dynamo.reset()  # compiled graphs hold the reference model's parameters
        engine = None  # the last preset's engine let go before this one's is built (the last one's is kept)
        row, engine, cfg = ours(preset, peak)
        rows += [row, reference]
    # The table before the stall: its saves write the whole state twice, and twice on the H200
    # the bound of a GPU call ended them (1.3b: ~16 GB), and the table with them.
    header = f"{'preset':<7} {'impl':<10} {'tokens/s':>10} {'MFU %':>6} {'peak GB':>8} {'step ms':>8}"
    print("\n" + header + "\n" + "-" * len(header))
    for r in rows:
        print(
            f"{r.preset:<7} {r.impl:<10} {r.tokens_per_s:>10.0f} {100 * r.mfu:>6.1f} "
            f"{r.peak_gb:>8.2f} {r.step_ms:>8.1f}"
        )
    print(f"\n{'peak GB' if ON_CUDA else 'peak GB: the process peak RSS on CPU'}\n", flush=True)
    checkpoint_stall(engine, cfg)
    print(f"done in {time.perf_counter() - STARTED:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
