"""What an error in a worker group's training is (`classify`), decided in one place for
both recovery paths: the fail-fast that ends an attempt on every rank
(`collectives.failing_together`) and the in-process membership that asks whether a member
is gone (`in_process.Member.lost_member`)."""

from __future__ import annotations

import enum
from typing import Optional

import torch.distributed as dist

from wildtrain.elastic.membership import RedundancyLost
from wildtrain.elastic.signals import FinalCheckpointFailed, MembersJoining, PlannedRegrow, UnhealthyNodes

# Raised by every rank at the same step: nobody's failure, and nobody to tell.
TOGETHER: tuple[type[BaseException], ...] = (
    PlannedRegrow,
    UnhealthyNodes,
    FinalCheckpointFailed,
    RedundancyLost,
    MembersJoining,
)


class Superseded(RuntimeError):
    """A newer generation came before every member of this one arrived: form that one."""


class FailureKind(enum.Enum):
    TOGETHER = "raised by every rank at once"
    SUPERSEDED = "a newer generation came while this one formed"
    PEER = "another rank failed on its own"
    COLLECTIVE = "a collective failed and no rank said why: a member may be gone"
    OWN = "this rank's own error"


def classify(
    error: BaseException, peer_failure: Optional[str], together: tuple[type[BaseException], ...] = TOGETHER
) -> FailureKind:
    """What `error` is, given another rank's reason if one failed (`collectives.PeerWatch`):
    only a collective's failure that no rank explains (`COLLECTIVE`) can be a member's death,
    and only the in-process membership can tell (it asks the rendezvous's owner); wildtrain's
    own signals and bugs are this rank's (`OWN`)."""
    if isinstance(error, together):
        return FailureKind.TOGETHER
    if isinstance(error, Superseded):
        return FailureKind.SUPERSEDED
    if peer_failure is not None:
        return FailureKind.PEER
    if type(error) is RuntimeError or isinstance(error, dist.DistError):
        return FailureKind.COLLECTIVE
    return FailureKind.OWN
