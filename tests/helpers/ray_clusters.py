"""A Ray cluster for tests (`ray.cluster_utils.Cluster`) on 127.0.0.1, beside any other on
the machine (`wildtrain up`'s head, another test run's): every port it listens on is free."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Callable, Optional

from ray.cluster_utils import Cluster

from wildtrain import ray_compat, services

# Ray starts its workers at nice 15; `make test` runs the tests beside the drills at 19,
# which then took 30% of a core the drills' workers waited for (weights 15 against 36), and
# the drills ran 18% longer than alone. At 10 they take 88% of it, and Ray's own daemons
# (nice 0) still come first, as their health checks need. Ray's `worker_niceness` setting:
# a head's system config, or RAY_worker_niceness in a head's environment.
WORKER_NICENESS = 10
# The GCS marks a node dead after two health checks that fail or time out. A node a drill
# removes refuses the check at once: seen dead 1.75-1.86 s after `remove_node` here with a
# check's timeout of 1 s or 5 s alike. A node that answers late is alive: in a CI the head's
# raylet, starved while a drill's three nodes started beside the rest of the suite, missed two
# checks of 1 s and exited, and with it the session's cluster and the drills' pytest (exit 1,
# no summary: Ray ends a driver whose object store is gone).
HEALTH_CHECK_TIMEOUT_MS = 5000


def start_cluster(
    setenv: Callable[[str, str], None], num_cpus: int, resources: Optional[dict] = None, metrics: bool = False
) -> Cluster:
    """A head of `num_cpus` logical CPUs (and `resources`) with its dashboard and jobs API.
    Its processes inherit this process's environment as it is when called, after what is
    set here through `setenv` (os.environ's, or a test's monkeypatch).

    Ray's metrics are off unless `metrics`, as the README has a cluster that runs
    elastic.in_process: each node the drills remove leaves a placement bundle that Ray's GCS
    retries without pause, recording a sample per try that the head's dashboard agent then
    ingests one by one (services.RAY_METRICS_OFF): 18% of this 2-core machine's CPU through
    the drills' first 19 minutes, the elastic tests'. With `metrics`, workers'
    `ray.util.metrics` reach the head's Prometheus endpoint (`head_node.metrics_export_port`)
    within a second."""
    # The autoscaler's and the dashboard's own metrics ports are fixed numbers unless set in
    # the environment the cluster's processes inherit; `wildtrain up`'s head may hold them.
    # (Ray picks the agents' other ports, the raylet's and the workers' free by itself.)
    setenv("AUTOSCALER_METRIC_PORT", str(services.free_port()))
    setenv("DASHBOARD_METRIC_PORT", str(services.free_port()))
    # Ray's helpers that look for "the" cluster without an address (Ray Train's placement
    # group cleaner) take the newest Ray instance on the machine unless RAY_ADDRESS names
    # theirs; beside `wildtrain up`'s head they removed this cluster's placement groups.
    gcs_port = services.free_port()
    setenv("RAY_ADDRESS", f"{services.HOST}:{gcs_port}")
    temp_dir = tempfile.mkdtemp(prefix="wildtrain-test-ray-")
    # With metrics, the Prometheus endpoint that workers' `ray.util.metrics` reach (the
    # dashboard's source), refreshed every second rather than every 10.
    system_config = services.NODE_HEALTH_CHECKS | {
        "health_check_timeout_ms": HEALTH_CHECK_TIMEOUT_MS,
        "worker_niceness": WORKER_NICENESS,
    }
    metrics_args = (
        {
            "metrics_export_port": services.free_port(),
            "_system_config": system_config | {"metrics_report_interval_ms": 1000},
        }
        if metrics
        else {"_system_config": system_config | services.RAY_METRICS_OFF}
    )
    # `Cluster` also writes its address into Ray's default temporary folder, which only a head
    # started there creates: on a machine where Ray never ran, it fails without this.
    os.makedirs(ray_compat.default_temp_dir(), exist_ok=True)
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "temp_dir": temp_dir,
            "gcs_server_port": gcs_port,
            "num_cpus": num_cpus,
            "resources": resources or {},
            "include_dashboard": True,
            "dashboard_host": services.HOST,
            "dashboard_port": services.free_port(),
            # Ray's default agent port (52365) is taken while `wildtrain up`'s head runs.
            "dashboard_agent_listen_port": services.free_port(),
            **metrics_args,
        },
    )
    # Ray's job supervisor gives a job's driver the address recorded in its cluster's temporary
    # folder (`ray_current_cluster`), and without one any cluster it finds running on the
    # machine. `ray start` records it there; `Cluster` records it in /tmp/ray only, where
    # another test's cluster, gone since, or `wildtrain up`'s head may be: jobs went there to
    # hang. A folder of its own, recorded in, sends them to this cluster alone.
    (Path(temp_dir) / "ray_current_cluster").write_text(cluster.gcs_address)
    return cluster
