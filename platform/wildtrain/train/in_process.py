"""A worker's side of in-process recovery (elastic.in_process, issue 24): its membership in
the generations of its worker group, and the process groups it forms for each.

The driver runs the rendezvous (`rendezvous.RendezvousServer`); each worker Ray starts
joins it (`Member`), beats its heart there, and trains in the process groups of the newest
generation that includes it. When a member dies, a survivor's collective fails within
milliseconds (the dead process's connections close): it says so in the store, hangs up
its own connections (freeing the peers that wait on it rather than on the dead one,
`connections`), and waits for the owner's verdict. A member silent since the failure is
dead, and the owner publishes a generation without it: the survivors form new groups at
the smaller size (`form`) and continue from their peers' host copies of the state
(`peer_state`). Where no one is silent the error was this rank's or a peer's own, and it
stands (`lost_member` says which). A member lost while a generation's groups form fails
no collective: the others give that generation up once the owner publishes one without it
(`Member.form`), which the controller hastens with Ray's word of the death (`survivors`).

A survivor need not see the death itself: NCCL's kernels wait on a dead or hung peer for
the collective timeout (over NVLink nothing fails at all), and a gloo wait on a hung one
too. So from the moment its groups form until the next generation's, a member watches for
a generation that drops one of its members and then frees its own waits: its connections
hung up (gloo), its groups aborted (NCCL's kernels end). The owner publishes that
generation once the dead member has been silent for `elastic.confirm_s` after a failure,
or for `elastic.dead_after_s` with none. A GPU worker must survive its own groups'
failure, where Ray Train's default (`TORCH_NCCL_ASYNC_ERROR_HANDLING=1`) ends its process
at an NCCL error or timeout, and torch's debugging dump after one would too:
`survivor_env.SURVIVOR_ENV`.

A generation's groups live on a prefix of their own in the store, so no key of a broken
group is read again; its default group is made by this module, not by Ray Train, and
DeepSpeed's groups are released with it.

It is the trainer's, beside the collectives whose control group it opens and aborts; the
protocol it takes part in (the rendezvous, the membership's decisions, the mirrors, the
connections) is `elastic`'s, below it.
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterator

import torch.distributed as dist

from wildtrain.checkpoint.format import new_attempt_token
from wildtrain.config.system import ElasticConfig
from wildtrain.elastic import rendezvous_keys
from wildtrain.elastic.connections import GroupConnections
from wildtrain.elastic.membership import Membership, must_abandon
from wildtrain.elastic.peer_state import Mirrors
from wildtrain.elastic.rendezvous import (
    Heartbeat,
    RendezvousFailed,
    announce_node,
    announce_start,
    ask_to_join,
    latest,
    member_name,
    owner_failure,
    register_group,
    report_error,
)
from wildtrain.engine import clone_world_group, destroy_process_groups, import_deepspeed
from wildtrain.train import collectives
from wildtrain.train.failures import FailureKind, Superseded, classify

_POLL_S = 0.005
_WATCH_S = 0.05  # a formation's look for a newer generation: it takes milliseconds where none comes
_OWNER_LOOK_S = 0.1  # a wait's look whether the rendezvous's owner failed: a round trip, not one each poll
# A loss watch's wait for the next generation: woken by it, and c10d warns each time a wait
# runs out, so it runs out rarely.
_LOSS_WATCH_SLICE = timedelta(days=7)


class LeftOut(RuntimeError):
    """The others went on without this member, which was alive: it stalled for longer than
    elastic.dead_after_s. Its error ends the worker group, and Ray restarts it."""


@dataclass(frozen=True)
class Generation:
    number: int
    members: tuple[str, ...]  # by rank
    rank: int
    seen_at: float  # this member saw it published
    formed_at: float  # its process groups formed

    @property
    def world_size(self) -> int:
        return len(self.members)


class Member:
    """This worker's membership in a worker group's generations. A worker Ray started is one
    from the start (`of_ray_worker`); a worker the controller started on a lost member's
    placement slot asks to join the group's running generation (`joining`). `form` makes
    each generation's process groups, replacing Ray's."""

    def __init__(
        self,
        address: tuple[str, int],
        token: str,
        name: str,
        group_size: int,
        node_id: str,
        cfg: ElasticConfig,
        backend: str,
        control_timeout_s: float,
        registers: bool = False,
        joined: bool = False,
    ) -> None:
        self.address, self.token = address, token
        host, port = address
        self._base = base = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=60))
        if registers:
            register_group(base, token, group_size)
        self.store = dist.PrefixStore(token, base)
        self.cfg, self.backend, self.control_timeout_s = cfg, backend, control_timeout_s
        self.name = name
        self.joined = joined  # started by the controller, not by Ray Train (`joining`)
        # The members Ray placed the group for: a generation with fewer waits for joiners.
        self.group_size = group_size
        announce_node(self.store, self.name, node_id)
        self.heartbeat = Heartbeat(host, port, self.name, cfg.heartbeat_s, prefix=token)
        if joined:
            announce_start(self.store, self.name)  # it asks once ready (`ask`)
        else:
            self.ask()
        self.membership = Membership(0, ())
        self.connections = GroupConnections()
        # This rank's partitions and its ring predecessor's, kept across generations: of the step
        # being mirrored, of the step just done and of the committed one, since a death during
        # an exchange may leave only the committed step whole (`generations.PeerCommits`).
        self.mirrors = Mirrors(keep_steps=3)
        # The current generation's loss watch (`_watch_for_loss`), and what it shares with
        # the training thread: whether it freed the groups' waits, and the lock under which
        # either frees or releases them.
        self._watching = threading.Event()
        self._freed = False
        self._groups_lock = threading.Lock()
        self._owner_looked_at = 0.0  # `_owner_alive`

    @classmethod
    def of_ray_worker(
        cls,
        address: tuple[str, int],
        ray_rank: int,
        ray_world_size: int,
        node_id: str,
        cfg: ElasticConfig,
        backend: str,
        control_timeout_s: float,
    ) -> "Member":
        """Made by every worker of a group Ray started, right after Ray formed its process
        groups (the group's token goes over them); its rank 0 registers the group."""
        token = rendezvous_keys.group_token(collectives.broadcast_object(new_attempt_token()))
        return cls(
            address,
            token,
            member_name(ray_rank),
            ray_world_size,
            node_id,
            cfg,
            backend,
            control_timeout_s,
            registers=ray_rank == 0,
        )

    @classmethod
    def joining(
        cls,
        address: tuple[str, int],
        token: str,
        name: str,
        group_size: int,
        node_id: str,
        cfg: ElasticConfig,
        backend: str,
        control_timeout_s: float,
    ) -> "Member":
        """A worker started on a lost member's slot of the group registered under `token`,
        made as soon as its process runs: it says it is getting ready, so that a joiner that
        asks meanwhile waits to join with it. It asks itself (`ask`) once ready, and the members
        take it in at their next log step (`joiners_waiting`)."""
        return cls(address, token, name, group_size, node_id, cfg, backend, control_timeout_s, joined=True)

    def ask(self) -> None:
        ask_to_join(self.store, self.name)

    def joiners_waiting(self) -> bool:
        """Whether the owner published a generation that adds members to this one (and drops
        none: a drop fails this generation's collectives by itself)."""
        newest = latest(self.store)
        return newest.generation > self.membership.generation and not must_abandon(self.membership, newest)

    def spares_waiting(self) -> int:
        """How many joiners wait ready to take a lost member's place (elastic.spares)."""
        return int(self.store.get(rendezvous_keys.SPARES)) if self.store.check([rendezvous_keys.SPARES]) else 0

    def form(self) -> Generation:
        """Wait for the next generation that includes this member and form its process groups:
        the default group (with DeepSpeed's clone of it), the control group and the mirrors'. Raises
        `Superseded` where a member of it is gone before everyone arrived, or while the groups
        form (`_given_up_if_superseded`)."""
        m = self._next_generation()
        seen_at = time.time()
        self._arrive(m)
        self._release_groups(m)
        rank, world = m.rank(self.name), len(m.members)
        # What a launcher sets and DeepSpeed reads; LOCAL_RANK (the device) stays Ray's.
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
        timeout = timedelta(seconds=self.cfg.collective_timeout_s)
        self.connections = GroupConnections()
        with self.connections, self._given_up_if_superseded(m):  # every group of this generation, DeepSpeed's too
            # A store connection of the groups' own: hung up with theirs (`_given_up_if_superseded`).
            store = dist.TCPStore(*self.address, is_master=False, timeout=timedelta(seconds=60))
            dist.init_process_group(
                self.backend,
                store=dist.PrefixStore(rendezvous_keys.generation_groups(self.token, m.generation), store),
                rank=rank,
                world_size=world,
                timeout=timeout,
            )
            clone_world_group(import_deepspeed(), timeout)
            collectives.open_control_group(self.control_timeout_s)
            # The mirrors' exchange goes on beside the next step (`generations.PeerCommits`): on
            # connections of its own, so that no collective of the step queues behind its bytes.
            self.mirrors.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.control_timeout_s))
        self.membership = m
        self._watch_for_loss(m)
        return Generation(m.generation, m.members, rank, seen_at, time.time())

    def _watch_for_loss(self, m: Membership) -> None:
        """Until the next `form` (or `leave`): once the owner publishes a generation that drops
        a member of `m`, free every wait of this rank in `m`'s groups (the module docstring
        says why); the training thread's collective then fails, and `lost_member` finds the
        member lost. On a connection of its own: a wait holds its connection."""
        watching, connections = threading.Event(), self.connections
        watching.set()
        self._watching, self._freed = watching, False
        store = dist.PrefixStore(self.token, self._base.clone())

        def watch() -> None:
            n = m.generation + 1
            with contextlib.suppress(dist.DistError):  # the driver's store is gone: the run ends
                while watching.is_set():
                    try:
                        store.wait([rendezvous_keys.members(n)], _LOSS_WATCH_SLICE)
                    except dist.DistStoreError:
                        continue
                    newer = Membership(n, tuple(store.get(rendezvous_keys.members(n)).decode().split(",")))
                    if must_abandon(m, newer):
                        with self._groups_lock:
                            if watching.is_set():
                                self._free_waits(connections)
                        return
                    n += 1

        threading.Thread(target=watch, name=f"wildtrain-loss-watch-{m.generation}", daemon=True).start()

    def _free_waits(self, connections: GroupConnections) -> None:
        """End every wait of this rank in its groups (under `_groups_lock`): gloo's end when
        their connections close, NCCL's when their communicators abort."""
        connections.hang_up()
        collectives.abort_groups()
        self._freed = True

    @contextlib.contextmanager
    def _given_up_if_superseded(self, m: Membership) -> Iterator[None]:
        """While `m`'s groups form, give them up for the next generation if one comes that drops
        a member of `m`: a member that died after it arrived would hold every other in the
        groups' connection waits until the collective timeout (elastic.collective_timeout_s, then a restart
        from the checkpoint). Its connections hung up, the formation fails at once: `Superseded`."""
        formed, superseded = threading.Event(), threading.Event()

        def watch() -> None:
            with contextlib.suppress(dist.DistError):  # the driver's store is gone: the run ends
                while not formed.wait(_WATCH_S):
                    if must_abandon(m, latest(self.store)):
                        superseded.set()
                        self.connections.hang_up()
                        return

        watcher = threading.Thread(target=watch, name=f"wildtrain-form-{m.generation}", daemon=True)
        watcher.start()
        try:
            yield
        except Exception as e:
            if superseded.is_set():
                raise Superseded(f"generation {m.generation} lost a member while its groups formed: {e}") from e
            raise
        finally:
            formed.set()
            watcher.join()

    def lost_member(self, error: BaseException, peer_failure) -> bool:
        """After `error` in this generation's collectives: whether a member is gone (True:
        form the next generation) rather than this rank or a peer failing on its own (the
        error stands). `peer_failure()` says a peer's own failure (`collectives.PeerWatch`).
        Only a collective's failure that no rank explains (`failures.classify`) asks the
        owner's verdict. Raises `RendezvousFailed` where the owner failed: no generation will come."""
        kind = classify(error, peer_failure())
        if kind is not FailureKind.COLLECTIVE:
            return kind is FailureKind.SUPERSEDED
        generation = self.membership.generation
        # The first rank to fail in a generation is where it began; one after it failed
        # because of it, and waits longer for its reason where nobody died.
        first = self.store.add(rendezvous_keys.failures(generation), 1) == 1
        report_error(self.store, generation)
        self.connections.hang_up()  # frees the peers that wait on this rank
        self.mirrors.drop_in_flight()
        # A dead member is silent from the failure on; the owner publishes once it has been
        # for elastic.confirm_s. Where none is, nobody died.
        deadline = time.monotonic() + self.cfg.confirm_s + 10 * self.cfg.heartbeat_s + (1.0 if first else 3.0)
        while time.monotonic() < deadline:
            newest = latest(self.store)
            if newest.generation > self.membership.generation and must_abandon(self.membership, newest):
                return True
            if peer_failure() is not None:
                return False
            self._owner_alive()
            time.sleep(_POLL_S)
        return False

    def leave(self) -> None:
        """The run is at its end: the workers stop beating as they exit, which is no death."""
        with self._groups_lock:
            self._watching.clear()
        self.store.set(rendezvous_keys.ENDING, "1")
        self.heartbeat.stop()

    def _next_generation(self) -> Membership:
        """The next generation that includes this member. A joiner that is no member yet waits
        for its turn however long it takes (a spare, until a member is lost); every other wait
        is for the owner's verdict, and raises `RendezvousFailed` where none came within the
        control group's bound (`control_timeout_s`), or at once where the owner failed."""
        waits_its_turn = self.joined and not self.membership.generation
        deadline = time.monotonic() + self.control_timeout_s
        while True:
            newest = latest(self.store)
            if newest.generation > self.membership.generation:
                if self.name in newest.members:
                    return newest
                if self.membership.generation:
                    # Found dead while alive (a stall longer than elastic.dead_after_s): the
                    # others went on; Ray restarts this worker's group at its next poll.
                    raise LeftOut(
                        f"{self.name} was left out of generation {newest.generation} "
                        f"(silent for over {self.cfg.dead_after_s:g} s)"
                    )
            self._owner_alive()
            if not waits_its_turn and time.monotonic() > deadline:
                raise RendezvousFailed(
                    f"{self.name} saw no generation after {self.membership.generation} within "
                    f"{self.control_timeout_s:g} s: falling back to a restart"
                )
            time.sleep(_POLL_S)

    def _owner_alive(self) -> None:
        """Raise `RendezvousFailed` where the rendezvous's owner failed (looked for every
        `_OWNER_LOOK_S` at most): no generation will come."""
        now = time.monotonic()
        if now - self._owner_looked_at < _OWNER_LOOK_S:
            return
        self._owner_looked_at = now
        reason = owner_failure(self.store)
        if reason is not None:
            raise RendezvousFailed(f"the in-process rendezvous's owner failed ({reason}): falling back to a restart")

    def _arrive(self, m: Membership) -> None:
        """Wait until every member of `m` is at its rendezvous: a member that died after `m`
        was published would hold the group's construction until its timeout, where this wait
        sees the next generation at once."""
        self.store.set(rendezvous_keys.arrived(m.generation, self.name), "1")
        while not self.store.check([rendezvous_keys.arrived(m.generation, name) for name in m.members]):
            if latest(self.store).generation > m.generation:
                self.membership = m
                raise Superseded(f"generation {m.generation} was superseded before every member arrived")
            self._owner_alive()
            time.sleep(_POLL_S)

    def _release_groups(self, m: Membership) -> None:
        """Destroy the last generation's groups (Ray Train's, the first time) on the way to
        `m`. Where `m` dropped a member, their waits are freed first, if the loss watch has
        not: an NCCL kernel may still wait for the lost member, and a destroy would wait
        with it. DeepSpeed holds its own groups and releases them on its destroy; the engine
        and its optimizer refer to each other, so only a collection frees the old group and
        closes its connections."""
        with self._groups_lock:
            self._watching.clear()
            if dist.is_initialized() and not self._freed and must_abandon(self.membership, m):
                self._free_waits(self.connections)
        self.mirrors.group = None  # the last generation's: nothing may keep it, and its connections, alive
        if dist.is_initialized():
            destroy_process_groups(import_deepspeed())
            gc.collect()
        if self.membership.generation == 0:
            # What is alive before the first generation (the imports, Ray's worker, the run's
            # inputs) lives as long as the process: frozen out of the collector's sight, the
            # collection at each later re-form takes milliseconds instead of most of a second (docs/benchmarks.md).
            gc.freeze()
