"""The in-process re-form's plan at scale (issue 60, table 5): `membership.mirror_ring` over
N ranks on nodes of 8, and `membership.plan_repartition` after one node's 8 ranks died, each
survivor holding its own partition and its ring predecessor's for the last two steps; the
time of each (CPU seconds: the machine's cores are shared), and a check that every mirror
is on another node and that the plan restores every partition.

Usage: PYTHONPATH=platform .venv/bin/python bench/scale/reform_plan.py [--ranks 8 64 256 1024 4096]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from wildtrain.elastic.membership import mirror_ring, plan_repartition

sys.path.insert(0, str(Path(__file__).resolve().parent))
from growth import growth_line, markdown  # noqa: E402

PER_NODE, GENERATION, STEPS = 8, 3, (41, 42)


def timed(f, *args):
    started = time.process_time()
    result = f(*args)
    return result, time.process_time() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 64, 256, 1024, 4096])
    args = parser.parse_args()
    rows, ring_s, plan_s = [], [], []
    for n in args.ranks:
        nodes = [f"node{rank // PER_NODE}" for rank in range(n)]
        ring, t_ring = timed(mirror_ring, nodes)
        assert sorted(ring) == list(range(n))
        # Each rank mirrors its partition to the next in the ring.
        mirror_of = {ring[i]: ring[(i + 1) % n] for i in range(n)}
        same_node = sum(nodes[owner] == nodes[holder] for owner, holder in mirror_of.items())
        dead_node = nodes[0]
        held: list[dict] = []
        predecessor = {holder: owner for owner, holder in mirror_of.items()}
        for rank in range(n):
            if nodes[rank] == dead_node:
                continue
            own = {(GENERATION, n, rank): STEPS}
            if predecessor[rank] != rank:
                own[(GENERATION, n, predecessor[rank])] = STEPS
            held.append(own)
        held.append(None)  # a joiner
        plan, t_plan = timed(plan_repartition, held) if n > PER_NODE else ((None), 0.0)
        restored = "one node: nothing survives" if plan is None else f"{len(plan.sources)}/{n} at step {plan.step}"
        ring_s.append(t_ring)
        plan_s.append(t_plan)
        rows.append(
            [f"{n:,}", f"{n // PER_NODE:,}", f"{t_ring * 1000:.1f} ms", same_node, f"{t_plan * 1000:.1f} ms", restored]
        )
        print(" | ".join(str(c) for c in rows[-1]), flush=True)
    print()
    print(
        markdown(
            [
                "ranks",
                "nodes (8 ranks each)",
                "mirror_ring",
                "mirrors on their own node",
                "plan_repartition (one node lost)",
                "partitions restored",
            ],
            rows,
        )
    )
    print(growth_line("mirror_ring", args.ranks, ring_s))
    big = [(n, t) for n, t in zip(args.ranks, plan_s) if n > PER_NODE]
    print(growth_line("plan_repartition", [n for n, _ in big], [t for _, t in big]))


if __name__ == "__main__":
    main()
