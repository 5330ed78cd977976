"""One process of tests/unit/test_peer_state.py's gather drill: the members of generation 1,
on the nodes `--nodes` names (one per rank), mirror their partitions; the members `--dead`
names die (a node's death takes all of its ranks), and the others form generation 2 with a
joiner that holds nothing (a spare taking a place); every rank of generation 2 assembles its
partition of the state at the new size.

    python -m tests.helpers.mirror_gather --store-port P --rank R --nodes a,b,c --dead 0 --out DIR

Ranks 0 to len(nodes) - 1 are generation 1's members, the last rank the joiner. Each rank of
generation 2 writes `gathered<new rank>.pt`: the plan's holders and step, its new partition
and the weights of every rank, or `lost<new rank>.txt`: why it cannot be (`RedundancyLost`).
"""

from __future__ import annotations

import argparse
import os
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from tests.helpers.zero_resize import join
from wildtrain.elastic.membership import Cut, RedundancyLost
from wildtrain.elastic.peer_state import Mirrors, load_partitions, partition

STEP = 5
GROUP_SIZES = (5, 3)  # two parameter groups, partitioned alike on every rank


def partition_values(old_rank: int, group: int) -> torch.Tensor:
    """Old rank `old_rank`'s [3, n] state of parameter group `group` (weights and AdamW's two
    moments), distinct everywhere."""
    n = GROUP_SIZES[group]
    return torch.arange(3 * n, dtype=torch.float32).reshape(3, n) + 1000 * old_rank + 100 * group


def engine_of(old_rank: int, world: int) -> SimpleNamespace:
    """What `peer_state.partition` reads of a ZeRO-1/2 engine, holding `partition_values`."""
    fp32 = [partition_values(old_rank, group)[0].clone() for group in range(len(GROUP_SIZES))]
    state = {
        p: {"exp_avg": partition_values(old_rank, g)[1], "exp_avg_sq": partition_values(old_rank, g)[2]}
        for g, p in enumerate(fp32)
    }
    weights = [torch.zeros(world * n) for n in GROUP_SIZES]  # every rank's, flat
    return SimpleNamespace(
        optimizer=SimpleNamespace(
            single_partition_of_fp32_groups=fp32,
            bit16_groups_flat=weights,
            bit16_groups=[[flat] for flat in weights],
            optimizer=SimpleNamespace(state=state, defaults={}),
        )
    )


def empty_engine(world: int, numels: list[int]) -> SimpleNamespace:
    """What `peer_state.load_partitions` writes of a ZeRO-1/2 engine just built at `world`
    ranks for parameter groups of `numels` values, cut as DeepSpeed cuts them; NaN where the
    load must write."""
    cut = Cut.of(numels, world)
    weights = [torch.full((world * size,), float("nan")) for size in cut.sizes]
    return SimpleNamespace(
        optimizer=SimpleNamespace(
            single_partition_of_fp32_groups=[torch.full((size,), float("nan")) for size in cut.sizes],
            bit16_groups_flat=weights,
            bit16_groups=[[flat[:numel]] for flat, numel in zip(weights, numels)],
            optimizer=SimpleNamespace(state={}, defaults={}),
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--store-port", type=int, required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--nodes", type=lambda text: text.split(","), required=True)
    parser.add_argument("--dead", type=lambda text: [int(rank) for rank in text.split(",")], required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    old_world = len(args.nodes)
    store = dist.TCPStore("127.0.0.1", args.store_port, is_master=False, timeout=timedelta(seconds=60))
    mirrors = Mirrors()
    if args.rank < old_world:
        join(store, 1, args.rank, old_world)
        mirrors.use_layout(1, old_world, args.nodes)
        mirrors.exchange(engine_of(args.rank, old_world), STEP)
        mirrors.settle()
        dist.barrier()  # every mirror in place: then the dead die
        if args.rank in args.dead:
            os._exit(0)
        dist.destroy_process_group()
    members = [r for r in range(old_world) if r not in args.dead] + [old_world]
    rank = members.index(args.rank)
    join(store, 2, rank, len(members))
    try:
        reform = mirrors.agree(fresh=False)
    except RedundancyLost as lost:
        (args.out / f"lost{rank}.txt").write_text(str(lost))
        return
    engine = empty_engine(len(members), [old_world * n for n in GROUP_SIZES])
    load_partitions(engine, mirrors, reform)
    torch.save(
        {
            "holders": reform.repartition.holders,
            "step": reform.step,
            "partition": partition(engine),
            "weights": engine.optimizer.bit16_groups_flat,
        },
        args.out / f"gathered{rank}.pt",
    )


if __name__ == "__main__":
    main()
