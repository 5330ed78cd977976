"""What an in-process generation's ranks carry from the attempt before (`Leftovers`): rank 0's
unreported windows, events and commits on every rank, so that where rank 0's node takes its
last report before the controller collected it, the next rank's report (a joiner's included,
which brought none of its own) carries the same."""

import dataclasses

from tests.helpers.ranks import spawned_pair
from wildtrain.events import Failure, Resize
from wildtrain.train import generations
from wildtrain.train.generations import Leftovers
from wildtrain.train.state import TrainState

SPAWNED_S = 180  # a spawned rank imports torch and the trainer: over a minute on a loaded machine

MEMBERS = Leftovers(
    states={6: TrainState(step=6, world_size=1)},
    windows=[{"step": 5, "at": 1.0}, {"step": 6, "at": 2.0}],
    events=[Resize(3.0, 1, 6, "workers joined the group of 1", ["node-a"])],
    committed=["s3://bucket/runs/r/checkpoints/step_4"],
    known_good=[("s3://bucket/runs/r", "step_4")],
    interruption=Resize(3.0, 1, 6, "workers joined the group of 1", ["node-a"]),
)


def _rank(rank: int, results) -> None:
    own = MEMBERS if rank == 0 else Leftovers.joiner(None)  # rank 1 joins the member that is rank 0
    results.put((rank, own.of_rank(0)))


def test_a_joiner_carries_rank_zeros_unreported_windows_events_and_commits_and_keeps_its_own_state():
    with spawned_pair(_rank) as results:
        shared = dict(results.get(timeout=SPAWNED_S) for _ in range(2))
    assert shared[0] == MEMBERS
    joiner = shared[1]
    assert (joiner.windows, joiner.events, joiner.committed, joiner.known_good, joiner.interruption) == (
        MEMBERS.windows,
        MEMBERS.events,
        MEMBERS.committed,
        MEMBERS.known_good,
        MEMBERS.interruption,
    )
    assert joiner.states == {} and joiner.saving is None  # its own: the state comes from the peers' partitions


def test_the_ranks_restore_from_their_peers_where_any_trained_and_from_the_checkpoint_where_none_did():
    peers, checkpoint = generations.RestoreFrom.PEERS, generations.RestoreFrom.CHECKPOINT
    # A survivor whose first attempt died during start-up beside one that trained.
    assert generations.plan_restore([False, True]) == generations.RestorePlan(peers, shared_by=1)
    # A member that trained and a joiner.
    assert generations.plan_restore([True, False]) == generations.RestorePlan(peers, shared_by=0)
    # Every first attempt died during start-up.
    assert generations.plan_restore([False, False]) == generations.RestorePlan(checkpoint, shared_by=None)


def test_a_loss_before_the_attempt_stepped_is_the_same_outage_as_the_one_it_recovered_from():
    state = TrainState(step=6, world_size=2)
    lost = generations.interrupted_by_loss(
        RuntimeError("Connection closed by peer\nat ..."), 9.0, True, state, 2, ["node-a"], MEMBERS
    )
    assert (lost.at, lost.world_size, lost.last_step, lost.nodes) == (9.0, 2, 6, ["node-a"])
    assert isinstance(lost, Failure) and lost.cause == "a member left the group of 2: Connection closed by peer"
    again = generations.interrupted_by_loss(RuntimeError("lost"), 9.0, False, state, 2, ["node-a"], MEMBERS)
    assert again is MEMBERS.interruption
    # Nothing recovered from before (a first attempt, or a joiner's): a failure of its own.
    for left in (None, Leftovers.joiner(None)):
        first = generations.interrupted_by_loss(RuntimeError("lost"), 9.0, False, state, 2, ["node-a"], left)
        assert first.last_step == 6 and first.at == 9.0


def _restore_rank(rank: int, results) -> None:
    # Rank 0's first attempt died during start-up (it left nothing); rank 1's trained.
    results.put((rank, generations.agree_on_restore(None if rank == 0 else MEMBERS)))


def test_a_survivor_that_left_nothing_restores_from_its_peers_with_one_that_trained():
    """Each rank chose alone (`left is None`): rank 0 a checkpoint, rank 1 its peers, and the
    two waited in collectives that never matched until monitor.startup_timeout_s."""
    with spawned_pair(_restore_rank) as results:
        agreed = dict(results.get(timeout=SPAWNED_S) for _ in range(2))
    assert agreed[1] == MEMBERS
    assert agreed[0] is not None, "rank 0 restores from a checkpoint where rank 1 restores from its peers"
    assert agreed[0] == dataclasses.replace(MEMBERS, states={}), (
        "rank 1's windows, events, commits; no state of its own"
    )
