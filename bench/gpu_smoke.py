"""GPU smoke test: train through DeepSpeed, save asynchronously, and restore exactly.

On one device, with no network and no Ray. For each ZeRO stage (1 and 3): build the model
(`engine.build_model`, partitioned under ZeRO-3) and the engine, train `--steps` steps of
`train.step.train_step` on batches copied by `DeviceBatches`, save through `AsyncSaver` into
a local folder store, restore the committed checkpoint into a fresh engine, and compare fp32
weights, both Adam moments, the step counts and the LR exactly: the reference is the saved
state itself. Prints a row per stage (losses, first step, tokens/s, the save's stall and
time, the restore's time, whether it restored exactly). Exits 1 on any mismatch or failed
save.

Usage: python bench/gpu_smoke.py [--device cuda|cpu] [--steps 50] [--preset 125m] [--stages 1,3]
(CPU defaults: the tiny preset, short sequences; the test suite runs it with --steps 3.)
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

from progress import STARTED, say  # first: its clock starts with the script


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda when available")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--preset", default=None, help="model preset (default: 125m on cuda, tiny on cpu)")
    parser.add_argument("--seq-len", type=int, default=None, help="default: 1024 on cuda, 64 on cpu")
    parser.add_argument("--batch", type=int, default=None, help="sequences per step (default: 8 on cuda, 4 on cpu)")
    parser.add_argument("--stages", default="1,3", help="ZeRO stages, comma-separated")
    return parser.parse_args()


ARGS = _args()
import torch  # noqa: E402
from one_process import on_cuda  # noqa: E402

ON_CUDA = on_cuda(ARGS.device)

import numpy as np  # noqa: E402

from wildtrain import checkpoint  # noqa: E402
from wildtrain.batching import batch_plan  # noqa: E402
from wildtrain.checkpoint.async_save import AsyncSaver, CheckpointMeta  # noqa: E402
from wildtrain.checkpoint.restore import restore  # noqa: E402
from wildtrain.checkpoint.store import Store  # noqa: E402
from wildtrain.config import load_config  # noqa: E402
from wildtrain.engine import EngineSettings, build_engine, build_model, import_deepspeed  # noqa: E402
from wildtrain.model import flops_per_token, param_count  # noqa: E402
from wildtrain.train.step import DeviceBatches, StepMetrics, train_step  # noqa: E402


def snapshot(engine) -> dict:
    """The full training state as fp32 host tensors (gathered under ZeRO-3)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    optimizer = engine.optimizer
    if hasattr(optimizer, "_hp_optimizer_states_linked"):
        # DeepSpeed 0.19.8, ZeRO-1/2: the optimizer links its parameters to their Adam state
        # once, after the first group's first step, before later groups have any, and a
        # loaded engine that has not stepped has no links at all; (re)link now.
        optimizer._hp_optimizer_states_linked = False
        optimizer._lazy_init_hp_params_optimizer_state()
    state = {"global_steps": engine.global_steps, "lr": engine.get_lr()}
    for name, param in engine.module.named_parameters():
        state[f"param/{name}"] = safe_get_full_fp32_param(param).detach().cpu().clone()
        for moment in ("exp_avg", "exp_avg_sq"):
            state[f"{moment}/{name}"] = safe_get_full_optimizer_state(param, moment).detach().cpu().clone()
    return state


def differences(saved: dict, loaded: dict) -> list[str]:
    wrong = [key for key in saved.keys() | loaded.keys() if key not in saved or key not in loaded]
    for key in saved.keys() & loaded.keys():
        a, b = saved[key], loaded[key]
        same = torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
        if not same:
            wrong.append(key)
    return sorted(wrong)


def run_stage(stage: int, work: Path) -> dict:
    device = torch.device("cuda", torch.cuda.current_device()) if ON_CUDA else torch.device("cpu")
    preset = ARGS.preset or ("125m" if ON_CUDA else "tiny")
    seq_len = ARGS.seq_len or (1024 if ON_CUDA else 64)
    batch = ARGS.batch or (8 if ON_CUDA else 4)
    cfg = load_config(
        [
            f"model={preset}",
            f"deepspeed.zero_stage={stage}",
            "elastic.in_process=false",  # in-process recovery takes ZeRO-1 and ZeRO-2 only
            f"data.seq_len={seq_len}",
            f"train.global_batch_size={batch}",
            f"train.micro_batch_size={batch}",
            f"train.steps={max(ARGS.steps, 1)}",
            "optim.warmup_steps=2",
            "elastic.min_workers=1",
            "elastic.max_workers=1",
        ]
    )
    plan = batch_plan(batch, batch, 1)
    settings = EngineSettings(cfg.model, cfg.optim, cfg.deepspeed, cfg.train.steps, cfg.elastic.collective_timeout_s)
    say(f"ZeRO-{stage}: building the engine")
    torch.manual_seed(0)
    engine = build_engine(settings, plan, build_model(settings, plan, device), device)
    say(
        f"ZeRO-{stage}: {preset} ({param_count(cfg.model) / 1e6:.1f}M parameters), batch {batch}x{seq_len}, "
        f"{'compiled' if engine.is_compiled else 'eager'}, {device}"
    )

    # One fixed batch: the loss must fall, which shows the optimizer steps took effect.
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (batch, seq_len + 1), dtype=np.int32)
    window = StepMetrics(batch * seq_len, flops_per_token(cfg.model, seq_len), None, 1, device)
    losses = []
    first_step_s = None
    for step, (on_device, _) in enumerate(DeviceBatches((tokens for _ in range(ARGS.steps)), device), start=1):
        if on_device.device != device:
            raise RuntimeError(f"the batch is on {on_device.device}, the engine on {device}")
        train_step(engine, plan, on_device, window)
        if step == 1 or step % 10 == 0 or step == ARGS.steps:
            metrics = window.flush()
            losses.append(metrics["loss"])
            if step == 1:
                first_step_s = metrics["step_time_s"]  # start-up: compiling, allocating
            say(
                f"  step {step}: loss {metrics['loss']:.3f}, {metrics['step_time_s'] * 1e3:.0f} ms/step, "
                f"{metrics['tokens_per_s']:.0f} tokens/s"
            )

    say("  saving in the background")
    store = Store.from_uri(str(work / f"store-zero{stage}"))
    saver = AsyncSaver(
        [store], str(work / f"staging-zero{stage}"), rank=0, world_size=1, attempt="smoke", device=device
    )
    meta = CheckpointMeta(
        step=engine.global_steps,
        tag=f"step_{engine.global_steps}",
        world_size=1,
        zero_stage=stage,
        data_position={"step": engine.global_steps},
    )
    saver.save_engine(engine, meta, "{}")
    saved = snapshot(engine)  # after the capture returned: training could go on from here
    if not saver.close(timeout_s=600):
        raise RuntimeError("the async save did not finish within 600 s")
    [outcome] = saver.drain()
    say(
        f"  save: {outcome.status}, stall {outcome.stall_s:.2f} s, background {outcome.background_s:.2f} s, "
        f"{outcome.bytes / 1e9:.2f} GB"
    )
    if outcome.status != "saved":
        raise RuntimeError(f"the async save {outcome.status}: {outcome.reason}")
    del engine
    if ON_CUDA:
        torch.cuda.empty_cache()

    say("  restoring into a new engine")
    started = time.perf_counter()
    restored = restore([store], str(work / f"restore-zero{stage}"), rank=0, world_size=1)
    torch.manual_seed(1)  # another init: a load that restored nothing would show
    fresh = build_engine(settings, plan, build_model(settings, plan, device), device)
    checkpoint.load(fresh, restored.folder, restored.manifest.tag)
    restore_s = time.perf_counter() - started
    wrong = differences(saved, snapshot(fresh))
    say(f"  restore: {restore_s:.2f} s, {'exact' if not wrong else f'{len(wrong)} mismatches: {wrong[:5]}'}")
    del fresh
    if ON_CUDA:
        torch.cuda.empty_cache()
    return {
        "stage": stage,
        "steps": ARGS.steps,
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "first_step_s": first_step_s,
        "tokens_per_s": metrics["tokens_per_s"],
        "stall_s": outcome.stall_s,
        "save_s": outcome.stall_s + outcome.background_s,
        "restore_s": restore_s,
        "exact": not wrong,
    }


def main() -> int:
    say(f"starting DeepSpeed on a process group of one ({'nccl' if ON_CUDA else 'gloo'})")
    deepspeed = import_deepspeed()

    if ON_CUDA:
        torch.cuda.set_device(0)
    deepspeed.init_distributed(dist_backend="nccl" if ON_CUDA else "gloo", verbose=False)
    work = Path(tempfile.mkdtemp(prefix="wildtrain-gpu-smoke-"))
    try:
        rows = [run_stage(int(stage), work) for stage in ARGS.stages.split(",")]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    header = (
        f"{'zero':>4} {'steps':>5} {'loss first':>10} {'loss last':>9} {'step 1 s':>8} {'tokens/s':>9} "
        f"{'stall s':>7} {'save s':>6} {'restore s':>9} {'restored':>8}"
    )
    print("\n" + header + "\n" + "-" * len(header))
    for r in rows:
        print(
            f"{r['stage']:>4} {r['steps']:>5} {r['first_loss']:>10.3f} {r['last_loss']:>9.3f} "
            f"{r['first_step_s']:>8.2f} {r['tokens_per_s']:>9.0f} {r['stall_s']:>7.2f} {r['save_s']:>6.2f} "
            f"{r['restore_s']:>9.2f} {'exact' if r['exact'] else 'MISMATCH':>8}"
        )
    failed = [r["stage"] for r in rows if not r["exact"]]
    if failed:
        print(f"\nFAILED: the restored state differs from the saved one at ZeRO-{failed}", flush=True)
        return 1
    print(f"\nall stages restored exactly in {time.perf_counter() - STARTED:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
