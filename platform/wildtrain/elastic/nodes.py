"""The cluster's nodes as the elastic machinery sees them: the ones left out of a run, how
many workers the others hold, and Ray Train's resource view, kept fresh."""

from __future__ import annotations

import json
import time
from typing import Callable

import ray

from wildtrain import ray_compat
from wildtrain.resources import workers_held


def excluded_nodes(run_name: str) -> set[str]:
    """The nodes left out of this run, in Ray's key-value store: the controller writes them,
    every worker group reads them when it looks for room to grow."""
    value = ray_compat.kv_get(_exclusion_key(run_name), _KV_NAMESPACE)
    return set(json.loads(value)) if value else set()


def exclude_nodes(run_name: str, nodes: set[str]) -> None:
    nodes = excluded_nodes(run_name) | nodes
    ray_compat.kv_put(_exclusion_key(run_name), json.dumps(sorted(nodes)), _KV_NAMESPACE)


_KV_NAMESPACE = "wildtrain"


def _exclusion_key(run_name: str) -> str:
    return f"excluded_nodes/{run_name}"


def workers_that_fit(nodes: dict[str, dict[str, float]], per_worker: dict[str, float], excluded: set[str]) -> int:
    """How many workers the nodes (id → resources) hold, leaving out the excluded ones."""
    return sum(workers_held(resources, per_worker) for node, resources in nodes.items() if node not in excluded)


def has_room_for_another_worker(per_worker: dict[str, float], excluded: set[str], keep_free_cpus: float) -> bool:
    """`room_for_another_worker` in the cluster as it is now (Ray has no public per-node view
    of what is free)."""
    return room_for_another_worker(ray_compat.available_resources_per_node(), per_worker, excluded, keep_free_cpus)


def room_for_another_worker(
    free: dict[str, dict[str, float]], per_worker: dict[str, float], excluded: set[str], keep_free_cpus: float
) -> bool:
    """Whether one node that is not excluded has a worker's resources free (node id →
    resources free) and the cluster keeps `keep_free_cpus` CPUs free beside it: the CPUs
    Ray Data's reads need, free for a moment between two read tasks. A group grown into
    them would wait on its data forever."""
    spare_cpus = sum(resources.get("CPU", 0.0) for resources in free.values()) - per_worker.get("CPU", 0.0)
    return workers_that_fit(free, per_worker, excluded) > 0 and spare_cpus >= keep_free_cpus


def alive_nodes() -> set[str]:
    """The ids of the nodes Ray counts alive."""
    return {node["NodeID"] for node in ray.nodes() if node["Alive"]}


def refresh_resource_view() -> None:
    """Make Ray Train's view of the cluster's nodes current.

    Ray 2.60 sizes worker groups from the AutoscalingCoordinator actor's copy of the node
    list, which it refreshes every 20 s. Without a refresh, a group restarted after a node
    died is sized for the dead node too and waits out a whole worker-group start timeout,
    and a planned regrow restarts at the old size, without the node that joined. Asking for a
    recomputed reservation refreshes that copy for every requester."""
    ray_compat.refresh_train_resource_view()


class ResourceView:
    """Refreshes the resource view (`refresh_resource_view`) without letting a failure end
    the run: a refresh only saves time, since the coordinator refreshes its copy by itself
    every 20 s. A GCS that times out under load would otherwise end the run from a controller
    hook. Each distinct error is logged once, not once per retry."""

    def __init__(self, refresh: Callable[[], None] = refresh_resource_view) -> None:
        self._refresh = refresh
        self._logged: set[str] = set()
        self.last = float("-inf")  # time.monotonic() of the last attempt

    def refresh(self) -> bool:
        self.last = time.monotonic()
        try:
            self._refresh()
            return True
        except Exception as e:
            error = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
            if error not in self._logged:
                self._logged.add(error)
                print(
                    f"refreshing Ray's resource view failed ({error}); Ray refreshes it every 20 s "
                    f"by itself and wildtrain keeps retrying",
                    flush=True,
                )
            return False
