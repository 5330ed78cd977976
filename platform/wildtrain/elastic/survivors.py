"""The controller's side of in-process recovery (issue 24): a worker group that keeps its
survivors when a worker dies, instead of Ray Train restarting every worker, and a worker
started on the dead one's placement slot that joins them once Ray places that slot again
(`elastic.joiners`). The workers' side is `train.in_process`, `elastic.rendezvous`,
`elastic.peer_state`, `elastic.connections` and `elastic.relay`."""

from __future__ import annotations

import importlib
import threading
import time
from datetime import timedelta
from typing import Callable, Iterable, Optional

import ray

from wildtrain import ray_compat
from wildtrain.config import Config
from wildtrain.elastic import rendezvous
from wildtrain.elastic.joiners import JoinerMain, Joiners
from wildtrain.elastic.nodes import excluded_nodes, has_room_for_another_worker
from wildtrain.elastic.scaling import spare_cpus
from wildtrain.worker_inputs import LoopInputs
from wildtrain.worker_report import rank_zero


def import_rendezvous_ahead(cfg: Config) -> None:
    """Begin importing torch.distributed, which the driver's rendezvous opens its store with,
    in a thread: beside the driver's checks before it (they mostly wait on their servers),
    rather than after them on the way to the run's first step."""
    if cfg.elastic.in_process:
        threading.Thread(target=importlib.import_module, args=("torch.distributed",), daemon=True).start()


def start_rendezvous(cfg: Config) -> Optional[rendezvous.RendezvousServer]:
    """The driver's rendezvous for elastic.in_process (None where it is off), on its node's
    address: the workers reach the driver as they reach the Ray head."""
    if not cfg.elastic.in_process:
        return None
    return rendezvous.RendezvousServer(
        ray.util.get_node_ip_address(), cfg.elastic.dead_after_s, cfg.elastic.confirm_s, cfg.elastic.join_batch_s
    )


def survivor_callbacks(
    cfg: Config,
    server: Optional[rendezvous.RendezvousServer],
    inputs: LoopInputs,
    env_vars: dict[str, str],
    joiner_main: JoinerMain,
) -> list:
    """The controller callbacks that keep a group's survivors (none without a rendezvous),
    and start a joiner (`Joiners`, with the workers' `inputs` and `env_vars`) on each lost
    member's placement slot, and elastic.spares more on spare capacity. The survivors' verdict
    comes elastic.confirm_s after their collectives fail; past that and 5 s more, the group
    is restarted as without in-process recovery."""
    if server is None:
        return []

    def room_for_a_spare() -> bool:
        return has_room_for_another_worker(
            inputs.worker_resources, excluded_nodes(cfg.run.name), spare_cpus(cfg.data, cfg.eval)
        )

    return [
        KeepSurvivors(
            server.host,
            server.port,
            decide_s=cfg.elastic.confirm_s + 5.0,
            joiners=Joiners(inputs, env_vars, joiner_main),
            spares=cfg.elastic.spares,
            full_size=cfg.elastic.max_workers,
            room_for_a_spare=room_for_a_spare,
        )
    ]


class KeepSurvivors(ray_compat.WorkerGroupCallback, ray_compat.ReportCallback):
    """Keeps the worker group when a worker dies and the survivors went on without it
    in-process (issue 24), instead of letting Ray restart every worker.

    After each poll whose errors include a worker's death (`ray_compat.worker_lost`), it
    waits up to `decide_s` for the rendezvous owner (`elastic.rendezvous`, its store at
    `host:port`) to publish a generation of the current worker group without that worker;
    past that, the error stands and Ray restarts the group (the fallback). Once dropped, the
    report gates wait for the survivors only (`narrow_report_gates`): the lowest surviving
    rank is the generation's rank 0 (`rendezvous.ray_rank`), whose report the controller's
    callbacks read first. Ray collects reports from its own workers only: once none is left,
    the joiner that is rank 0 reports through the slot of the lowest lost rank (`_relay`).

    The death is masked for good (the group goes on smaller), and a `Joiner` waits for the
    worker's placement slot (`joiners`): once Ray has placed it again, the joiner asks to join
    and the survivors take it in at their next log step, in-process. It is no Ray Train worker
    and never reports (its generation's rank 0 reports every rank's metrics), so the gates
    stay narrowed. With `spares`, a group of `full_size` workers keeps that many joiners more
    started and ready, where `room_for_a_spare()` says the cluster has a worker's resources
    free beside what the data reads need: the owner puts one in the dead member's place in
    the re-form that drops it, and the joiner on the dead member's slot, once its node is
    back, waits as the next spare."""

    def __init__(
        self,
        host: str,
        port: int,
        decide_s: float,
        joiners: Joiners,
        spares: int = 0,
        full_size: int = 0,
        room_for_a_spare: Callable[[], bool] = lambda: False,
    ) -> None:
        self.host, self.port, self.decide_s = host, port, decide_s
        self.joiners = joiners
        self.spares, self.full_size, self.room_for_a_spare = spares, full_size, room_for_a_spare
        self.spare_failed: Optional[str] = None  # a spare raised: no more are started (one line said)
        self._token_before: Optional[str] = None  # the newest group's at this group's start
        self.worker_group = None
        self.masked: set[int] = set()
        # Ranks whose joiner raised, with its error: their deaths stand, shown as that error.
        self.join_failed: dict[int, Exception] = {}
        self._store = None  # `_client`
        self._relay_state()

    def _relay_state(self) -> None:
        """A group's start: no joiner reports for it (`_relay`)."""
        self.reported_step = -1  # of the last report Ray consolidated
        self.reporter: Optional[str] = None  # the joiner that is rank 0 where no Ray Train worker is left
        self.relay_rank: Optional[int] = None  # the lost worker's rank its reports go under
        self.relayed: list[dict] = []  # taken from it, not yet handed to Ray
        self.finished: set[str] = set()  # joiners whose run ended with the run
        self.reporter_missing_since: Optional[float] = None  # neither running nor finished since

    def store(self):
        """The current worker group's keys in the owner's store (a Ray restart registers a
        new group: `rendezvous.register_group`)."""
        return rendezvous.current_group(self._client()) or self._client()

    def _client(self):
        """A client of the owner's store, made in the controller once needed."""
        if self._store is None:
            import torch.distributed as dist

            self._store = dist.TCPStore(self.host, self.port, is_master=False, timeout=timedelta(seconds=10))
        return self._store

    def after_worker_group_start(self, worker_group) -> None:
        # A new group: every rank is in it, and its reports gate again on every rank (Ray's own).
        self.worker_group = worker_group
        self.masked, self.join_failed = set(), {}
        self._relay_state()
        if self.spares:
            self._token_before = rendezvous.current_token(self._client())

    def before_worker_group_shutdown(self, worker_group) -> None:
        self.joiners.stop()  # Ray removes the group's placement group, and with it theirs

    def after_report(self, training_report, metrics) -> None:
        self.reported_step = rank_zero(metrics).step

    def after_worker_group_poll_status(self, worker_group_status) -> None:
        everyone = list(range(len(worker_group_status.worker_statuses)))
        self._take_relayed(everyone)  # before the joiners that ended are reaped: their last reports too
        self._look_after_joiners()
        self._keep_spares()
        lost = {r for r, e in worker_group_status.errors.items() if ray_compat.worker_lost(e)}
        if lost - self.masked:
            self.say_members_died(rendezvous.member_name(r) for r in lost - self.masked)
        if lost - self.masked and not lost & self.join_failed.keys():
            self._decide(lost, everyone)
        ray_compat.mask_worker_deaths(worker_group_status, self.masked - {self.relay_rank})
        self._relay(worker_group_status, everyone)
        ray_compat.show_worker_errors(worker_group_status, self.join_failed)

    def say_members_died(self, names: Iterable[str]) -> None:
        """Ray says the workers `names` died: where the newest generation still counts one of
        them, tell the owner that a member left (`rendezvous.report_error`), so that it drops
        the silent ones after elastic.confirm_s rather than elastic.dead_after_s. Where no
        collective fails to say so (a death while a generation's groups form), only the
        heartbeats' silence would: 10 s by default."""
        store = self.store()
        newest = rendezvous.latest(store)
        if set(names) & set(newest.members):
            rendezvous.report_error(store, newest.generation)

    def _decide(self, lost: set[int], everyone: list[int]) -> None:
        store = self.store()
        deadline = time.monotonic() + self.decide_s
        while True:
            members = rendezvous.latest(store).members
            dropped = {r for r in lost if members and rendezvous.member_name(r) not in members}
            if dropped == lost or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        newly = dropped - self.masked  # Ray's poll still shows the ranks lost before as failed
        if newly:
            self.masked |= dropped
            survivors = [r for r in everyone if r not in self.masked]
            if survivors:  # else a joiner's reports count (`_relay`)
                ray_compat.narrow_report_gates(self.worker_group, survivors)
            print(
                f"ranks {sorted(self.masked)} left the worker group, which goes on without them: "
                f"reports of ranks {survivors or 'none: a joiner reports'} count",
                flush=True,
            )
            for rank in sorted(newly):  # a slot's earlier joiner may be a member already
                self._start_joiner(rank)

    def _take_relayed(self, everyone: list[int]) -> None:
        """Where no Ray Train worker is left, take the reports of the joiner that is rank 0 in
        the newest generation (members keep Ray's workers first) that Ray has not consolidated."""
        members = rendezvous.latest(self.store()).members if self.masked >= set(everyone) else ()
        self.reporter = members[0] if members and not rendezvous.is_ray_worker(members[0]) else None
        if self.reporter is not None:
            taken = self.joiners.take_reports(self.reporter)
            self.relayed += [report for report in taken if report["step"] > self.reported_step]

    def _relay(self, status, everyone: list[int]) -> None:
        """Once no Ray Train worker is left, show Ray the lowest lost rank's worker running and
        hand its report gate the reporter's reports, one a poll, until the reporter's run ended
        with the run. A reporter lost with no member to take its place within `decide_s` ends
        the relay: the group restarts from the checkpoint."""
        if self.reporter is None:
            self._take_relayed(everyone)  # the last Ray Train worker was dropped in this poll
        if (self.reporter is None and self.relay_rank is None) or self.relay_rank in self.join_failed:
            return
        if self.relay_rank is None:
            self.relay_rank = min(self.masked)
            ray_compat.narrow_report_gates(self.worker_group, [self.relay_rank])
            print(
                f"no Ray Train worker is left in the group: its rank 0, the joiner {self.reporter}, reports "
                f"through rank {self.relay_rank}'s slot",
                flush=True,
            )
        reporting = self.reporter is not None and self.joiners.runs(self.reporter)
        if self.relayed or reporting:
            self.reporter_missing_since = None
            ray_compat.relay_report(
                self.worker_group, status, self.relay_rank, self.relayed.pop(0) if self.relayed else None
            )
            return
        if self.reporter in self.finished:
            ray_compat.mask_worker_deaths(status, {self.relay_rank})  # the run's end: finished
            return
        self.reporter_missing_since = self.reporter_missing_since or time.monotonic()
        if time.monotonic() - self.reporter_missing_since < self.decide_s:
            ray_compat.relay_report(self.worker_group, status, self.relay_rank, None)
            return
        failed = RuntimeError(
            f"the joiner that reported for the group ({self.reporter}) was lost, and no member "
            "took its place: the group restarts from the checkpoint"
        )
        print(failed, flush=True)
        self.masked.discard(self.relay_rank)
        self.join_failed[self.relay_rank] = failed  # shown in place of its Ray worker's death

    def _start_joiner(self, rank: int) -> None:
        self.joiners.start(
            self.worker_group, rank, rendezvous.current_token(self._client()), len(self.worker_group.get_workers())
        )

    def _keep_spares(self) -> None:
        """Start a spare where fewer than `spares` joiners run outside the group's members (one
        per poll), once this group has registered at the rendezvous at its full size. A lost
        member's slot's joiner counts: once its node is back it waits as a spare, and a spare
        started meanwhile would take that node's room first. A spare lost with its node is
        said dead (it may have been a member) and started again; one that raised ends the
        spares."""
        if not self.spares:
            return
        for name, error in self.joiners.spares_ended():
            if error is None:
                self.finished.add(name)
                continue
            if ray_compat.worker_lost(error):
                print(f"the spare {name} died with its node; another is started where there is room", flush=True)
                self.say_members_died([name])
            elif self.spare_failed is None:
                self.spare_failed = (str(error).strip().splitlines() or [""])[-1][:300]
                print(
                    f"the spare {name} failed, so no spare is started again in this run: {self.spare_failed}",
                    flush=True,
                )
        if self.spare_failed is not None or len(self.worker_group.get_workers()) < self.full_size:
            return
        token = rendezvous.current_token(self._client())
        if token is None or token == self._token_before:
            return  # the group has not registered yet
        if self.joiners.outside(rendezvous.latest(self.store()).members) >= self.spares:
            return
        if not self.room_for_a_spare():
            return
        name = self.joiners.start_spare(token, len(self.worker_group.get_workers()))
        print(f"started the spare {name}: it joins in the place of the next member lost", flush=True)

    def _look_after_joiners(self) -> None:
        """A joiner that died (its node, most likely) is started again on its slot; one whose
        training raised ends the group's masking of that rank, so Ray restarts the group at
        full size from the checkpoint (the fallback) rather than starting the same failure again."""
        for rank, (name, error) in self.joiners.ended().items():
            if error is None:
                self.finished.add(name)
            if error is None or rank not in self.masked:
                continue
            if ray_compat.worker_lost(error):
                print(f"the worker that joined on rank {rank}'s slot died; another waits for that slot", flush=True)
                self.say_members_died([name])
                self._start_joiner(rank)
            else:
                failed = RuntimeError(
                    f"the worker that joined on rank {rank}'s slot failed, so the group "
                    f"restarts instead: {(str(error).strip().splitlines() or [''])[-1][:300]}"
                )
                print(failed, flush=True)
                self.masked.discard(rank)
                self.join_failed[rank] = failed
