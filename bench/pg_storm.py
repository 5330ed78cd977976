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

    PYTHONPATH=platform .venv/bin/python bench/pg_storm.py [--phase-s 15]
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
from ray.util.placement_group import placement_group, remove_placement_group

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


def run(label: str, system_config: dict, phase_s: float, strategy: str = "SPREAD") -> list[tuple]:
    cluster = Cluster(initialize_head=True,
                      head_node_args={"num_cpus": 2, "_system_config": services.NODE_HEALTH_CHECKS | STATS | system_config})
    rows = []
    try:
        nodes = [cluster.add_node(num_cpus=1, resources={SLOT: 1}) for _ in range(2)]
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, logging_level="ERROR")
        group = placement_group([{SLOT: 1}, {SLOT: 1}], strategy=strategy)
        ray.get(group.ready(), timeout=60)
        rows.append((label, "both bundles placed", measure(cluster, phase_s)))
        cluster.remove_node(nodes[1], allow_graceful=False)
        time.sleep(3)  # the node's death is noticed (health checks: about 2 s)
        rows.append((label, "a bundle's node lost", measure(cluster, phase_s)))
        cluster.add_node(num_cpus=1, resources={SLOT: 1})
        ray.get(group.ready(), timeout=60)
        rows.append((label, "a node back, bundle placed", measure(cluster, phase_s)))
        rows.append((label, f"{phase_s:g} s later", measure(cluster, phase_s)))
        remove_placement_group(group)
    finally:
        ray.shutdown()
        cluster.shutdown()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--phase-s", type=float, default=15.0, help="seconds each phase is measured")
    args = parser.parse_args()
    rows = run("Ray metrics on (default)", {}, args.phase_s)
    rows += run("Ray metrics off", services.RAY_METRICS_OFF, args.phase_s)
    rows += run("Ray metrics on, STRICT_SPREAD group", {}, args.phase_s, strategy="STRICT_SPREAD")
    print(f"\n| cluster | phase | GCS CPU (cores) | head dashboard agent CPU (cores) | GCS placement tries/s |")
    print("|---|---|---|---|---|")
    for label, phase, m in rows:
        print(f"| {label} | {phase} | {m['gcs']:.2f} | {m['agent']:.2f} | {m['tries_per_s']:,.0f} |")


if __name__ == "__main__":
    main()
