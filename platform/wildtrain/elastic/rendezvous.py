"""The store an in-process elastic group meets at (issue 24): workers ask to join and beat
their hearts in a TCPStore, its owner (the driver runs it: `RendezvousServer`) reads them and
publishes each new generation, and workers read the newest. Who is in the next generation is
decided by `membership`; the keys, and who writes and reads each, by `rendezvous_keys`; this
module is the reads and writes of those keys and the owner's loop turn.

No worker writes a time: the owner times what it reads on its own clock (when a heartbeat's
count changed, when an error or a request appeared), so that no verdict compares two hosts' clocks.
"""

from __future__ import annotations

import contextlib
import threading
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Optional

from wildtrain.elastic import rendezvous_keys
from wildtrain.elastic.membership import Membership, NoMembersLeft, joiners_due, next_membership, stale

if TYPE_CHECKING:
    # Imported where a store is opened, not here: Ray Train's controller imports this module
    # (`elastic.survivors`) before it starts any worker, and opens its store once they started;
    # torch is half of the controller's imports (docs/benchmarks.md#start-up).
    import torch.distributed as dist

# The most keys one batched read asks for: TCPStore's multi_get slows faster than linearly in its keys past this.
READ_BATCH = 1024


class RendezvousFailed(RuntimeError):
    """No next generation will come for this member: the rendezvous's owner failed, or none
    came within the bound. In-process recovery is over for the group; the error reaches Ray
    unmasked, and Ray restarts the group from the checkpoint (the restart path)."""


def owner_failed(store: dist.Store, reason: str) -> None:
    """Say that the owner of the group whose keys are `store` failed, for `reason`."""
    store.set(rendezvous_keys.OWNER_FAILED, reason)


def owner_failure(store: dist.Store) -> Optional[str]:
    """Why the owner of the group whose keys are `store` failed; None while it has not."""
    return store.get(rendezvous_keys.OWNER_FAILED).decode() if store.check([rendezvous_keys.OWNER_FAILED]) else None


def latest(store: dist.Store) -> Membership:
    """The newest generation published in `store` (generation 0, no members: none yet)."""
    if not store.check([rendezvous_keys.GENERATION]):
        return Membership(0, ())
    generation = int(store.get(rendezvous_keys.GENERATION))
    return Membership(generation, tuple(store.get(rendezvous_keys.members(generation)).decode().split(",")))


def ask_to_join(store: dist.Store, name: str) -> None:
    """Ask to be a member of the next generation (a new worker, or one found dead while alive)."""
    _add_entry(store, rendezvous_keys.Entries.JOIN, name)


def announce_start(store: dist.Store, name: str) -> None:
    """Say that the joiner `name` is getting ready to ask: a joiner that asked before it is
    held for it (`RendezvousOwner`), so that both join in one re-form."""
    _add_entry(store, rendezvous_keys.Entries.START, name)


def _add_entry(store: dist.Store, entries: rendezvous_keys.Entries, name: str) -> None:
    n = store.add(entries.counter, 1)
    store.set(entries.entry(n), name)


def beat(store: dist.Store, name: str) -> None:
    store.add(rendezvous_keys.heartbeat(name), 1)


def member_name(rank: int) -> str:
    """The member that the Ray Train worker of `rank` is (`ray_rank` reads the rank back)."""
    return f"w{rank}"


def ray_rank(member: str) -> int:
    """The Ray Train rank of the worker that is `member` (`member_name`'s inverse)."""
    return int(member.removeprefix("w"))


def is_ray_worker(member: str) -> bool:
    """Whether `member` is a worker Ray Train started (`member_name`), not a joiner."""
    return member.startswith("w") and member[1:].isdigit()


def announce_node(store: dist.Store, name: str, node_id: str) -> None:
    """Say which Ray node the worker `name` runs on, for the drills and benches that take a
    member's node down (`node_of`)."""
    store.set(rendezvous_keys.node(name), node_id)


def node_of(store: dist.Store, name: str) -> str:
    return store.get(rendezvous_keys.node(name)).decode()


def report_error(store: dist.Store, generation: int) -> None:
    """A collective of `generation` failed on this worker."""
    store.set(rendezvous_keys.error(generation), "1")


class Heartbeat:
    """Beats for `name` every `every_s` from a thread, on a store client of its own (the
    worker's may be in a long wait), until `stop` or the store is gone (its owner ended).
    `prefix`: the worker group's keys (see `RendezvousServer`)."""

    def __init__(self, host: str, port: int, name: str, every_s: float, prefix: str = "") -> None:
        import torch.distributed as dist

        store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=60))
        self._store = dist.PrefixStore(prefix, store) if prefix else store
        self.name, self.every_s = name, every_s
        self._stopped = threading.Event()
        beat(self._store, name)  # in before the worker's join request is read
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import torch.distributed as dist

        while not self._stopped.wait(self.every_s):
            try:
                beat(self._store, self.name)
            except dist.DistNetworkError:
                return

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()


class RendezvousOwner:
    """Reads the join requests, heartbeats and failed collectives in `store` and publishes
    each new generation. The first waits for `initial` workers (Ray Train's; no joiner), and
    none has more than `capacity`: joiners beyond it wait, ready, as spares that take the
    place of the next member lost, in the re-form that drops it (elastic.spares). A member is
    dead when silent for `dead_after_s`, or, once a collective of its generation failed,
    silent since then for `confirm_s` (see `membership.stale`). Joiners that asked wait for one still getting ready
    (it announced its start, beats, and has not asked) for up to `join_batch_s`, unless the
    members re-form anyway (`membership.joiners_due`). Keeps when each worker's request was
    read (`asked`) and when each generation was published (`published`: generation -> (time,
    members)). Every time is the `now` of the turn that read it: the owner's clock.

    A turn's round trips to the store grow with the members a thousandth as fast as one read
    per member would: their heartbeats come in batched reads (`read_all`), and so do the
    entries added since the last turn."""

    def __init__(
        self,
        store: dist.Store,
        initial: int,
        dead_after_s: float,
        confirm_s: float,
        join_batch_s: float = 0.0,
        capacity: Optional[int] = None,
    ) -> None:
        self.store, self.initial, self.capacity = store, initial, capacity
        self.dead_after_s, self.confirm_s, self.join_batch_s = dead_after_s, confirm_s, join_batch_s
        self.current = Membership(0, ())
        self.asked: dict[str, float] = {}
        self.started: dict[str, float] = {}  # joiners that announced their start, when
        self.published: dict[int, tuple[float, tuple[str, ...]]] = {}
        self._pending: list[str] = []
        self._seen = dict.fromkeys(rendezvous_keys.Entries, 0)
        self._errors: dict[int, float] = {}
        self._spares = 0  # last published
        self._beating: set[str] = set()  # whose heartbeat key exists: a batched read waits for a missing key
        self._beats: dict[str, tuple[bytes, float]] = {}  # each one's count, and when it was first read

    def turn(self, now: float, ending: bool = False) -> Optional[Membership]:
        """One look at the store at time `now`: the generation published by it, if any.
        `ending`: the run is at its end and its workers stop beating as they exit (not deaths)."""
        store = self.store
        for name in self._new_entries(rendezvous_keys.Entries.START):
            self.started[name] = now
        for name in self._new_entries(rendezvous_keys.Entries.JOIN):
            self._pending.append(name)
            self.asked[name] = now
        current = self.current
        if ending:
            return None
        # Before the heartbeats: a beat first read after the error was beaten after it (`membership.stale`).
        error_at = self._error_at(current, now) if current.generation else None
        self._read_beats(self._watched(), now)
        if current.generation == 0:
            workers = {p for p in self._pending if p not in self.started}
            if len(workers) < self.initial:
                return None
            # In Ray's rank order: the first generation's rank 0 is Ray's, and after a death
            # the lowest surviving Ray rank, whose report the controller reads first.
            nxt = Membership(1, tuple(sorted(workers, key=ray_rank)))
        else:
            # A member whose heartbeat has not come yet counts from its request.
            beats = {m: self._last_beat(m, self.asked[m]) for m in current.members}
            dead = stale(beats, now, self.dead_after_s, error_at, self.confirm_s)
            joiners = self._ready(now)
            if not dead and error_at is None:  # no re-form but the joiners': they may wait for more
                waiting = [self.asked[j] for j in joiners if j not in current.members]
                if waiting and not joiners_due(waiting, len(self._getting_ready(now)), now, self.join_batch_s):
                    joiners = []
            nxt = next_membership(
                current,
                dead,
                joiners,
                None if error_at is None else now - error_at,
                self.confirm_s,
                capacity=self.capacity,
            )
            if nxt is None:
                self._publish_spares(now)
                return None
        store.set(rendezvous_keys.members(nxt.generation), ",".join(nxt.members))
        store.set(rendezvous_keys.GENERATION, str(nxt.generation))
        self.published[nxt.generation] = (now, nxt.members)
        chosen = set(nxt.members)
        self._pending = [p for p in self._pending if p not in chosen]
        self.current = nxt
        self._publish_spares(now)
        return nxt

    def _ready(self, now: float) -> list[str]:
        """The joiners that asked and still beat: one whose node died since (a spare's, most
        likely) would cost the members a re-form to find it gone."""
        return [j for j in self._pending if now - self._last_beat(j, self.asked[j]) <= self.dead_after_s]

    def _publish_spares(self, now: float) -> None:
        """Say how many joiners wait ready for a member's place (the `spares` metric)."""
        waiting = len(set(self._ready(now)) - set(self.current.members))
        if waiting != self._spares:
            self.store.set(rendezvous_keys.SPARES, str(waiting))
            self._spares = waiting

    def _new_entries(self, entries: rendezvous_keys.Entries) -> list[str]:
        """The names in the `ask_to_join` (`Entries.JOIN`) or `announce_start` (`START`) entries since the last look."""
        last, self._seen[entries] = self._seen[entries], self.store.add(entries.counter, 0)
        if self._seen[entries] == last:
            return []
        # Like `get`, a batched read waits for an entry whose counter was taken but not yet set.
        return [
            v.decode()
            for v in read_all(self.store, [entries.entry(n) for n in range(last + 1, self._seen[entries] + 1)])
        ]

    def _getting_ready(self, now: float) -> list[str]:
        """The joiners that started and have not asked yet, still beating."""
        return [
            name
            for name, started_at in self.started.items()
            if name not in self.asked and now - self._last_beat(name, started_at) <= self.dead_after_s
        ]

    def _watched(self) -> list[str]:
        """Whose heartbeats a turn reads: the members, the joiners that asked, and those getting ready."""
        names = dict.fromkeys(self.current.members)
        names.update(dict.fromkeys(self._pending))
        names.update(dict.fromkeys(n for n in self.started if n not in self.asked))
        return list(names)

    def _read_beats(self, names: list[str], now: float) -> None:
        """Read the heartbeat count of each of `names` that has beaten, in batched reads, and
        time each count that changed at `now`; a name not seen beating yet costs a `check`
        until its first beat (one for all when all have)."""
        unseen = [n for n in names if n not in self._beating]
        if unseen and self.store.check([rendezvous_keys.heartbeat(n) for n in unseen]):
            self._beating.update(unseen)
        else:
            self._beating.update(n for n in unseen if self.store.check([rendezvous_keys.heartbeat(n)]))
        beating = [n for n in names if n in self._beating]
        if not beating:
            return
        for name, count in zip(beating, read_all(self.store, [rendezvous_keys.heartbeat(n) for n in beating])):
            if name not in self._beats or self._beats[name][0] != count:
                self._beats[name] = (count, now)

    def _last_beat(self, name: str, before_any: float) -> float:
        """When `name`'s last beat was first read (this turn's included); `before_any` where none has come yet."""
        return self._beats[name][1] if name in self._beats else before_any

    def _error_at(self, current: Membership, now: float) -> Optional[float]:
        """When (the turn at `now` or an earlier one) this owner first read that a collective
        failed that the members of `current` may still be in: one of
        `current`'s, or, where `current` only added joiners to the generation before it, one
        of that generation's, whose members train on in it until their next log step."""
        before = self.published.get(current.generation - 1)
        grew = before is not None and set(before[1]) < set(current.members)
        generations = (current.generation, current.generation - 1) if grew else (current.generation,)
        for generation in generations:
            if generation not in self._errors and self.store.check([rendezvous_keys.error(generation)]):
                self._errors[generation] = now
        return min((self._errors[g] for g in generations if g in self._errors), default=None)


def read_all(store: dist.Store, keys: list[str]) -> list[bytes]:
    """The values of `keys` (each must exist, or be about to), in batched reads of at most `READ_BATCH` keys."""
    return [value for i in range(0, len(keys), READ_BATCH) for value in store.multi_get(keys[i : i + READ_BATCH])]


def register_group(store: dist.Store, token: str, world: int) -> None:
    """Announce a worker group Ray started (its rank 0 does, once), of `world` workers whose
    keys live under the prefix `token`: the server's owner starts its generations afresh."""
    n = store.add(rendezvous_keys.GROUPS, 1)
    store.set(rendezvous_keys.group(n), f"{token} {world}")


def current_token(store: dist.Store) -> Optional[str]:
    """The prefix of the newest registered worker group's keys (None before the first)."""
    return store.get(rendezvous_keys.CURRENT).decode() if store.check([rendezvous_keys.CURRENT]) else None


def current_group(store: dist.Store) -> Optional[dist.Store]:
    """The newest registered worker group's keys (None before the first)."""
    import torch.distributed as dist

    token = current_token(store)
    return None if token is None else dist.PrefixStore(token, store)


class RendezvousServer:
    """The driver's side of in-process recovery: the store the run's workers meet at, on
    `host`, and a thread that runs the newest worker group's `RendezvousOwner` every 10 ms.
    A group Ray (re)starts registers under a token of its own (`register_group`), so its
    generations start afresh and no key of an earlier group is read again. A worker says
    the run is ending (`rendezvous_keys.ENDING`) at its last step: from then on the workers
    stop beating as they exit, which is no death. An error in the owner ends its group's
    in-process recovery, never the thread: it is said to the group (`owner_failed`), whose
    members stop waiting for generations (`RendezvousFailed`), and the group Ray restarts
    registers anew."""

    def __init__(
        self, host: str, dead_after_s: float, confirm_s: float, join_batch_s: float = 0.0, turn_s: float = 0.01
    ) -> None:
        import torch.distributed as dist

        self.store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
        self.host, self.port = host, self.store.port
        self.dead_after_s, self.confirm_s, self.join_batch_s, self.turn_s = (
            dead_after_s,
            confirm_s,
            join_batch_s,
            turn_s,
        )
        self.owner: Optional[RendezvousOwner] = None
        self._groups = 0
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="wildtrain-rendezvous", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import torch.distributed as dist

        while not self._stopped.wait(self.turn_s):
            try:
                self._turn()
            except NoMembersLeft as e:
                # The group is gone (its workers killed for Ray's restart, or their nodes):
                # the restarted group registers anew, and this thread must be there for it.
                print(f"in-process rendezvous: {e}", flush=True)
                self.owner = None
            except Exception as e:  # noqa: BLE001 - any error: the group's restart, never a hang
                reason = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"
                print(f"in-process rendezvous failed, its group falls back to a restart: {reason}", flush=True)
                if self.owner is not None:
                    with contextlib.suppress(dist.DistError):  # the store itself is gone: the members' own bound
                        owner_failed(self.owner.store, reason)
                self.owner = None

    def _turn(self) -> None:
        groups = self.store.add(rendezvous_keys.GROUPS, 0)
        if groups > self._groups:
            import torch.distributed as dist  # here, not at every 10 ms turn

            self._groups, self.owner = groups, None  # the earlier group's owner is done, whatever comes
            token, world = self.store.get(rendezvous_keys.group(groups)).decode().split()
            # Ray placed the group for `world` workers: joiners take lost members' places only.
            self.owner = RendezvousOwner(
                dist.PrefixStore(token, self.store),
                int(world),
                self.dead_after_s,
                self.confirm_s,
                self.join_batch_s,
                capacity=int(world),
            )
            self.store.set(rendezvous_keys.CURRENT, token)
        if self.owner is not None:
            self.owner.turn(time.monotonic(), ending=self.owner.store.check([rendezvous_keys.ENDING]))

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()
