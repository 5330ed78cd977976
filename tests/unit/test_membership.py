import itertools
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wildtrain.elastic.membership import (
    Cut,
    Membership,
    NoMembersLeft,
    Pieces,
    RedundancyLost,
    Repartition,
    Transfer,
    joiners_due,
    mirror_ring,
    must_abandon,
    next_membership,
    plan_repartition,
    plan_transfers,
    stale,
    zero3_partition_size,
    zero_partition_size,
)

THREE = Membership(4, ("w0", "w1", "w2"))


def test_a_death_keeps_the_survivors_in_order_and_a_joiner_comes_last():
    shrunk = next_membership(THREE, dead={"w0"}, joiners=[])
    assert shrunk == Membership(5, ("w1", "w2"))
    assert shrunk.rank("w1") == 0 and shrunk.rank("w0") is None
    grown = next_membership(shrunk, dead=set(), joiners=["w3", "w1", "w3"])
    assert grown == Membership(6, ("w1", "w2", "w3")), "a member asking again is not a joiner; one request each"


def test_a_death_and_a_return_together_make_one_generation():
    assert next_membership(THREE, dead={"w1"}, joiners=["w3", "w4"]) == Membership(5, ("w0", "w2", "w3", "w4"))


def test_joiners_beyond_the_capacity_wait_and_one_takes_a_dead_members_place():
    assert next_membership(THREE, dead=(), joiners=["spare.1"], capacity=3) is None, "the group is whole"
    replaced = next_membership(THREE, dead={"w1"}, joiners=["spare.1", "spare.2"], capacity=3)
    assert replaced == Membership(5, ("w0", "w2", "spare.1")), "the first to ask; the other waits on"


def test_nothing_changed_keeps_the_generation_until_a_failed_collective_has_aged():
    assert next_membership(THREE, dead=(), joiners=["w2"]) is None
    assert next_membership(THREE, dead=(), joiners=[], errored_for_s=0.4, confirm_s=0.5) is None
    same = next_membership(THREE, dead=(), joiners=[], errored_for_s=0.6, confirm_s=0.5)
    assert same == Membership(5, THREE.members), "a broken group re-forms with the same members"


def test_a_dead_joiner_is_not_admitted_and_no_one_left_is_an_error():
    assert next_membership(THREE, dead={"w3"}, joiners=["w3"]) is None
    with pytest.raises(NoMembersLeft, match="generation 4: every member"):
        next_membership(THREE, dead=set(THREE.members), joiners=[])


def test_joiners_wait_for_one_getting_ready_for_at_most_the_batch_time_from_the_first_request():
    assert joiners_due([10.0], getting_ready=0, now=10.0, batch_s=10.0), "nobody else coming: at once"
    assert not joiners_due([10.0, 12.0], getting_ready=1, now=19.9, batch_s=10.0)
    assert joiners_due([12.0, 10.0], getting_ready=1, now=20.0, batch_s=10.0)
    assert joiners_due([10.0], getting_ready=1, now=10.0, batch_s=0.0), "0: each as it asks"
    assert not joiners_due([], getting_ready=0, now=10.0, batch_s=10.0), "nobody asked"


def test_stale_heartbeats():
    assert stale({"w0": 10.0, "w1": 8.9, "w2": 9.5}, now=10.0, dead_after_s=1.0) == {"w1"}


def test_after_a_failed_collective_a_member_silent_since_is_dead_sooner():
    beats = {"w0": 10.3, "w1": 9.95, "w2": 10.25}
    assert stale(beats, now=10.3, dead_after_s=1.0, error_at=10.0, confirm_s=0.5) == set(), "not confirmed yet"
    assert stale(beats, now=10.6, dead_after_s=1.0, error_at=10.0, confirm_s=0.5) == {"w1"}


def test_a_beat_read_in_the_same_look_as_the_error_is_no_sign_of_life_since():
    # The owner reads the error first in a look: a beat that look read may have been beaten before it.
    beats = {"w0": 10.3, "w1": 10.0}
    assert stale(beats, now=10.6, dead_after_s=1.0, error_at=10.0, confirm_s=0.5) == {"w1"}


def test_only_a_departure_abandons_a_collective_in_flight():
    assert must_abandon(THREE, Membership(5, ("w0", "w2")))
    assert not must_abandon(THREE, Membership(5, ("w0", "w1", "w2", "w3")))


def held(*partitions):
    """A rank's snapshots: ((old rank, steps), ...) of generation 1's three ranks."""
    return {(1, 3, old_rank): steps for old_rank, steps in partitions}


def test_a_dead_ranks_partition_comes_from_its_mirror_at_the_newest_step_all_share():
    # Rank 1 of three died; survivors 0 and 2 (new ranks 0 and 1) hold their own partitions
    # and mirrors of their ring predecessors' (old rank 0 holds 2's, old rank 2 holds 1's).
    # Old rank 0 had taken step 8 when it saw the failure; the mirrors stopped at 7.
    plan = plan_repartition([held((0, {7, 8}), (2, {7})), held((2, {6, 7}), (1, {6, 7}))])
    assert plan == Repartition(layout=(1, 3), step=7, holders=((0,), (1,), (0, 1)))


def test_a_joiner_holds_nothing_and_the_newest_whole_layout_wins():
    after_resize = {(2, 2, 0): {9}, (2, 2, 1): {9}, (1, 3, 0): {7}}
    plan = plan_repartition([after_resize, None, {(2, 2, 1): {9}, (2, 2, 0): {9}}])
    assert plan == Repartition(layout=(2, 2), step=9, holders=((0, 2), (0, 2)))
    # The resize's own commit failed before every mirror was in place: the old layout stands.
    plan = plan_repartition([{(2, 2, 0): {9}, (1, 3, 0): {7}, (1, 3, 2): {7}}, {(1, 3, 1): {7}}])
    assert plan == Repartition(layout=(1, 3), step=7, holders=((0,), (1,), (0,)))


def test_deepspeed_cuts_a_group_padded_to_twice_the_world_in_even_partitions():
    # stage_1_and_2.py: the flat group padded to a multiple of nccl_start_alignment_factor (2) x world.
    assert [zero_partition_size(10, world) for world in (1, 2, 3, 4)] == [10, 6, 4, 4]
    assert Cut.of([10, 7], 3) == Cut(3, (4, 4)) and Cut(3, (4, 4)).span(0, 2, 10) == (8, 10)


def test_a_shrink_sends_each_slice_once_from_a_holder_keeping_what_stays_put():
    # Three ranks of 4 values a group of 10 (2 of padding) re-cut over two of 6 (2 of padding);
    # old rank 1 died, its mirror on old rank 2 (new rank 1); old rank 2's on old rank 0.
    plan = plan_transfers([10], Cut.of([10], 3), Cut.of([10], 2), [(0,), (1,), (0, 1)])
    # Old rank 2's partition, held by both, comes from new rank 1, where it stays.
    assert plan.sources == (0, 1, 1)
    assert plan.transfers == (
        Transfer(piece=0, src=0, dst=0, old_rank=0, src_offset=0, dst_offset=0, length=4),
        Transfer(piece=0, src=1, dst=0, old_rank=1, src_offset=0, dst_offset=4, length=2),
        Transfer(piece=0, src=1, dst=1, old_rank=1, src_offset=2, dst_offset=0, length=2),
        Transfer(piece=0, src=1, dst=1, old_rank=2, src_offset=0, dst_offset=2, length=2),
    )
    with pytest.raises(ValueError, match="another model"):
        plan_transfers([13], Cut.of([10], 3), Cut.of([13], 2), [(0,), (1,), (0, 1)])


def test_a_source_counts_every_piece_of_a_kind_it_keeps():
    # Old rank 1 holds values [2, 4) of each piece; new rank 1 keeps those of both pieces of 4
    # (4 values), new rank 0 those of the piece of 6 (2): pieces alike are counted once each.
    numels, holders = [6, 4, 4], [(0,), (1, 0), (1, 0)]
    assert plan_transfers(numels, Cut.of(numels, 3), Cut.of(numels, 2), holders).sources == (0, 1, 1)


def test_deepspeed_zero3_cuts_each_parameter_on_its_own_padded_to_the_world():
    # partition_parameters.py: a parameter padded to a multiple of the world, split evenly.
    assert [zero3_partition_size(10, world) for world in (1, 2, 3, 4)] == [10, 5, 4, 3]
    assert Cut.of_parameters([10, 7, 2], 3) == Cut(3, (4, 3, 1))
    # A rank's partition of a (sub-)group is its share of each parameter, end to end.
    pieces = Pieces(((4, 3), (1,)))
    assert pieces.partitions == (7, 1) and pieces.cut(3) == Cut(3, (4, 3, 1))
    assert pieces.places() == ((0, 0), (0, 4), (1, 0))


@st.composite
def resizes(draw):
    """Pieces (parameter groups cut as ZeRO-1/2 cuts them, or parameters as ZeRO-3 does), an
    old and a new world size, and who holds each old partition."""
    numels = draw(st.lists(st.integers(1, 200), min_size=1, max_size=5))
    old_world, new_world = draw(st.integers(1, 9)), draw(st.integers(1, 9))
    holders = [
        draw(st.lists(st.integers(0, new_world - 1), min_size=1, max_size=2, unique=True)) for _ in range(old_world)
    ]
    of = draw(st.sampled_from([Cut.of, Cut.of_parameters]))
    return numels, of(numels, old_world), of(numels, new_world), holders


@given(resizes())
@settings(max_examples=300, deadline=None)
def test_the_transfers_tile_every_new_partition_once_each_from_a_holder_of_its_old_one(resize):
    numels, old, new, holders = resize
    plan = plan_transfers(numels, old, new, holders)
    assert all(plan.sources[r] in holders[r] for r in range(old.world))
    received, sent = Counter(), Counter()
    for group, numel in enumerate(numels):
        # Every value of the group, padding excluded, lands once, where the new cut puts it,
        # from where the old cut had it.
        landed = []
        for t in (t for t in plan.transfers if t.piece == group):
            assert t.src == plan.sources[t.old_rank] and t.length > 0
            assert 0 <= t.src_offset and t.src_offset + t.length <= old.sizes[group]
            assert 0 <= t.dst_offset and t.dst_offset + t.length <= new.sizes[group]
            values = range(
                t.old_rank * old.sizes[group] + t.src_offset, t.old_rank * old.sizes[group] + t.src_offset + t.length
            )
            assert values == range(
                t.dst * new.sizes[group] + t.dst_offset, t.dst * new.sizes[group] + t.dst_offset + t.length
            )
            landed += values
            if t.src != t.dst:
                received[t.dst] += t.length
                sent[t.src] += t.length
        assert sorted(landed) == list(range(numel))
    # What moves per rank: at most its new partition in, at most the old partitions it sends from out.
    for rank in range(new.world):
        assert received[rank] <= sum(new.sizes)
        sourced = [r for r in range(old.world) if plan.sources[r] == rank]
        assert sent[rank] <= len(sourced) * sum(old.sizes)


@given(resizes(), st.data())
@settings(max_examples=300, deadline=None)
def test_each_rank_s_plan_is_the_whole_plan_s_transfers_it_sends_or_receives_numbered_alike(resize, data):
    numels, old, new, holders = resize
    # Pieces of one size and cut, as a model's parameters mostly are, are counted once per kind.
    repeats = data.draw(st.lists(st.integers(0, len(numels) - 1), max_size=4))
    numels = [*numels, *(numels[p] for p in repeats)]
    old, new = (Cut(cut.world, (*cut.sizes, *(cut.sizes[p] for p in repeats))) for cut in (old, new))
    whole = plan_transfers(numels, old, new, holders)
    tags = dict(zip(whole.transfers, whole.tags()))
    ranks = [plan_transfers(numels, old, new, holders, rank) for rank in range(new.world)]
    for rank, plan in enumerate(ranks):
        assert plan.sources == whole.sources
        assert plan.transfers == tuple(t for t in whole.transfers if rank in (t.src, t.dst))
        # Sender and receiver tag each message as the whole plan numbers it between them.
        assert all(tags[t] == tag for t, tag in zip(plan.transfers, plan.tags()))
    assert {t for plan in ranks for t in plan.transfers} == set(whole.transfers)
    # Each old partition's source as chosen with every piece counted on its own: the holder that
    # would send the fewest values in all, then the one that keeps most of the partition.
    sending, sources = Counter(), {}
    for old_rank in sorted(range(old.world), key=lambda r: (len(set(holders[r])), r)):
        away = {}
        for holder in set(holders[old_rank]):
            spans = [(old.span(p, old_rank, n), new.span(p, holder, n)) for p, n in enumerate(numels)]
            away[holder] = sum(e - s - max(0, min(e, ne) - max(s, ns)) for (s, e), (ns, ne) in spans)
        sources[old_rank] = min(away, key=lambda h: (sending[h] + away[h], away[h], h))
        sending[sources[old_rank]] += away[sources[old_rank]]
    assert whole.sources == tuple(sources[r] for r in range(old.world))


@st.composite
def zero3_resizes(draw):
    """Parameters in sub-groups as ZeRO-3 lays them out at an old and a new world size (the
    sub-groups may differ: DeepSpeed cuts them by partition size), and who holds each old partition."""
    numels = draw(st.lists(st.integers(1, 60), min_size=1, max_size=6))
    old_world, new_world = draw(st.integers(1, 6)), draw(st.integers(1, 6))
    holders = [
        draw(st.lists(st.integers(0, new_world - 1), min_size=1, max_size=2, unique=True)) for _ in range(old_world)
    ]

    def pieces(world: int) -> Pieces:
        sizes = Cut.of_parameters(numels, world).sizes
        ends = sorted(
            draw(st.sets(st.integers(1, len(numels) - 1), max_size=len(numels) - 1)) if len(numels) > 1 else []
        )
        bounds = [0, *ends, len(numels)]
        return Pieces(tuple(sizes[a:b] for a, b in zip(bounds, bounds[1:])))

    return numels, pieces(old_world), old_world, pieces(new_world), new_world, holders


@given(zero3_resizes())
@settings(max_examples=200, deadline=None)
def test_a_zero3_partition_is_assembled_parameter_by_parameter_wherever_each_sits_in_its_sub_group(resize):
    # What peer_state.load_partitions does, in lists: each old rank's partition holds, per
    # sub-group, its share of each parameter end to end (a value is (parameter, index), the
    # padding None); the new ranks' partitions assembled from the plan are their shares, and
    # the padding is left as it was (zeros there).
    numels, old, old_world, new, new_world, holders = resize

    def partitions(pieces: Pieces, world: int) -> list[list[list]]:
        cut = pieces.cut(world)
        held = [[[None] * size for size in pieces.partitions] for _ in range(world)]
        for piece, ((group, offset), size, numel) in enumerate(zip(pieces.places(), cut.sizes, numels)):
            for rank in range(world):
                for i in range(size):
                    value = rank * size + i
                    held[rank][group][offset + i] = (piece, value) if value < numel else None
        return held

    before, want = partitions(old, old_world), partitions(new, new_world)
    after = [[[None] * size for size in new.partitions] for _ in range(new_world)]
    plan = plan_transfers(numels, old.cut(old_world), new.cut(new_world), holders)
    for t in plan.transfers:
        src_group, src_at = old.places()[t.piece]
        dst_group, dst_at = new.places()[t.piece]
        start, end = src_at + t.src_offset, dst_at + t.dst_offset
        values = before[t.old_rank][src_group][start : start + t.length]
        after[t.dst][dst_group][end : end + t.length] = values
    assert after == want


def test_a_partition_lost_with_its_mirror_needs_a_checkpoint():
    # Old ranks 1 and 2 died together: 1's own copy and its mirror (held by 2) are gone.
    with pytest.raises(RedundancyLost, match=r"partitions \[1\] .* only a checkpoint"):
        plan_repartition([held((0, {7}), (2, {7}))])
    with pytest.raises(RedundancyLost, match="holds any partition"):
        plan_repartition([None, None])


def test_a_ring_keeps_each_partitions_mirror_off_its_node():
    # Ranks each on a node of their own keep their order; GPU nodes of several workers (Ray
    # Train numbers a node's workers one after the other) interleave.
    assert mirror_ring(["a", "b", "c", "d"]) == (0, 1, 2, 3)
    assert mirror_ring(["a", "a", "b", "b"]) == (0, 2, 1, 3)
    assert mirror_ring(["a"] * 4 + ["b"] * 4) == (0, 4, 1, 5, 2, 6, 3, 7)
    # After a node of four lost two ranks, and where one node holds most ranks: as few
    # neighbours on one node as can be.
    assert mirror_ring(["a", "a", "b", "b", "b", "b"]) == (2, 0, 3, 1, 4, 5)


def shared_neighbours(nodes, ring) -> int:
    return sum(nodes[ring[i]] == nodes[ring[(i + 1) % len(ring)]] for i in range(len(ring)))


def test_a_ring_shares_a_node_between_neighbours_only_where_one_node_holds_more_than_half():
    # Every way to put up to 7 ranks on up to 4 nodes.
    for world in range(1, 8):
        for nodes in itertools.product("abcd", repeat=world):
            ring = mirror_ring(nodes)
            assert sorted(ring) == list(range(world)), nodes
            largest, n_nodes = max(Counter(nodes).values()), len(set(nodes))
            fewest = world if n_nodes == 1 else max(0, 2 * largest - world)
            assert shared_neighbours(nodes, ring) == fewest, (nodes, ring)
