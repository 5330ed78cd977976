"""Whether an in-process re-form compiles the model again: each rebuilt engine against the first.

Issue 24. A re-form builds a new engine over a new module at the new world size
(`checkpointing.restore_from_peers`), and on CUDA the engine compiles (`engine.compiles`):
a large model's cold compile takes minutes (docs/benchmarks.md). This builds wildtrain's
engine, compiled, several times in one process, as a survivor's re-forms do, and times each
one's first step and the frames torch._dynamo compiled for it: none after the first where
the compiled code is reused. Prints a row per engine: its build, its first step and the
frames compiled for it; the first engine's row is the reference (the cold compile).

`--backend eager` (what bench/gpu_all.sh runs on the CPU, in `make test`) has torch._dynamo
trace and cache the frames as with inductor, whose reuse is what is counted, without
inductor's C++ builds (slow on a CPU run's few cores).

Usage: PYTHONPATH=platform .venv/bin/python bench/reform_compile.py [--device cpu|cuda] [--preset tiny]
    [--engines 3] [--backend inductor|eager]
"""

from __future__ import annotations

import argparse
import os
import time
import warnings

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters

from wildtrain.batching import BatchPlan
from wildtrain.config import load_config
from wildtrain.engine import EngineSettings, build_engine, build_model, import_deepspeed
from wildtrain.services import free_port


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--engines", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument(
        "--backend", default="inductor", help="torch.compile's backend, as DeepSpeed's engine passes it"
    )
    args = parser.parse_args()
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cpu":
        os.environ["DS_ACCELERATOR"] = "cpu"
    else:
        torch.cuda.set_device(device)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    import_deepspeed()  # before the group: DeepSpeed's accelerator follows DS_ACCELERATOR
    from deepspeed.accelerator import get_accelerator

    get_accelerator().set_compile_backend(args.backend)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    warnings.simplefilter("ignore")
    cfg = load_config(
        [f"model={args.preset}", "deepspeed.zero_stage=1", "model.compile=true", f"data.seq_len={args.seq_len}"]
    )
    plan = BatchPlan(1, 1, 2)
    settings = EngineSettings(cfg.model, cfg.optim, cfg.deepspeed, cfg.train.steps, cfg.elastic.collective_timeout_s)
    tokens = torch.randint(0, cfg.model.vocab_size, (1, args.seq_len + 1), device=device)
    header = f"{'engine':>6} {'build s':>8} {'first step s':>13} {'frames compiled':>16}"
    print(header + "\n" + "-" * len(header))
    for i in range(args.engines):
        started = time.perf_counter()
        engine = build_engine(settings, plan, build_model(settings, plan, device), device)
        built = time.perf_counter()
        frames = counters["frames"]["ok"]
        loss = engine(tokens[:, :-1], targets=tokens[:, 1:])
        engine.backward(loss)
        engine.step()
        loss.item()  # the step's work done
        print(
            f"{i:>6} {built - started:>8.2f} {time.perf_counter() - built:>13.2f} "
            f"{counters['frames']['ok'] - frames:>16}",
            flush=True,
        )
        del engine, loss
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
