"""The controller's side of in-process recovery (issue 24): a worker group that keeps its
survivors when a worker dies, instead of Ray Train restarting every worker, and a worker
started on the dead one's placement slot that joins them once Ray places that slot again.
The workers' side is `elastic.in_process`, `elastic.rendezvous`, `elastic.peer_state` and
`elastic.connections`."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import TYPE_CHECKING, Callable, Iterable, NamedTuple, Optional

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from wildtrain import ray_compat
from wildtrain.config import Config
from wildtrain.elastic import rendezvous
from wildtrain.elastic.nodes import excluded_nodes, has_room_for_another_worker
from wildtrain.elastic.scaling import spare_cpus

if TYPE_CHECKING:
    from wildtrain.train.loop import LoopInputs


def start_rendezvous(cfg: Config) -> Optional[rendezvous.RendezvousServer]:
    """The driver's rendezvous for elastic.in_process (None where it is off), on its node's
    address: the workers reach the driver as they reach the Ray head."""
    if not cfg.elastic.in_process:
        return None
    return rendezvous.RendezvousServer(ray.util.get_node_ip_address(), cfg.elastic.dead_after_s, cfg.elastic.confirm_s,
                                       cfg.elastic.join_batch_s)


def survivor_callbacks(cfg: Config, server: Optional[rendezvous.RendezvousServer], inputs: LoopInputs,
                       env_vars: dict[str, str]) -> list:
    """The controller callbacks that keep a group's survivors (none without a rendezvous),
    and start a joiner (`Joiners`, with the workers' `inputs` and `env_vars`) on each lost
    member's placement slot, and elastic.spares more on spare capacity. The survivors' verdict
    comes elastic.confirm_s after their collectives fail; past that and 5 s more, the group
    is restarted as without in-process recovery."""
    if server is None:
        return []

    def room_for_a_spare() -> bool:
        return has_room_for_another_worker(inputs.worker_resources, excluded_nodes(cfg.run.name), spare_cpus(cfg))

    return [KeepSurvivors(server.host, server.port, decide_s=cfg.elastic.confirm_s + 5.0, replace=False,
                          joiners=Joiners(inputs, env_vars), spares=cfg.elastic.spares,
                          full_size=cfg.elastic.max_workers, room_for_a_spare=room_for_a_spare)]


@ray.remote(max_restarts=0)
class Joiner:
    """A worker of the group that Ray Train did not start: it trains as a member of the
    group's in-process generations on a lost member's placement slot (`join_in_process`)."""

    def run(self, inputs: LoopInputs, token: str, name: str, group_size: int) -> None:
        from wildtrain.train.loop import join_in_process  # the worker's side, imported where it runs

        join_in_process(inputs, token, name, group_size)


class _Running(NamedTuple):
    actor: object
    run: ray.ObjectRef
    name: str  # its member name


class Ended(NamedTuple):
    name: str  # the joiner's member name
    error: Optional[BaseException]  # None where its run returned (the run's end)


class Joiners:
    """The joiners the controller started: one per lost member's placement slot, and the spares.
    A slot's joiner asks for one worker's resources on that slot, so Ray starts it once it has
    placed that bundle again (a node came back or was added): until then it waits, and costs
    nothing. A spare asks for them anywhere (`start_spare`)."""

    def __init__(self, inputs: LoopInputs, env_vars: dict[str, str]) -> None:
        self.inputs, self.env_vars = inputs, env_vars
        self.started = 0
        self.running: dict[int, _Running] = {}  # by the Ray rank of the lost member
        self.spares: dict[str, _Running] = {}  # by member name

    def start(self, worker_group, rank: int, token: str, group_size: int) -> None:
        group, bundle = ray_compat.worker_slot(worker_group, rank)
        strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=bundle)
        self.running[rank] = self._start(f"{rendezvous.member_name(rank)}.{self.started + 1}", token, group_size,
                                         strategy)

    def start_spare(self, token: str, group_size: int) -> str:
        """Start a spare: a joiner on no slot of the group's, placed by Ray where a worker's
        resources are free. Once ready it waits at the rendezvous for a member's place."""
        name = f"spare.{self.started + 1}"
        self.spares[name] = self._start(name, token, group_size, "DEFAULT")
        return name

    def _start(self, name: str, token: str, group_size: int, strategy) -> _Running:
        resources = dict(self.inputs.worker_resources)
        self.started += 1
        actor = Joiner.options(
            num_cpus=resources.pop("CPU", 0), num_gpus=resources.pop("GPU", 0), resources=resources,
            scheduling_strategy=strategy, runtime_env={"env_vars": self.env_vars},
        ).remote()
        return _Running(actor, actor.run.remote(self.inputs, token, name, group_size), name)

    def ended(self) -> dict[int, Ended]:
        """The slots' joiners whose run ended since the last look, by the lost member's rank."""
        return _take_ended(self.running)

    def spares_ended(self) -> list[Ended]:
        """The spares whose run ended since the last look (joined or not)."""
        return list(_take_ended(self.spares).values())

    def outside(self, members: tuple[str, ...]) -> int:
        """How many joiners, slots' and spares, run (or wait to be placed) outside `members`."""
        return sum(1 for running in [*self.running.values(), *self.spares.values()] if running.name not in members)

    def stop(self) -> None:
        for running in [*self.running.values(), *self.spares.values()]:
            ray.kill(running.actor)
        self.running, self.spares = {}, {}


def _take_ended(running: dict) -> dict:
    """The entries of `running` whose run ended, taken out of it, with how it ended."""
    ended = {}
    for key, (actor, run, name) in list(running.items()):
        done, _ = ray.wait([run], timeout=0)
        if not done:
            continue
        del running[key]
        try:
            ray.get(run)
            ended[key] = Ended(name, None)
        except Exception as e:  # noqa: BLE001 - the controller decides what it means
            ended[key] = Ended(name, e)
        ray.kill(actor)
    return ended


def goes_on_without(lost: set[int], masked: set[int], everyone: list[int], replace: bool) -> bool:
    """Whether a group whose Ray Train workers of `masked` were already lost (joiners may have
    taken their places) can go on without those of `lost` too: only a Ray Train worker reports
    to Ray, so one must be left; and with `replace`, rank 0 must be (`KeepSurvivors`)."""
    return bool(set(everyone) - masked - lost) and not (replace and 0 in lost)


class KeepSurvivors(ray_compat.WorkerGroupCallback):
    """Keeps the worker group when a worker dies and the survivors went on without it
    in-process (issue 24), instead of letting Ray restart every worker.

    After each poll whose errors include a worker's death (`ray_compat.worker_lost`), it
    waits up to `decide_s` for the rendezvous owner (`elastic.rendezvous`, its store at
    `host:port`) to publish a generation of the current worker group without that worker;
    past that, the error stands and Ray restarts the group (the fallback). So does the death
    of the last Ray Train worker (a joiner never reports to Ray) and, with `replace`, rank
    0's (its workers report through Ray's barrier, which needs rank 0). Once dropped, the
    report gates wait for the survivors only (`narrow_report_gates`): the lowest surviving
    rank is the generation's rank 0 (`rendezvous.ray_rank`), whose report the controller's
    callbacks read first. And then either

    - the death is masked for good (`replace` off: the group goes on smaller), and a `Joiner`
      waits for the worker's placement slot (`joiners`): once Ray has placed it again, the
      joiner asks to join and the survivors take it in at their next log step, in-process. It
      is no Ray Train worker and never reports (its generation's rank 0 reports every rank's
      metrics), so the gates stay narrowed. With `spares`, a group of `full_size` workers keeps
      that many joiners more started and ready, where `room_for_a_spare()` says the cluster
      has a worker's resources free beside what the data reads need: the owner puts one in
      the dead member's place in the re-form that drops it, and the joiner on the dead
      member's slot, once its node is back, waits as the next spare; or
    - it is handed on for Ray to replace that one worker on its placement slot (`replace`,
      with `ray_compat.ReplacingTorchConfig`; bench/recovery_spike_ray.py), once Ray knows the
      worker's node is dead (before, the slot still points at it and the replacement dies with
      it). The gates widen again when the owner's generation is whole."""

    def __init__(self, host: str, port: int, decide_s: float, replace: bool, joiners: Optional[Joiners] = None,
                 spares: int = 0, full_size: int = 0, room_for_a_spare: Callable[[], bool] = lambda: False) -> None:
        self.host, self.port, self.decide_s, self.replace = host, port, decide_s, replace
        self.joiners = joiners
        self.spares, self.full_size, self.room_for_a_spare = spares, full_size, room_for_a_spare
        self.spare_failed: Optional[str] = None  # a spare raised: no more are started (one line said)
        self._token_before: Optional[str] = None  # the newest group's at this group's start
        self.worker_group = None
        self.masked: set[int] = set()
        # Ranks whose joiner raised, with its error: their deaths stand, shown as that error.
        self.join_failed: dict[int, Exception] = {}
        self.narrowed = False  # the report gates wait for the survivors only
        self._store = None  # `_client`

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
        self.narrowed = False
        if self.spares:
            self._token_before = rendezvous.current_token(self._client())

    def before_worker_group_shutdown(self, worker_group) -> None:
        if self.joiners is not None:
            self.joiners.stop()  # Ray removes the group's placement group, and with it theirs

    def after_worker_group_poll_status(self, worker_group_status) -> None:
        everyone = list(range(len(worker_group_status.worker_statuses)))
        if self.joiners is not None:
            self._look_after_joiners()
            self._keep_spares()
        if self.replace and self.narrowed and len(rendezvous.latest(self.store()).members) == len(everyone):
            # The replacement joined the survivors' group: its reports count again.
            ray_compat.narrow_report_gates(self.worker_group, everyone)
            self.narrowed = False
            print("the worker group is whole again: every rank's reports count", flush=True)
        lost = {r for r, e in worker_group_status.errors.items() if ray_compat.worker_lost(e)}
        if lost - self.masked:
            self.say_members_died(rendezvous.member_name(r) for r in lost - self.masked)
        if (lost - self.masked and goes_on_without(lost, self.masked, everyone, self.replace)
                and not lost & self.join_failed.keys()):
            self._decide(lost, everyone)
        if not self.replace:
            ray_compat.mask_worker_deaths(worker_group_status, self.masked)
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
        if dropped - self.masked:
            self.masked |= dropped
            survivors = [r for r in everyone if r not in self.masked]
            ray_compat.narrow_report_gates(self.worker_group, survivors, barrier=self.replace)
            self.narrowed = True
            print(f"ranks {sorted(self.masked)} left the worker group, which goes on without them: "
                  f"reports of ranks {survivors} count", flush=True)
            if self.joiners is not None:
                for rank in sorted(dropped):
                    self._start_joiner(rank)
        if self.replace:
            nodes = {rendezvous.node_of(store, rendezvous.member_name(r)) for r in lost}
            while time.monotonic() < deadline + self.decide_s and any(
                    n["Alive"] for n in ray.nodes() if n["NodeID"] in nodes):
                time.sleep(0.1)
            self.masked -= lost  # their ranks come back with the replacements

    def _start_joiner(self, rank: int) -> None:
        self.joiners.start(self.worker_group, rank, rendezvous.current_token(self._client()),
                           len(self.worker_group.get_workers()))

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
                continue
            if ray_compat.worker_lost(error):
                print(f"the spare {name} died with its node; another is started where there is room", flush=True)
                self.say_members_died([name])
            elif self.spare_failed is None:
                self.spare_failed = (str(error).strip().splitlines() or [""])[-1][:300]
                print(f"the spare {name} failed, so no spare is started again in this run: {self.spare_failed}",
                      flush=True)
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
            if error is None or rank not in self.masked:
                continue
            if ray_compat.worker_lost(error):
                print(f"the worker that joined on rank {rank}'s slot died; another waits for that slot", flush=True)
                self.say_members_died([name])
                self._start_joiner(rank)
            else:
                failed = RuntimeError(f"the worker that joined on rank {rank}'s slot failed, so the group "
                                      f"restarts instead: {(str(error).strip().splitlines() or [''])[-1][:300]}")
                print(failed, flush=True)
                self.masked.discard(rank)
                self.join_failed[rank] = failed
