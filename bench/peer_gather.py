"""How long a re-form's gather of the state from the peers' host copies takes
(`elastic.peer_state.Mirrors.gather`), against the gather it replaced (every rank's share
pickled, through `torch.save`, and all-gathered as objects), side by side in one run.

The spare's case of issue 24: two ranks of a new generation on gloo, one (the survivor)
holding both partitions of the old layout of two ranks (its own and its mirror of the dead
rank's), the other (the spare) holding nothing; each receives the whole state. Sizes: the
tiny model's (0.48 M parameters) and larger ones. Each trial is timed on both ranks from
a barrier; the table has the median of the slower rank.

Usage: PYTHONPATH=platform:bench .venv/bin/python bench/peer_gather.py [--params 0.48 10 50] [--trials 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from wildtrain.elastic.membership import plan_repartition
from wildtrain.elastic.peer_state import Mirrors

OLD_WORLD, STEP = 2, 1


def replaced_gather(mirrors: Mirrors) -> list[torch.Tensor]:
    """The gather before this change: the held steps and then the partitions themselves as objects."""
    world, rank = dist.get_world_size(), dist.get_rank()
    held: list = [None] * world
    dist.all_gather_object(held, mirrors.held())
    plan = plan_repartition(held)
    mine = {old: mirrors.snapshots[(*plan.layout, old)][plan.step]
            for old, source in enumerate(plan.sources) if source == rank}
    parts: list = [None] * world
    dist.all_gather_object(parts, mine)
    by_old = {old: state for sent in parts for old, state in sent.items()}
    return [torch.cat([by_old[old][group] for old in range(plan.layout[1])], dim=1) for group in range(len(by_old[0]))]


def survivor_mirrors(params: int) -> Mirrors:
    """A survivor's copies after a death in a layout of two: its partition and its mirror of the dead one's."""
    mirrors = Mirrors()
    mirrors.use_layout(1, OLD_WORLD)
    for old in range(OLD_WORLD):
        # Partitions as ZeRO cuts them: two parameter groups, [3, n] each (weights and AdamW's moments).
        mirrors.snapshots[(1, OLD_WORLD, old)] = {STEP: [torch.randn(3, params // OLD_WORLD - 1000),
                                                         torch.randn(3, 1000)]}
    return mirrors


def rank_main(rank: int, store_path: str, sizes: list[int], trials: int, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=300))
    for params in sizes:
        mirrors = survivor_mirrors(params) if rank == 0 else Mirrors()
        for trial in range(trials):
            for name, gather in (("objects (before)", replaced_gather),
                                 ("tensors (now)", lambda m: m.gather(fresh=False)[1])):
                dist.barrier()
                started = time.perf_counter()
                full = gather(mirrors)
                took = torch.tensor([time.perf_counter() - started])
                dist.all_reduce(took, op=dist.ReduceOp.MAX)
                assert sum(group.numel() for group in full) == 3 * params
                if rank == 0:
                    results.append((params, name, took.item()))
    dist.destroy_process_group()
    # torch's teardown at a normal exit aborts a gloo rank now and then ("terminate called
    # without an active exception"), which fails the spawn: the results are handed over.
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, nargs="+", default=[0.48, 10, 50], help="millions of parameters")
    parser.add_argument("--trials", type=int, default=5)
    args = parser.parse_args()
    sizes = [int(p * 1e6) for p in args.params]
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        results = manager.list()
        mp.spawn(rank_main, args=(os.path.join(tmp, "store"), sizes, args.trials, results), nprocs=2)
        rows = list(results)
    print("\n| parameters | state received by the spare | gather: objects (before) | gather: tensors (now) | ratio |")
    print("|---|---|---|---|---|")
    for params in sizes:
        times = {name: statistics.median(t for p, n, t in rows if p == params and n == name)
                 for name in ("objects (before)", "tensors (now)")}
        before, now = times["objects (before)"], times["tensors (now)"]
        print(f"| {params / 1e6:g} M | {12 * params / 2**20:,.0f} MiB | {before:.3f} s | {now:.3f} s | {now / before:.2f}x |")
    print(f"\nmedian of {args.trials} trials, the slower rank's time from a barrier; 2 gloo ranks on this machine")


if __name__ == "__main__":
    main()
