"""Ray 2.60's own replica groups with torchft (issue 24): do survivors train on through a
worker's death, and how soon does its replacement join?

The installed Ray already carries what the issue credited to "after 2.60":
`ray.train.v2.torch.torchft_config.TorchftConfig` runs each worker as a torchft replica
group of one (`worker_group.py`: replica groups of size > 1 are a TODO), and when one fails
its controller replaces only that group at the same placement while the others go on
(`controller.py`, `_replace_bad_workers`), unless the resize decision changes the number of
workers ("TODO: relax this after integrating replica groups with elastic training"): a
smaller cluster still restarts everything. torchft's per-step quorum lets the survivors step
without the failed replica; the replacement recovers the model and optimizer from a live peer.

This script trains a small MLP as three replicas on gloo (torchft's DDP and Optimizer
wrappers, as Ray's `torchft_linear_example.py` does), makes rank 1 raise once, after 20 steps of its own,
and prints, from every worker's own step log: the survivors' longest pause around the
failure and around the join, when the replacement took its first step, and at which step
(recovered from a peer, not from step 0).

What it does not show, and why it does not fit wildtrain as is: each replica holds the whole
model and optimizer (no ZeRO sharding across replicas), the global batch is the quorum's
(it shrinks while a replica is missing, so losses differ from an uninterrupted run), and
`ray.train.report` needs every worker (Ray's example reports only with all present).

torchft is not a wildtrain dependency; beside the venv's OpenTelemetry (1.45.2), to run:
    .venv/bin/pip install --target /tmp/tftlib --no-deps torchft==0.2.0 \\
        opentelemetry-exporter-otlp-proto-http==1.45.2 opentelemetry-exporter-otlp-proto-common==1.45.2 \\
        opentelemetry-exporter-otlp-common==0.66b2 opentelemetry-exporter-http-transport==0.66b2
    PYTHONPATH=/tmp/tftlib .venv/bin/python bench/torchft_replicas_spike.py [--steps 400]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import ray
import ray.train
import torch
import torch.nn as nn
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
from ray.train.v2.torch.torchft_config import TorchftConfig

FAIL_RANK, FAIL_AFTER_STEPS = 1, 20  # of its own: replicas start seconds apart here, the first alone
STEP_S = 0.05  # a step's floor: the replacement's start spans many steps


def train_func(config: dict) -> None:
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo
    from torchft.checkpointing.pg_transport import PGTransport

    rank = ray.train.get_context().get_world_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    pg = ProcessGroupGloo(timeout=timedelta(seconds=30))

    def load(state: dict) -> None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])

    manager = Manager(pg=pg, min_replica_size=1, load_state_dict=load,
                      state_dict=lambda: {"model": model.state_dict(), "optim": optimizer.state_dict()},
                      world_size=1, rank=0, replica_id=f"replica{rank}", timeout=timedelta(seconds=60),
                      checkpoint_transport=PGTransport(pg, timeout=timedelta(seconds=30), device=torch.device("cpu")))
    model, optimizer = DistributedDataParallel(manager, model), Optimizer(manager, optimizer)
    data = torch.Generator().manual_seed(rank)
    failed = Path(config["failed_marker"])
    with open(config["log"], "a", buffering=1) as log:
        taken = 0
        while manager.current_step() < config["steps"]:
            started = time.perf_counter()
            x = torch.randn(32, 64, generator=data)
            optimizer.zero_grad()
            ((model(x) - x) ** 2).mean().backward()
            optimizer.step()
            time.sleep(max(0.0, STEP_S - (time.perf_counter() - started)))
            step, taken = manager.current_step(), taken + 1
            log.write(f"{rank} {os.getpid()} {step} {time.time():.4f} {manager.num_participants()}\n")
            if rank == FAIL_RANK and taken >= FAIL_AFTER_STEPS and not failed.exists():
                failed.write_text(f"{time.time():.4f}")
                raise RuntimeError(f"replica {rank} fails at step {step} (drill)")
    manager.shutdown()  # else a finished replica's peers wait in its quorum


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=400)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="torchft-spike-"))
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}})
    trainer = TorchTrainer(
        train_func, train_loop_config={"steps": args.steps, "log": str(folder / "steps.log"),
                                       "failed_marker": str(folder / "failed")},
        scaling_config=ScalingConfig(num_workers=3, use_gpu=False),
        torch_config=TorchftConfig(lighthouse_kwargs={"min_replicas": 1}, backend="gloo"),
        run_config=RunConfig(storage_path=str(folder / "ray"), failure_config=FailureConfig(max_failures=1)),
    )
    started = time.time()
    trainer.fit()
    print(f"fit: {time.time() - started:.1f} s, {args.steps} steps")
    print_table(folder)


def print_table(folder: Path) -> None:
    failed_at = float((folder / "failed").read_text())
    workers: dict[tuple[int, int], list[tuple[int, float, int]]] = {}
    for line in (folder / "steps.log").read_text().splitlines():
        rank, pid, step, at, participants = line.split()
        workers.setdefault((int(rank), int(pid)), []).append((int(step), float(at) - failed_at, int(participants)))
    replacement = max((key for key in workers if key[0] == FAIL_RANK), key=lambda key: workers[key][0][1])
    joined_at = workers[replacement][0][1]
    print("| worker | steps logged | first step (s from the failure) | longest pause around the failure | "
          "longest pause around the join |")
    print("|---|---|---|---|---|")
    for (rank, pid), steps in sorted(workers.items(), key=lambda item: item[1][0][1]):
        def pause(around: float) -> str:
            gaps = [b[1] - a[1] for a, b in zip(steps, steps[1:]) if around - 2 <= b[1] <= around + 5]
            return f"{max(gaps):.2f} s" if gaps else "-"
        role = "replacement" if (rank, pid) == replacement else ("failed" if rank == FAIL_RANK else "survivor")
        first_step, first_at, _ = steps[0]
        print(f"| rank {rank} ({role}) | {len(steps)} | step {first_step} at {first_at:+.2f} | {pause(0.0)} | "
              f"{pause(joined_at)} |")
    print(f"\nThe replacement's first step: {joined_at:.2f} s after the failure, at step "
          f"{workers[replacement][0][0]} (recovered from a peer). A step takes >= {STEP_S} s.")


if __name__ == "__main__":
    main()
