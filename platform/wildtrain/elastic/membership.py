"""Who trains in the next generation of an in-process elastic group, and from whose state.

The decisions of in-process recovery (issue 24), kept pure so that they can be tested
without processes: workers stay alive across a resize, and a resize is a new generation of
the process group (a new TCPStore prefix) whose members are the survivors, in their old
order, followed by the workers that asked to join.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Collection, Iterable, Iterator, Mapping, Optional, Sequence


@dataclass(frozen=True)
class Membership:
    generation: int
    members: tuple[str, ...]  # by rank

    def rank(self, member: str) -> Optional[int]:
        return self.members.index(member) if member in self.members else None


def stale(
    beats: Mapping[str, float],
    now: float,
    dead_after_s: float,
    error_at: Optional[float] = None,
    confirm_s: float = 0.0,
) -> frozenset[str]:
    """The members found dead, from when their last heartbeats were read: silent for longer
    than `dead_after_s`, or, once a collective failed (read at `error_at`), silent since then
    for `confirm_s`. A failed collective says someone left but not who; the heartbeats that
    continue after it say who did not, sooner than the silence that has to cover a hang.

    Every time is the reader's clock (`rendezvous.RendezvousOwner`'s `now`), never a member's,
    which may be seconds off. A beat read in the same look as the error, or before, is no sign
    of life since: the error is read first in a look, and a beat read in it may predate it."""
    after_error = error_at is not None and now - error_at >= confirm_s  # as `next_membership` counts it
    return frozenset(
        member for member, beat in beats.items() if now - beat > dead_after_s or (after_error and beat <= error_at)
    )


class NoMembersLeft(RuntimeError):
    """Every member of a generation is dead and none asked to join: only a checkpoint can
    restore the run (Ray restarts the worker group)."""


def next_membership(
    current: Membership,
    dead: Iterable[str],
    joiners: Sequence[str],
    errored_for_s: Optional[float] = None,
    confirm_s: float = 0.0,
    capacity: Optional[int] = None,
) -> Optional[Membership]:
    """The next generation, or None while the current one should stand.

    Survivors keep their order, so rank 0 stays rank 0 while it lives; joiners (in the order
    they asked) follow, as many as `capacity` members leaves room for: the others wait as
    spares, ready, and take the place of the next member lost. A collective that failed `errored_for_s` ago without
    anyone found dead
    re-forms the same members, but only after `confirm_s`, the time `stale` takes to find a
    dead member after a failed collective: re-forming earlier could include a member that is
    dead but not yet found, and the new group's rendezvous would wait for it until it timed
    out."""
    dead = set(dead)
    survivors = tuple(m for m in current.members if m not in dead)
    members_now = set(current.members)
    joining = tuple(dict.fromkeys(j for j in joiners if j not in members_now and j not in dead))
    if capacity is not None:
        joining = joining[: max(0, capacity - len(survivors))]
    members = survivors + joining
    if members == current.members:
        if errored_for_s is None or errored_for_s < confirm_s:
            return None
    if not members:
        raise NoMembersLeft(
            f"generation {current.generation}: every member ({', '.join(current.members)}) is dead "
            "and none asked to join; only a checkpoint can restore this run"
        )
    return Membership(current.generation + 1, members)


def joiners_due(asked_at: Collection[float], getting_ready: int, now: float, batch_s: float) -> bool:
    """Whether workers that asked to join (at the times `asked_at`) are taken in now, rather
    than held for `getting_ready` others whose processes started but have not asked yet, so
    that the members stop once for all of them. A hold lasts at most `batch_s` after the first
    request: a joiner that never gets ready (its node lost again) delays the others no more."""
    return bool(asked_at) and (getting_ready == 0 or now - min(asked_at) >= batch_s)


def must_abandon(current: Membership, newer: Membership) -> bool:
    """Whether a collective in flight in `current` can never finish: a member left. A newer
    generation that only adds joiners lets the step finish first (the group re-forms at its
    boundary)."""
    return not set(current.members) <= set(newer.members)


# A ZeRO partition's identity: the generation whose layout cut it (a resize re-cuts every
# partition), that layout's world size, and the rank that owned it there.
Layout = tuple[int, int]  # (generation, world size)


def mirror_ring(nodes: Sequence[str]) -> tuple[int, ...]:
    """The ranks of a layout in the order in which each mirrors its ZeRO partition to the next
    (the last to the first), given each rank's node: a partition and its mirror on different
    nodes wherever the nodes allow it, so that a node's death, which takes all of its ranks at
    once, takes no partition together with its mirror. On GPU nodes of several workers, ranks
    in their own order would mirror to a rank of the same node.

    Each place takes a rank of the node with the most ranks left, other than the last place's
    (ties: the first place's node, to use it up before the ring closes on it, then the lowest
    rank): no two neighbours share a node unless one node holds more than half the ranks, and
    then as few as can. Ranks each on a node of their own keep their order."""
    left: dict[str, list[int]] = {}
    for rank, node in enumerate(nodes):
        left.setdefault(node, []).append(rank)
    ring: list[int] = []
    previous: Optional[str] = None
    first: Optional[str] = None
    while len(ring) < len(nodes):
        candidates = [node for node, ranks in left.items() if ranks and node != previous] or [previous]
        previous = max(candidates, key=lambda node: (len(left[node]), node == first, -left[node][0]))
        first = previous if first is None else first
        ring.append(left[previous].pop(0))
    return tuple(ring)


class RedundancyLost(RuntimeError):
    """Some partition of the sharded state exists nowhere alive at any step its peers share:
    its owner and the holder of its mirror both left. Only a checkpoint restores the run."""


@dataclass(frozen=True)
class Repartition:
    layout: Layout  # the layout restored from
    step: int  # the optimizer steps the restored state has taken
    holders: tuple[tuple[int, ...], ...]  # by old rank: the new ranks that hold that partition at `step`


def plan_repartition(held: Sequence[Optional[Mapping[tuple[int, int, int], Collection[int]]]]) -> Repartition:
    """From which snapshots a new generation rebuilds ZeRO-sharded state, when each rank keeps
    host copies of its own partition and of its ring predecessor's (the mirror) for the last
    committed steps. `held[new_rank]` maps (layout generation, layout world, old rank) to the
    steps held of that partition; None for a joiner, which holds nothing.

    The newest layout that some step covers whole wins, at the highest such step, with every
    new rank that holds each of its partitions (`plan_transfers` picks which one sends). A step
    is committed (logged) only once every mirror of it is in place, so the step chosen is never
    below a committed one: a rank at most loses the step it was in when a peer died and, where
    that step's mirrors were still on their way, the step before it (`generations.PeerCommits`);
    it logged neither."""
    found: dict[Layout, dict[int, dict[int, list[int]]]] = {}  # layout -> step -> old rank -> new ranks
    for new_rank, partitions in enumerate(held):
        for (generation, world, old_rank), steps in (partitions or {}).items():
            for step in steps:
                found.setdefault((generation, world), {}).setdefault(step, {}).setdefault(old_rank, []).append(new_rank)
    for layout in sorted(found, reverse=True):
        whole = [step for step, holders in found[layout].items() if len(holders) == layout[1]]
        if whole:
            step = max(whole)
            holders = found[layout][step]
            return Repartition(layout, step, tuple(tuple(holders[r]) for r in range(layout[1])))
    if not found:
        raise RedundancyLost("no rank of the new group holds any partition of the state")
    layout = max(found)
    step = max(found[layout])
    missing = sorted(set(range(layout[1])) - set(found[layout][step]))
    raise RedundancyLost(
        f"partitions {missing} of generation {layout[0]}'s {layout[1]} ranks are held nowhere "
        f"alive at step {step} (an owner and its mirror's holder both left): only a checkpoint "
        "restores this run"
    )


def zero_partition_size(numel: int, world: int) -> int:
    """Each rank's share of a parameter group of `numel` values, padding included, as DeepSpeed
    0.19's ZeRO-1/2 optimizers cut it (stage_1_and_2.py and bf16_optimizer.py, without
    `parameter_alignment`): the group's parameters flattened end to end, padded at the end to a
    multiple of 2 x `world` (`nccl_start_alignment_factor`: 4-byte starts for 2-byte values),
    split evenly; the last ranks' shares hold the padding."""
    alignment = 2 * world
    return -(-numel // alignment) * alignment // world


def zero3_partition_size(numel: int, world: int) -> int:
    """Each rank's share of a parameter of `numel` values, padding included, as DeepSpeed 0.19's
    ZeRO-3 cuts it (partition_parameters.py, `_partition_param`): each parameter on its own,
    padded at the end to a multiple of `world`, split evenly."""
    return -(-numel // world)


@dataclass(frozen=True)
class Cut:
    """How a layout of `world` ranks cuts each piece of the state (`Pieces`) into partitions."""

    world: int
    sizes: tuple[int, ...]  # per piece: each rank's share of it, padding included

    @classmethod
    def of(cls, numels: Sequence[int], world: int) -> "Cut":
        """DeepSpeed's ZeRO-1/2 cut of parameter groups of `numels` values over `world` ranks."""
        return cls(world, tuple(zero_partition_size(numel, world) for numel in numels))

    @classmethod
    def of_parameters(cls, numels: Sequence[int], world: int) -> "Cut":
        """DeepSpeed's ZeRO-3 cut of parameters of `numels` values over `world` ranks."""
        return cls(world, tuple(zero3_partition_size(numel, world) for numel in numels))

    def span(self, piece: int, rank: int, numel: int) -> tuple[int, int]:
        """The values [start, end) of `piece`'s first `numel` (its unpadded values) in `rank`'s share."""
        size = self.sizes[piece]
        return min(rank * size, numel), min((rank + 1) * size, numel)


@dataclass(frozen=True)
class Pieces:
    """How a ZeRO stage lays out a rank's partition: each parameter group (a sub-group at
    ZeRO-3) is made of pieces that are each cut evenly over the ranks (`Cut`), and a rank's
    partition of the group is its share of each piece, end to end. At ZeRO-1/2 a group is one
    piece, flattened; at ZeRO-3 each parameter is a piece (DeepSpeed's `ds_tensor`). Every rank
    of a layout lays its partition out alike."""

    sizes: tuple[tuple[int, ...], ...]  # per parameter group: each piece's share per rank, padding included

    @property
    def partitions(self) -> tuple[int, ...]:
        """Per parameter group: a rank's partition of it."""
        return tuple(sum(group) for group in self.sizes)

    def cut(self, world: int) -> Cut:
        """The cut of every piece, the groups' end to end, at `world` ranks."""
        return Cut(world, tuple(size for group in self.sizes for size in group))

    def places(self) -> tuple[tuple[int, int], ...]:
        """Per piece, in `cut`'s order: its parameter group and where its share starts in a
        rank's partition of that group."""
        places = []
        for group, sizes in enumerate(self.sizes):
            offset = 0
            for size in sizes:
                places.append((group, offset))
                offset += size
        return tuple(places)


@dataclass(frozen=True)
class Transfer:
    """Values `src` sends `dst` (or copies, where they are one rank): `length` values of
    piece `piece` (`Pieces`) from offset `src_offset` of old rank `old_rank`'s share of it,
    which `src` holds, to offset `dst_offset` of `dst`'s new share of it."""

    piece: int
    src: int
    dst: int
    old_rank: int
    src_offset: int
    dst_offset: int
    length: int


@dataclass(frozen=True)
class TransferPlan:
    sources: tuple[int, ...]  # by old rank: the new rank that sends from that partition
    transfers: tuple[Transfer, ...]  # by piece, then destination, then offset: all, or those of one rank

    def tags(self) -> tuple[int, ...]:
        """Per transfer: how many transfers between its `src` and `dst` come before it in the
        plan. Every rank's plan holds all the transfers between it and any peer, in one order,
        so the sender and the receiver number each message alike."""
        seen: dict[tuple[int, int], int] = {}
        tags = []
        for transfer in self.transfers:
            pair = (transfer.src, transfer.dst)
            tags.append(seen.get(pair, 0))
            seen[pair] = tags[-1] + 1
        return tuple(tags)


def plan_transfers(
    numels: Sequence[int], old: Cut, new: Cut, holders: Sequence[Sequence[int]], rank: Optional[int] = None
) -> TransferPlan:
    """How the ranks of `new` assemble their partitions of pieces of `numels` values (parameter
    groups at ZeRO-1/2, parameters at ZeRO-3: `Pieces`) from the partitions of `old`
    (`holders[old_rank]`: the new ranks that hold it, from `plan_repartition`): every value of
    a piece, padding excluded, moves once, from one holder of the old partition it is in to the
    new partition it falls in. A rank receives at most its new partition and sends at most the
    old partitions it is the source of; the padding is no one's to send (each new partition's
    is zeros). With `rank`, the plan holds only the transfers that new rank sends or receives,
    in the whole plan's order: what a rank needs, without building every other rank's (at
    ZeRO-3 a few per parameter and rank).

    Each old partition's source is, of its holders (those held by one holder first), the one
    that would then send the fewest values in all, and of those the one that keeps most of it:
    a holder sends no part of the partition that falls in its own new one, so a survivor
    mostly sends from its own."""
    if len(holders) != old.world or any(not h for h in holders):
        raise ValueError(f"holders {holders}: one or more new ranks for each of the {old.world} old partitions")
    for cut in (old, new):
        short = [p for p, numel in enumerate(numels) if cut.world * cut.sizes[p] < numel]
        if len(cut.sizes) != len(numels) or short:
            raise ValueError(
                f"{cut.world} partitions of {cut.sizes} values cannot hold pieces of {list(numels)} "
                "values: the state is of another model"
            )
    sources = _sources(numels, old, new, holders)
    if rank is None:
        transfers = [
            t
            for piece in range(len(numels))
            for dst in range(new.world)
            for t in _arrivals(numels, old, new, sources, piece, dst)
        ]
    else:
        sourced = [old_rank for old_rank, source in enumerate(sources) if source == rank]
        transfers = []
        for piece in range(len(numels)):
            sent = (
                t
                for old_rank in sourced
                for t in _departures(numels, old, new, sources, piece, old_rank)
                if t.dst != rank
            )
            transfers += sorted(
                (*sent, *_arrivals(numels, old, new, sources, piece, rank)), key=lambda t: (t.dst, t.dst_offset)
            )
    return TransferPlan(sources, tuple(transfers))


def _sources(numels: Sequence[int], old: Cut, new: Cut, holders: Sequence[Sequence[int]]) -> tuple[int, ...]:
    """By old rank: the holder that sends from its partition (`plan_transfers`). Pieces alike
    in their values and cuts overlap alike, so each kind is counted once, times its pieces: a
    model's parameters are of a few shapes."""
    kinds = list(zip(numels, old.sizes, new.sizes))
    counts = Counter(kinds)
    example = {kind: kinds.index(kind) for kind in counts}  # the first piece of each kind stands for them all

    def values(old_rank: int, holder: Optional[int]) -> int:
        """The values of `old_rank`'s partition, or of them those that fall in `holder`'s new partition."""
        total = 0
        for kind, count in counts.items():
            piece, numel = example[kind], kind[0]
            start, end = old.span(piece, old_rank, numel)
            if holder is not None:
                new_start, new_end = new.span(piece, holder, numel)
                start, end = max(start, new_start), min(end, new_end)
            total += count * max(0, end - start)
        return total

    sending: dict[int, int] = {}  # new rank -> values it sends so far
    sources: dict[int, int] = {}
    for old_rank in sorted(range(old.world), key=lambda r: (len(set(holders[r])), r)):
        held = values(old_rank, None)
        away = {holder: held - values(old_rank, holder) for holder in set(holders[old_rank])}
        source = min(away, key=lambda h: (sending.get(h, 0) + away[h], away[h], h))
        sources[old_rank] = source
        sending[source] = sending.get(source, 0) + away[source]
    return tuple(sources[r] for r in range(old.world))


def _arrivals(
    numels: Sequence[int], old: Cut, new: Cut, sources: Sequence[int], piece: int, dst: int
) -> list[Transfer]:
    """The transfers that fill `dst`'s new share of `piece`, by offset: its span cut where old partitions end."""
    start, end = new.span(piece, dst, numels[piece])
    return [
        _transfer(old, new, sources, piece, old_rank, dst, at, stop)
        for old_rank, at, stop in _cut(start, end, old.sizes[piece])
    ]


def _departures(
    numels: Sequence[int], old: Cut, new: Cut, sources: Sequence[int], piece: int, old_rank: int
) -> list[Transfer]:
    """The transfers from `old_rank`'s share of `piece`, by destination: its span cut where new partitions end."""
    start, end = old.span(piece, old_rank, numels[piece])
    return [
        _transfer(old, new, sources, piece, old_rank, dst, at, stop)
        for dst, at, stop in _cut(start, end, new.sizes[piece])
    ]


def _cut(start: int, end: int, size: int) -> Iterator[tuple[int, int, int]]:
    """The values [start, end) cut where partitions of `size` values end: (partition, start, stop) of each part."""
    while start < end:
        index = start // size
        stop = min(end, (index + 1) * size)
        yield index, start, stop
        start = stop


def _transfer(
    old: Cut, new: Cut, sources: Sequence[int], piece: int, old_rank: int, dst: int, start: int, stop: int
) -> Transfer:
    """The move of `piece`'s values [start, stop), in `old_rank`'s old partition and `dst`'s new one."""
    return Transfer(
        piece,
        sources[old_rank],
        dst,
        old_rank,
        start - old_rank * old.sizes[piece],
        start - dst * new.sizes[piece],
        stop - start,
    )
