"""Every key of the stores workers meet at, named once: the in-process group's rendezvous
store (the driver's `rendezvous.RendezvousServer`), and the one key the restart path's
fail-fast shares with it (`PEER_FAILED`). Each says who writes it and who reads it.

The rendezvous store holds, unprefixed, the worker groups registered and the current one; under
each group's prefix (its token, `group_token`), the group's membership (requests, heartbeats,
generations); and under each generation's prefix (`generation_groups`), c10d's own keys for
that generation's process groups. A key's value is text: a name, a number, or names joined by ",".
"""

from __future__ import annotations

import enum

# Unprefixed: the worker groups that Ray started, one per attempt.

# How many groups registered: added to by each group's rank 0 (`rendezvous.register_group`), read by the server.
GROUPS = "groups"
# The newest group's token: written by the server once it owns that group, read by the controller (`survivors`).
CURRENT = "current"


def group(n: int) -> str:
    """The n-th registered group (from 1), "<token> <world size>": written by its rank 0, read by the server."""
    return f"group/{n}"


def group_token(attempt: str) -> str:
    """The prefix of the keys of a worker group, from a token new with its attempt: chosen by its
    rank 0 (`in_process.Member.of_ray_worker`) and registered (`group`)."""
    return f"group-{attempt}"


def generation_groups(token: str, generation: int) -> str:
    """The prefix, under the store's root, of c10d's keys for the process groups of `generation`
    of the group `token`: written and read by c10d alone, in the members' `init_process_group`."""
    return f"{token}/g{generation}"


# Under a group's prefix.


class Entries(enum.Enum):
    """A list that workers append their names to: a counter (`counter`) and one key per entry
    (`entry(n)`, from 1). Written by workers (`rendezvous.ask_to_join`, `announce_start`), read
    in order by the owner (`RendezvousOwner`)."""

    JOIN = "join"  # a worker asks to be a member of the next generation
    START = "start"  # a joiner's process started: it asks once ready

    @property
    def counter(self) -> str:
        return f"{self.value}s"

    def entry(self, n: int) -> str:
        return f"{self.value}/{n}"


# The generation published last: written by the owner after its `members`, read by members and the controller.
GENERATION = "gen"
# How many joiners wait ready for a member's place: written by the owner, read by a member for the `spares` metric.
SPARES = "spares"
# The run is at its last step, so silence is no death: written by a member (`Member.leave`), read by the server.
ENDING = "ending"
# Why the owner failed (`RendezvousFailed`): written by the server, read by the members that wait on the owner.
OWNER_FAILED = "failed"
# A rank's reason for failing the attempt: written by that rank, read by every other's watcher
# (`collectives.PeerWatch`). In the store the attempt's groups met at, so new with each attempt: under
# the group's prefix in-process, else Ray Train's (it rendezvouses each group on a fresh port).
PEER_FAILED = "wildtrain/peer_failed"


def members(generation: int) -> str:
    """Generation `generation`'s members by rank, joined by ",": written by the owner before
    `GENERATION`, so that a reader of it finds them; read by members, their loss watch and the controller."""
    return f"members/{generation}"


def heartbeat(name: str) -> str:
    """How many heartbeats `name` has beaten: added to by its `rendezvous.Heartbeat`, read by the owner."""
    return f"hb/{name}"


def node(name: str) -> str:
    """The Ray node `name` runs on: written by the member, read by the drills and benches that take it down."""
    return f"node/{name}"


def error(generation: int) -> str:
    """A collective of `generation` failed (someone left, not who): written by a failing member or
    by the controller on Ray's word of a death (`rendezvous.report_error`), read by the owner."""
    return f"error/{generation}"


def failures(generation: int) -> str:
    """How many members saw a collective of `generation` fail: added to by each, which reads back
    whether it was the first (`Member.lost_member`)."""
    return f"failed/{generation}"


def arrived(generation: int, name: str) -> str:
    """`name` is at the rendezvous of `generation`'s groups: written by that member, read by the
    others (`Member._arrive`) and the benches that wait for a joiner."""
    return f"arrived/{generation}/{name}"
