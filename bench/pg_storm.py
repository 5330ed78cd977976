"""What a worker group's lost placement bundle costs the head node, with Ray's metrics on and off.

With elastic.in_process the survivors train on in the worker group Ray Train started, whose
placement group still holds the dead worker's bundle. Ray 2.60's GCS reschedules a bundle
whose node died at once and again at once after each failure (a RESCHEDULING group goes back
to the front of its queue with no backoff: `gcs_create_placement_group_retry_*` do not apply),
so until a node can take the bundle it retries without pause, and records a histogram sample
per try that the head's dashboard agent ingests one by one, long after the retries end.

This script makes that happen on a fake cluster (a placement group of two bundles, one
bundle's node removed, a node added back after a while) and prints, per phase, the CPU the GCS
and the head's dashboard agent use and how often the GCS tried to place the group. One
cluster with Ray's metrics on (the default), one with `enable_metrics_collection` off, and one
whose group is STRICT_SPREAD (`cluster.placement_strategy`): there the lost bundle fits no
node left (each holds a bundle of the group already), and the GCS files it as infeasible, to
be tried again when a node registers, not at once (`OnPlacementGroupCreationFailed` in Ray's
`gcs_placement_group_manager.cc`: only a bundle that could fit somewhere is retried at once).

Nodes of several workers (two here, as nodes of several GPUs hold several) twice: a bundle a
worker, as Ray Train places a group (PACK: a lost bundle fits a node left by its totals), and
a bundle a node, STRICT_SPREAD, each holding its node's two workers (`Slot` actors placed in
it by bundle index), the shape that would let such a group wait for a node as one-worker
nodes do; there a worker is placed in the lost bundle again once a node is back.

With `--spare`, the STRICT_SPREAD group of one-worker nodes again, beside a third node whose
worker slot a spare holds (`elastic.spares`: an actor outside the group, where a worker's
resources are free beyond it). The lost bundle fits that node by its totals, though not by
what is free there, so the GCS may retry it at once as in the PACK rows.

Usage: PYTHONPATH=platform .venv/bin/python bench/pg_storm.py [--phase-s 15] [--several] [--spare]
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

import psutil
import ray
from ray.cluster_utils import Cluster
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))
from wildtrain import services  # noqa: E402

SLOT = "bench_slot"
# Print the GCS's event counts every second (Ray's default: a minute) to count its tries.
STATS = {"event_stats_print_interval_ms": 1000}
TRIES = re.compile(r"GcsPlacementGroupManager\.SchedulePendingPlacementGroups - (\d+) total")


def gcs_tries(cluster: Cluster) -> int:
    """How often the GCS has tried to place a pending placement group, as it last printed."""
    log = Path(cluster.head_node.get_session_dir_path()) / "logs" / "gcs_server.out"
    counts = TRIES.findall(log.read_text(errors="replace"))
    return int(counts[-1]) if counts else 0


def head_processes(cluster: Cluster) -> dict[str, psutil.Process]:
    head = cluster.head_node.all_processes
    gcs = psutil.Process(head["gcs_server"][0].process.pid)
    raylet = psutil.Process(head["raylet"][0].process.pid)
    agent = next(p for p in raylet.children() if "DashboardAgent" in " ".join(p.cmdline()))
    return {"gcs": gcs, "agent": agent}


def measure(cluster: Cluster, seconds: float) -> dict[str, float]:
    procs = head_processes(cluster)
    cpu0 = {name: sum(p.cpu_times()[:2]) for name, p in procs.items()}
    tries0 = gcs_tries(cluster)
    time.sleep(seconds)
    cpu = {name: (sum(p.cpu_times()[:2]) - cpu0[name]) / seconds for name, p in procs.items()}
    return cpu | {"tries_per_s": (gcs_tries(cluster) - tries0) / seconds}


@ray.remote(num_cpus=0, resources={SLOT: 1})
class Slot:
    """A worker's share of a bundle that holds a node's workers."""

    def ready(self) -> bool:
        return True


def run(
    label: str,
    system_config: dict,
    phase_s: float,
    strategy: str = "SPREAD",
    workers_per_node: int = 1,
    bundle_per_node: bool = False,
    spare: bool = False,
) -> list[tuple]:
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "_system_config": services.NODE_HEALTH_CHECKS | STATS | system_config},
    )
    rows = []
    node = {SLOT: workers_per_node}
    bundles = [node] * 2 if bundle_per_node else [{SLOT: 1}] * (2 * workers_per_node)
    try:
        nodes = [cluster.add_node(num_cpus=1, resources=node) for _ in range(3 if spare else 2)]
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, logging_level="ERROR")
        group = placement_group(bundles, strategy=strategy)
        ray.get(group.ready(), timeout=60)
        if spare:  # outside the group, on the node its bundles left free; referenced, so it stays
            held = Slot.remote()
            ray.get(held.ready.remote(), timeout=60)
        if bundle_per_node:
            ray.get(
                [in_bundle(group, index).ready.remote() for index in range(2) for _ in range(workers_per_node)],
                timeout=60,
            )
        rows.append((label, "both nodes' bundles placed", measure(cluster, phase_s)))
        # The node of the group's bundle 1 (with a spare, Ray chose two of the three).
        holder = placement_group_table(group)["bundles_to_node_id"][1]
        cluster.remove_node(next(n for n in nodes if n.node_id == holder), allow_graceful=False)
        time.sleep(3)  # the node's death is noticed (health checks: about 2 s)
        rows.append((label, "a node lost", measure(cluster, phase_s)))
        cluster.add_node(num_cpus=1, resources=node)
        ray.get(group.ready(), timeout=60)
        if bundle_per_node:  # the lost bundle placed again takes a worker
            ray.get(in_bundle(group, 1).ready.remote(), timeout=60)
        rows.append((label, "a node back, its bundles placed", measure(cluster, phase_s)))
        rows.append((label, f"{phase_s:g} s later", measure(cluster, phase_s)))
        remove_placement_group(group)
    finally:
        ray.shutdown()
        cluster.shutdown()
    return rows


def in_bundle(group, index: int):
    """A `Slot` placed in bundle `index` of `group`, as Ray Train places a worker in its bundle."""
    return Slot.options(
        scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index)
    ).remote()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--phase-s", type=float, default=15.0, help="seconds each phase is measured")
    parser.add_argument("--several", action="store_true", help="also nodes of two workers, in both bundle shapes")
    parser.add_argument("--spare", action="store_true", help="also a STRICT_SPREAD group beside a spare's node")
    args = parser.parse_args()
    rows = run("Ray metrics on (default)", {}, args.phase_s)
    rows += run("Ray metrics off", services.RAY_METRICS_OFF, args.phase_s)
    rows += run("Ray metrics on, STRICT_SPREAD group", {}, args.phase_s, strategy="STRICT_SPREAD")
    if args.several:
        rows += run(
            "nodes of two workers, a bundle a worker, PACK", {}, args.phase_s, strategy="PACK", workers_per_node=2
        )
        rows += run(
            "nodes of two workers, a bundle a node, STRICT_SPREAD",
            {},
            args.phase_s,
            strategy="STRICT_SPREAD",
            workers_per_node=2,
            bundle_per_node=True,
        )
    if args.spare:
        rows += run(
            "Ray metrics on, STRICT_SPREAD group, a spare's node beside it",
            {},
            args.phase_s,
            strategy="STRICT_SPREAD",
            spare=True,
        )
    print("\n| cluster | phase | GCS CPU (cores) | head dashboard agent CPU (cores) | GCS placement tries/s |")
    print("|---|---|---|---|---|")
    for label, phase, m in rows:
        print(f"| {label} | {phase} | {m['gcs']:.2f} | {m['agent']:.2f} | {m['tries_per_s']:,.0f} |")


if __name__ == "__main__":
    main()
