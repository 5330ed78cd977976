"""Training stall per checkpoint: synchronous saves against `AsyncSaver`, on the same state.

One DeepSpeed engine (the 125m preset, ZeRO-1, one rank; CPU here, CUDA + bf16 where
available) trains a few small steps between saves. Each mode saves the same state to the
same kind of store through the same upload, verification and commit:

    sync    DeepSpeed's save_checkpoint to a local staging folder, then upload + verify
            + commit, all on the training thread (what a blocking save costs)
    local   the DeepSpeed save to local disk alone, measured inside `sync`: the stall of a
            design that saves synchronously to local disk and only uploads in the background
    async   AsyncSaver.save_engine: the training thread only captures host copies; the
            staging write, upload, verify and commit run in the background while training
            continues

Columns: stall = the training thread blocked in the save call; save = from the call until
the checkpoint is committed; MB/s = bytes / save; step x = mean step time while a background
save runs, relative to steps with none (the cost of sharing cores and memory bandwidth).
Last, one restore of the newest checkpoint (download + verify).

Usage: .venv/bin/python bench/checkpoint_stall.py [--saves 2] [--steps-between 2] [--seq-len 64] [--store URI]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from progress import STARTED, say  # first: its clock starts with the script

from wildtrain import services

CUDA_REQUESTED = os.environ.get("DS_ACCELERATOR") != "cpu"
import torch  # noqa: E402

ON_CUDA = CUDA_REQUESTED and torch.cuda.is_available()
if not ON_CUDA:
    os.environ["DS_ACCELERATOR"] = "cpu"  # before deepspeed is imported
os.environ.update(
    MASTER_ADDR=services.HOST, MASTER_PORT=str(services.free_port()), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1"
)

from wildtrain import checkpoint  # noqa: E402
from wildtrain.batching import batch_plan  # noqa: E402
from wildtrain.checkpoint.async_save import AsyncSaver, CheckpointMeta  # noqa: E402
from wildtrain.checkpoint.format import checkpoint_name  # noqa: E402
from wildtrain.checkpoint.restore import restore  # noqa: E402
from wildtrain.checkpoint.store import Store, commit, commit_when_complete, upload, write_part  # noqa: E402
from wildtrain.config import config_hash, load_config  # noqa: E402
from wildtrain.engine import EngineSettings, build_engine, import_deepspeed  # noqa: E402
from wildtrain.model import Transformer, param_count  # noqa: E402


@dataclass
class Row:
    mode: str
    stalls: list[float]
    saves: list[float]
    bytes: int
    step_base_s: float
    step_during_s: float


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--saves", type=int, default=2, help="saves per mode")
    parser.add_argument("--steps-between", type=int, default=2, help="training steps between saves")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--store", default=None, help="checkpoint store URI (default: a temporary local folder)")
    args = parser.parse_args()

    say(f"starting DeepSpeed on a process group of one ({'nccl' if ON_CUDA else 'gloo'}), building the 125M engine")
    deepspeed = import_deepspeed()

    deepspeed.init_distributed(dist_backend="nccl" if ON_CUDA else "gloo", verbose=False)
    cfg = load_config(
        [
            "model=125m",
            f"data.seq_len={args.seq_len}",
            "train.global_batch_size=1",
            "train.micro_batch_size=1",
            "deepspeed.zero_stage=1",
            "elastic.max_workers=1",
        ]
    )
    torch.manual_seed(0)
    device = torch.device("cuda" if ON_CUDA else "cpu")
    model = Transformer(cfg.model).to(device)
    engine = build_engine(
        EngineSettings(cfg.model, cfg.optim, cfg.deepspeed, cfg.train.steps, cfg.elastic.collective_timeout_s),
        batch_plan(1, 1, 1),
        model,
        device,
    )
    tokens = torch.randint(0, cfg.model.vocab_size, (1, args.seq_len + 1), device=device)

    def step() -> float:
        started = time.perf_counter()
        loss = engine(tokens[:, :-1], tokens[:, 1:])
        engine.backward(loss)
        engine.step()
        if ON_CUDA:
            torch.cuda.synchronize()
        return time.perf_counter() - started

    work = Path(tempfile.mkdtemp(prefix="wildtrain-bench-ckpt-"))
    store = Store.from_uri(args.store or str(work / "store"))
    say(
        f"{param_count(cfg.model) / 1e6:.0f}M parameters, ZeRO-1, 1 rank, {'CUDA' if ON_CUDA else 'CPU'} "
        f"({torch.get_num_threads()} threads); store {store.uri}; 2 warm-up steps"
    )
    for _ in range(2):  # warm-up: allocate the optimizer state
        step()
    say(f"setup {time.perf_counter() - STARTED:.0f} s")

    rows = [*run_sync(engine, cfg, store, work, step, args), run_async(engine, cfg, store, work, step, args)]
    print_table(rows)

    say("restoring the newest checkpoint")
    local = work / "restore"
    started = time.perf_counter()
    restored = restore([store], str(local), rank=0, world_size=1)
    seconds = time.perf_counter() - started
    print(
        f"\nrestore (download + verify) of step {restored.manifest.step}: {seconds:.2f} s, "
        f"{restored.bytes_read / 1e9:.2f} GB, {restored.bytes_read / seconds / 1e6:.0f} MB/s"
    )
    checkpoint.load(engine, restored.folder, restored.manifest.tag)  # the committed files load into DeepSpeed
    if args.store is None:
        shutil.rmtree(work, ignore_errors=True)


def _meta(engine, cfg, step: int) -> CheckpointMeta:
    return CheckpointMeta(
        step=step,
        tag=f"step_{step}",
        world_size=1,
        zero_stage=cfg.deepspeed.zero_stage,
        data_position={"step": step},
        config_hash=config_hash(cfg),
    )


def run_sync(engine, cfg, store: Store, work: Path, step, args) -> tuple[Row, Row]:
    """The blocking save, and within it the part that a design which only uploads in the
    background would still block on: DeepSpeed's own save to a local folder."""
    say(f"sync: {args.saves} blocking saves, {args.steps_between} steps before each")
    stalls, local_stalls, sizes, base = [], [], [], []
    for i in range(args.saves):
        base += [step() for _ in range(args.steps_between)]
        number = engine.global_steps
        name = checkpoint_name(number, "sync")
        folder = work / "staging-sync" / name
        started = time.perf_counter()
        checkpoint.save(engine, str(folder), f"step_{number}", "{}", 0)
        local_stalls.append(time.perf_counter() - started)
        files = upload(str(folder), store, name)
        write_part(store, name, 0, files)
        meta = _meta(engine, cfg, number)
        failed = commit_when_complete(
            [(store, time.monotonic() + cfg.checkpoint.timeout_s)],
            name,
            1,
            lambda store, files: commit(
                store,
                name,
                step=meta.step,
                tag=meta.tag,
                world_size=1,
                zero_stage=meta.zero_stage,
                files=files,
                data_position=meta.data_position,
                config_hash=meta.config_hash,
            ),
        )
        if failed:
            raise failed[store.uri]
        stalls.append(time.perf_counter() - started)
        sizes.append(sum(f.bytes for f in files))
        shutil.rmtree(folder)
        say(f"  sync save {i + 1}: stall {stalls[-1]:.2f} s, of which DeepSpeed's local save {local_stalls[-1]:.2f} s")
    step_s = statistics.mean(base)
    return (
        Row("sync", stalls, stalls, max(sizes), step_s, step_s),
        Row("local", local_stalls, stalls, max(sizes), step_s, step_s),
    )


def run_async(engine, cfg, store: Store, work: Path, step, args) -> Row:
    say(f"async: {args.saves} background saves, training on while each runs")
    saver = AsyncSaver(
        [store],
        str(work / "staging-async"),
        rank=0,
        world_size=1,
        attempt="async",
        device=next(engine.module.parameters()).device,
    )
    stalls, saves, sizes, base, during = [], [], [], [], []
    try:
        for i in range(args.saves):
            base += [step() for _ in range(args.steps_between)]
            started = time.perf_counter()
            admission = saver.save_engine(engine, _meta(engine, cfg, engine.global_steps), "{}")
            if admission.action != "start":
                raise RuntimeError(f"the bench waits for each save, yet save {i + 1} did not start: {admission.reason}")
            while saver.busy:  # train on while the save runs in the background
                during.append(step())
            [outcome] = saver.drain()
            if outcome.status != "saved":
                raise RuntimeError(f"async save {i + 1} {outcome.status}: {outcome.reason}")
            stalls.append(outcome.stall_s)
            saves.append(outcome.stall_s + outcome.background_s)
            sizes.append(outcome.bytes)
            say(
                f"  async save {i + 1}: stall {outcome.stall_s:.2f} s, committed after {saves[-1]:.2f} s "
                f"({time.perf_counter() - started:.2f} s wall with steps)"
            )
    finally:
        saver.close()
    return Row("async", stalls, saves, max(sizes), statistics.mean(base), statistics.mean(during or base))


def print_table(rows: list[Row]) -> None:
    header = f"{'mode':<6} {'stall/save s':>14} {'max stall s':>11} {'save s':>8} {'GB':>6} {'MB/s':>6} {'step x':>7}"
    print("\n" + header + "\n" + "-" * len(header))
    for r in rows:
        save_s = statistics.mean(r.saves)
        print(
            f"{r.mode:<6} {statistics.mean(r.stalls):>14.2f} {max(r.stalls):>11.2f} {save_s:>8.2f} "
            f"{r.bytes / 1e9:>6.2f} {r.bytes / save_s / 1e6:>6.0f} {r.step_during_s / r.step_base_s:>7.2f}"
        )
    sync, local, async_ = rows
    print(
        f"\nasync/sync stall ratio: {statistics.mean(async_.stalls) / statistics.mean(sync.stalls):.3f}"
        f" (async/local: {statistics.mean(async_.stalls) / statistics.mean(local.stalls):.3f})"
    )


if __name__ == "__main__":
    main()
