"""Who trains in the next generation of an in-process elastic group, and from whose state.

The decisions of in-process recovery (issue 24), kept pure so that they can be tested
without processes: workers stay alive across a resize, and a resize is a new generation of
the process group (a new TCPStore prefix) whose members are the survivors, in their old
order, followed by the workers that asked to join.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Iterable, Mapping, Optional, Sequence


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
    sources: tuple[int, ...]  # by old rank: the new rank that sends that partition


def plan_repartition(held: Sequence[Optional[Mapping[tuple[int, int, int], Collection[int]]]]) -> Repartition:
    """From which snapshots a new generation rebuilds ZeRO-sharded state, when each rank keeps
    host copies of its own partition and of its ring predecessor's (the mirror) for the last
    committed steps. `held[new_rank]` maps (layout generation, layout world, old rank) to the
    steps held of that partition; None for a joiner, which holds nothing.

    The newest layout that some step covers whole wins, at the highest such step; each
    partition comes from the lowest new rank holding it. A step is committed (logged) only
    once every mirror of it is in place, so the step chosen is never below a committed one:
    a rank at most loses the step it was in when a peer died and, where that step's mirrors
    were still on their way, the step before it (`generations.PeerCommits`); it logged neither."""
    found: dict[Layout, dict[int, dict[int, int]]] = {}  # layout -> step -> old rank -> lowest new rank
    for new_rank, partitions in enumerate(held):
        for (generation, world, old_rank), steps in (partitions or {}).items():
            for step in steps:
                found.setdefault((generation, world), {}).setdefault(step, {}).setdefault(old_rank, new_rank)
    for layout in sorted(found, reverse=True):
        whole = [step for step, owners in found[layout].items() if len(owners) == layout[1]]
        if whole:
            step = max(whole)
            owners = found[layout][step]
            return Repartition(layout, step, tuple(owners[r] for r in range(layout[1])))
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
