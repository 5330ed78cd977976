"""One process of tests/unit/test_peer_commits.py's drill: three members commit steps as an
in-process attempt does (`generations.PeerCommits`: each step's mirrors go on beside the
next step, and a step commits with the next one's commit), member 2 dies `--dies` (in step
`DEATH_STEP` before its commit, or in the step after it), once its last mirrors reached its
successor, as they do while a step trains. The two survivors fail in the next step's
gradient reduction, drop their attempt and gather the state in generation 2.

    python -m tests.helpers.commit_drill --store-port P --rank R --dies after-commit --out DIR

Each survivor writes `survivor<rank>.pt`: the step it last knew committed, the states it
left, and the step generation 2 continues from and its partition of that state.
"""

from __future__ import annotations

import argparse
import os
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from tests.helpers.mirror_gather import GROUP_SIZES, empty_engine, engine_of
from tests.helpers.zero_resize import join
from wildtrain.elastic.connections import GroupConnections
from wildtrain.elastic.peer_state import Mirrors, load_partitions, partition
from wildtrain.train import checkpointing, collectives
from wildtrain.train.generations import PeerCommits, Unreported
from wildtrain.train.state import TrainState
from wildtrain.train.step import StepMetrics

WORLD, DEATH_STEP, LAST_STEP = 3, 3, 4
MOVED_BY_A_STEP = 10_000.0  # what each step adds to every value of the state


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--store-port", type=int, required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--dies", choices=["before-commit", "after-commit"], required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    store = dist.TCPStore("127.0.0.1", args.store_port, is_master=False, timeout=timedelta(seconds=60))
    mirrors = Mirrors(keep_steps=3)
    connections = GroupConnections()
    with connections:
        mirrors.group = join(store, 1, args.rank, WORLD)
        collectives.open_control_group(60)
    member = SimpleNamespace(
        member=SimpleNamespace(mirrors=mirrors), generation=SimpleNamespace(number=1, world_size=WORLD)
    )
    engine = engine_of(args.rank, WORLD)
    state = TrainState(step=0, world_size=WORLD)
    window = StepMetrics(1, 1.0, None, WORLD, torch.device("cpu"))
    commits = PeerCommits(member, state, [str(rank) for rank in range(WORLD)])
    commits.commit(engine, state, window, flush=True)  # as a new attempt does, before its first step
    seen = []  # (step, committed) after each commit
    try:
        for step in range(1, LAST_STEP + 1):
            if args.rank == 2 and step == DEATH_STEP + (args.dies == "after-commit"):
                mirrors.settle()  # its last mirrors went out
                os._exit(0)
            dist.all_reduce(torch.ones(1))  # the step's gradient reduction: where a death shows
            for fp32 in engine.optimizer.single_partition_of_fp32_groups:
                fp32.add_(MOVED_BY_A_STEP)  # the optimizer step
            for moments in engine.optimizer.optimizer.state.values():
                for name in moments:
                    moments[name] = moments[name] + MOVED_BY_A_STEP
            state.step, state.tokens_seen = step, 100 * step
            commits.commit(engine, state, window)
            seen.append((step, commits.committed))
        raise AssertionError(f"rank {args.rank} committed every step though rank 2 died")
    except RuntimeError:  # the collective that lost rank 2
        connections.hang_up()  # frees the peer that waits on this rank, as `Member.lost_member` does
        mirrors.drop_in_flight()
    left = commits.leftovers(None, Unreported([], [], [], {}), [], saving=None)
    dist.destroy_process_group()
    mirrors.group = join(store, 2, args.rank, WORLD - 1)
    collectives.open_control_group(60)
    held = checkpointing.gather_from_peers(mirrors, left.states, WORLD - 1)
    rebuilt = empty_engine(WORLD - 1, [WORLD * n for n in GROUP_SIZES])
    load_partitions(rebuilt, held.mirrors, held.reform)
    torch.save(
        {
            "seen": seen,
            "committed": commits.committed,
            "states": sorted(left.states),
            "step": held.state.step,
            "tokens_seen": held.state.tokens_seen,
            "partition": partition(rebuilt),
        },
        args.out / f"survivor{args.rank}.pt",
    )


if __name__ == "__main__":
    main()
