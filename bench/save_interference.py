"""How much a checkpoint save's background half slows training while it runs, by where it runs.

A small model (plain PyTorch, AdamW, CPU) trains; every few steps `AsyncSaver.save_state`
captures its weights and optimizer state, and training goes on while the background half
(torch.save to staging, upload with hashing, read-back verification, commit) runs:

    thread        in a thread of the training process (the GIL and the cores are shared)
    process       in the saver's child process at the training process's priority (the
                  default; no GIL shared, the cores still are)
    process+nice  the same child at niceness 10: the scheduler gives training the cores
                  first, and the save takes longer

Columns: steps = steps timed per case; base ms = mean step with no save in flight; during ms
= mean step while one ran; ratio = during / base (the goal: at most 1.10); save s = mean
background half; steps/save = steps trained during one. With base and during steps taken
alternately, a neighbour's load on a shared machine weighs on both alike.

Usage: .venv/bin/python bench/save_interference.py [--saves 3] [--dim 384] [--layers 6] [--store URI]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch  # noqa: E402
from progress import STARTED, say  # first: its clock starts with the script

from wildtrain.checkpoint.async_save import AsyncSaver, CheckpointMeta  # noqa: E402
from wildtrain.config import ModelConfig  # noqa: E402
from wildtrain.model import Transformer, param_count  # noqa: E402

MODES = (("thread", "thread", 0), ("process", "process", 0), ("process+nice", "process", 10))


@dataclass
class Row:
    mode: str
    base: list[float]
    during: list[float]
    saves: list[float]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--saves", type=int, default=3, help="saves per mode")
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2)
    # One intra-op thread by default: on 2 cores shared with other jobs, two OpenMP threads
    # spin-wait on each other whenever one is descheduled, and step time swings 10x.
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads for training")
    parser.add_argument("--store", default=None, help="checkpoint store URI (default: a temporary local folder)")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = ModelConfig(dim=args.dim, n_layers=args.layers, n_heads=8, max_seq_len=args.seq_len)
    model = Transformer(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len + 1))

    def step() -> float:
        started = time.perf_counter()
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - started

    work = Path(tempfile.mkdtemp(prefix="wildtrain-bench-interference-"))
    store = args.store or str(work / "store")
    for _ in range(2):  # warm-up: allocate the optimizer state
        step()
    state_gb = sum(t.numel() * t.element_size() for t in _state(model, optimizer).values()) / 1e9
    say(
        f"{param_count(cfg) / 1e6:.0f}M parameters, {state_gb:.2f} GB per save, CPU ({torch.get_num_threads()} "
        f"threads), batch {args.batch} x {args.seq_len}; store {store}; setup {time.perf_counter() - STARTED:.0f} s"
    )

    rows = [
        run(label, background, nice, model, optimizer, step, store, work, args) for label, background, nice in MODES
    ]
    print_table(rows)
    if args.store is None:
        shutil.rmtree(work, ignore_errors=True)


def _state(model, optimizer) -> dict[str, torch.Tensor]:
    flat = {f"model/{k}": v for k, v in model.state_dict().items()}
    for i, s in optimizer.state_dict()["state"].items():
        flat |= {f"optim/{i}/{k}": v for k, v in s.items() if torch.is_tensor(v)}
    return flat


def run(label: str, background: str, nice: int, model, optimizer, step, store: str, work: Path, args) -> Row:
    saver = AsyncSaver(
        [store],
        str(work / f"staging-{label}"),
        rank=0,
        world_size=1,
        attempt=label.replace("+", ""),
        background=background,
        nice=nice,
    )
    base, during, saves = [], [], []
    try:
        # One save first, untimed: it allocates the host buffers (and starts the child).
        for number in range(args.saves + 1):
            saver.save_state(
                CheckpointMeta(number, f"step_{number}", 1, 0),
                {"state.pt": {"model": model.state_dict(), "optim": optimizer.state_dict()}},
            )
            steps = []
            while saver.busy:  # train on while the save runs in the background
                steps.append(step())
            [outcome] = saver.drain()
            if outcome.status != "saved":
                raise RuntimeError(f"{label} save {number} {outcome.status}: {outcome.reason}")
            # As many steps with no save in flight, right after: the same neighbours' load.
            quiet = [step() for _ in range(max(3, len(steps)))]
            if number == 0:
                continue
            during += steps
            base += quiet
            saves.append(outcome.background_s)
            say(
                f"  {label} save {number}: {outcome.background_s:.2f} s, {len(steps)} steps during it at "
                f"{statistics.mean(steps) * 1e3:.0f} ms, then {statistics.mean(quiet) * 1e3:.0f} ms without"
            )
    finally:
        saver.close()
    return Row(label, base, during, saves)


def print_table(rows: list[Row]) -> None:
    header = f"{'mode':<13} {'steps':>6} {'base ms':>8} {'during ms':>10} {'ratio':>6} {'save s':>7} {'steps/save':>10}"
    print("\n" + header + "\n" + "-" * len(header))
    for r in rows:
        base, during = statistics.mean(r.base), statistics.mean(r.during)
        print(
            f"{r.mode:<13} {len(r.base) + len(r.during):>6} {base * 1e3:>8.0f} {during * 1e3:>10.0f} "
            f"{during / base:>6.2f} {statistics.mean(r.saves):>7.2f} {len(r.during) / len(r.saves):>10.1f}"
        )


if __name__ == "__main__":
    main()
