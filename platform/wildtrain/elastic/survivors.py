"""The controller's side of in-process recovery (issue 24): a worker group that keeps its
survivors when a worker dies, instead of Ray Train restarting every worker. The workers'
side is `elastic.rendezvous`, `elastic.peer_state` and `elastic.connections`."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Optional

import ray

from wildtrain import ray_compat
from wildtrain.config import Config
from wildtrain.elastic import rendezvous


def start_rendezvous(cfg: Config) -> Optional[rendezvous.RendezvousServer]:
    """The driver's rendezvous for elastic.in_process (None where it is off), on its node's
    address: the workers reach the driver as they reach the Ray head."""
    if not cfg.elastic.in_process:
        return None
    return rendezvous.RendezvousServer(ray.util.get_node_ip_address(), cfg.elastic.dead_after_s, cfg.elastic.confirm_s)


def survivor_callbacks(cfg: Config, server: Optional[rendezvous.RendezvousServer]) -> list:
    """The controller callbacks that keep a group's survivors (none without a rendezvous).
    The survivors' verdict comes elastic.confirm_s after their collectives fail; past that
    and 5 s more, the group is restarted as without in-process recovery."""
    if server is None:
        return []
    return [KeepSurvivors(server.host, server.port, decide_s=cfg.elastic.confirm_s + 5.0, replace=False)]


class KeepSurvivors(ray_compat.WorkerGroupCallback):
    """Keeps the worker group when a worker dies and the survivors went on without it
    in-process (issue 24), instead of letting Ray restart every worker.

    After each poll whose errors include a worker's death (`ray_compat.worker_lost`), it
    waits up to `decide_s` for the rendezvous owner (`elastic.rendezvous`, its store at
    `host:port`) to publish a generation of the current worker group without that worker;
    past that, the error stands and Ray restarts the group (the fallback). So does rank 0's
    death: Ray's report barrier hands every rank rank 0's payload. Once dropped, the report gates wait for the
    survivors only (`narrow_report_gates`), and then either the death is masked for good
    (`replace` off: the group goes on smaller) or it is handed on for Ray to replace that one
    worker on its placement slot (`replace`, with `ray_compat.ReplacingTorchConfig`), once Ray
    knows the worker's node is dead (before, the slot still points at it and the replacement
    dies with it). The gates widen again when the owner's generation is whole."""

    def __init__(self, host: str, port: int, decide_s: float, replace: bool) -> None:
        self.host, self.port, self.decide_s, self.replace = host, port, decide_s, replace
        self.worker_group = None
        self.masked: set[int] = set()
        self.narrowed = False  # the report gates wait for the survivors only
        self._store = None  # a client of the owner's store, made in the controller once needed

    def store(self):
        """The current worker group's keys in the owner's store (a Ray restart registers a
        new group: `rendezvous.register_group`)."""
        if self._store is None:
            import torch.distributed as dist

            self._store = dist.TCPStore(self.host, self.port, is_master=False, timeout=timedelta(seconds=10))
        return rendezvous.current_group(self._store) or self._store

    def after_worker_group_start(self, worker_group) -> None:
        # A new group: every rank is in it, and its reports gate again on every rank (Ray's own).
        self.worker_group = worker_group
        self.masked = set()
        self.narrowed = False

    def after_worker_group_poll_status(self, worker_group_status) -> None:
        everyone = list(range(len(worker_group_status.worker_statuses)))
        if self.narrowed and len(rendezvous.latest(self.store()).members) == len(everyone):
            # The replacement joined the survivors' group: its reports count again.
            ray_compat.narrow_report_gates(self.worker_group, everyone)
            self.narrowed = False
            print("the worker group is whole again: every rank's reports count", flush=True)
        lost = {r for r, e in worker_group_status.errors.items() if ray_compat.worker_lost(e)}
        if lost - self.masked and 0 not in lost:
            self._decide(lost, everyone)
        if not self.replace:
            ray_compat.mask_worker_deaths(worker_group_status, self.masked)

    def _decide(self, lost: set[int], everyone: list[int]) -> None:
        store = self.store()
        deadline = time.monotonic() + self.decide_s
        while True:
            members = rendezvous.latest(store).members
            dropped = {r for r in lost if members and rendezvous.member_name(r) not in members}
            if dropped == lost or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        if dropped - self.masked:
            self.masked |= dropped
            survivors = [r for r in everyone if r not in self.masked]
            ray_compat.narrow_report_gates(self.worker_group, survivors)
            self.narrowed = True
            print(f"ranks {sorted(self.masked)} left the worker group, which goes on without them: "
                  f"reports of ranks {survivors} count", flush=True)
        if self.replace:
            nodes = {rendezvous.node_of(store, rendezvous.member_name(r)) for r in lost}
            while time.monotonic() < deadline + self.decide_s and any(
                    n["Alive"] for n in ray.nodes() if n["NodeID"] in nodes):
                time.sleep(0.1)
            self.masked -= lost  # their ranks come back with the replacements
