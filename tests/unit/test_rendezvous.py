"""The in-process group's rendezvous (`elastic.rendezvous`) over a real TCPStore: workers ask and
beat, the owner publishes generations, readers see them. Times are the owner's turns' `now`,
given, not waited for: what a worker writes carries none."""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from tests.helpers.waiting import wait_for
from wildtrain import services
from wildtrain.elastic import rendezvous, rendezvous_keys
from wildtrain.elastic.membership import Membership
from wildtrain.elastic.rendezvous import (
    Heartbeat,
    RendezvousOwner,
    RendezvousServer,
    announce_node,
    announce_start,
    ask_to_join,
    beat,
    current_group,
    latest,
    member_name,
    node_of,
    register_group,
    report_error,
)
from wildtrain.elastic.survivors import KeepSurvivors

DEAD_AFTER_S, CONFIRM_S = 2.0, 0.5


@pytest.fixture
def store():
    return dist.TCPStore(
        services.HOST, services.free_port(), is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10)
    )


def first_generation(store, t: float = 100.0, join_batch_s: float = 0.0) -> RendezvousOwner:
    """w0, w1 and w2's first generation, published at `t`; their beats read at `t`."""
    owner = RendezvousOwner(store, initial=3, dead_after_s=DEAD_AFTER_S, confirm_s=CONFIRM_S, join_batch_s=join_batch_s)
    for name in ("w2", "w0"):
        ask_to_join(store, name)
        beat(store, name)
    assert owner.turn(now=t) is None  # two of three
    assert latest(store) == Membership(0, ())
    ask_to_join(store, "w1")
    beat(store, "w1")
    assert owner.turn(now=t) == Membership(1, ("w0", "w1", "w2"))
    assert latest(store) == Membership(1, ("w0", "w1", "w2")) and set(owner.asked) == {"w0", "w1", "w2"}
    return owner


def test_the_first_generation_waits_for_every_initial_worker_and_ranks_them_by_name(store):
    first_generation(store)


def test_the_first_generation_ranks_its_workers_in_ray_s_rank_order_past_ten(store):
    """The controller reads the lowest surviving Ray rank's report first, so that worker must
    be the generation's rank 0 (which reports every rank's metrics): w2 before w10."""
    owner = RendezvousOwner(store, initial=12, dead_after_s=DEAD_AFTER_S, confirm_s=CONFIRM_S)
    for rank in reversed(range(12)):
        ask_to_join(store, member_name(rank))
        beat(store, member_name(rank))
    assert owner.turn(now=100.0) == Membership(1, tuple(member_name(rank) for rank in range(12)))


def test_a_silent_member_is_dropped_after_dead_after_s_and_the_survivors_keep_their_ranks(store):
    owner = first_generation(store)
    for name in ("w1", "w2"):
        beat(store, name)
    assert owner.turn(now=101.9) is None  # w0 silent for 1.9 s: not yet
    assert owner.turn(now=102.1) == Membership(2, ("w1", "w2"))
    assert latest(store) == Membership(2, ("w1", "w2")) and owner.published[2][1] == ("w1", "w2")


def test_after_a_failed_collective_the_member_that_stopped_beating_is_dropped_within_confirm_s(store):
    owner = first_generation(store)
    report_error(store, 1)
    assert owner.turn(now=100.5) is None  # the error read at 100.5
    beats(store, "w0", "w2")  # still beating after the error: alive
    assert owner.turn(now=100.9) is None  # 0.4 s since the error: not confirmed
    beats(store, "w0", "w2")
    assert owner.turn(now=101.1) == Membership(2, ("w0", "w2"))  # long before dead_after_s


def joined(store) -> RendezvousOwner:
    """The first generation's owner once w9 asked to join at 100.5 and generation 2 took it in."""
    owner = first_generation(store)
    for name in ("w0", "w1", "w2"):
        beat(store, name)
    ask_to_join(store, "w9")
    assert owner.turn(now=100.5) == Membership(2, ("w0", "w1", "w2", "w9"))
    return owner


def test_a_joiner_is_added_after_the_members(store):
    joined(store)


def test_a_member_lost_before_the_others_took_a_joiner_in_is_dropped_within_confirm_s(store):
    # Generation 2 adds w9; w0 and w2 still train in generation 1 (their next log step takes
    # it in) when w1 dies there: their failed collective is generation 1's.
    owner = joined(store)
    report_error(store, 1)
    assert owner.turn(now=100.6) is None  # the error read at 100.6
    beats(store, "w0", "w2", "w9")
    assert owner.turn(now=101.0) is None  # 0.4 s since the error: not confirmed
    beats(store, "w0", "w2", "w9")
    assert owner.turn(now=101.2) == Membership(3, ("w0", "w2", "w9"))  # long before dead_after_s


def test_an_error_of_a_generation_before_a_shrink_is_not_counted_again(store):
    owner = first_generation(store)
    report_error(store, 1)
    assert owner.turn(now=100.5) is None  # the error read at 100.5
    for name in ("w0", "w2"):
        beat(store, name)
    assert owner.turn(now=101.1) == Membership(2, ("w0", "w2"))
    for name in ("w0", "w2"):
        beat(store, name)
    assert owner.turn(now=102.0) is None, "generation 1's error was generation 2's cause, not a new failure"


JOIN_BATCH_S = 10.0


def beats(store, *names: str) -> None:
    for name in names:
        beat(store, name)


def two_joiners_starting(store) -> RendezvousOwner:
    """Generation 1's owner once w3 and w4 started on returned nodes at 100.0 and w3 asked at 100.5."""
    owner = first_generation(store, join_batch_s=JOIN_BATCH_S)
    for name in ("w3", "w4"):
        announce_start(store, name)
    beats(store, "w0", "w1", "w2", "w3", "w4")
    ask_to_join(store, "w3")
    assert owner.turn(now=100.5) is None, "w4 is getting ready: w3 waits for it"
    return owner


def test_a_joiner_waits_for_one_getting_ready_and_both_join_in_one_generation(store):
    owner = two_joiners_starting(store)
    beats(store, "w0", "w1", "w2", "w3", "w4")
    assert owner.turn(now=106.0) is None
    ask_to_join(store, "w4")
    assert owner.turn(now=106.0) == Membership(2, ("w0", "w1", "w2", "w3", "w4"))


def test_a_joiner_waits_no_longer_than_join_batch_s_after_it_asked(store):
    owner = two_joiners_starting(store)
    beats(store, "w0", "w1", "w2", "w3", "w4")
    assert owner.turn(now=110.4) is None
    beats(store, "w0", "w1", "w2", "w3", "w4")
    assert owner.turn(now=110.5) == Membership(2, ("w0", "w1", "w2", "w3"))
    ask_to_join(store, "w4")
    assert owner.turn(now=111.0) == Membership(3, ("w0", "w1", "w2", "w3", "w4")), "the late one joins on its own"


def test_a_joiner_does_not_wait_for_one_that_went_silent_while_getting_ready(store):
    owner = two_joiners_starting(store)  # w4's last beat at 100.5: its node lost again
    beats(store, "w0", "w1", "w2", "w3")
    assert owner.turn(now=102.4) is None
    beats(store, "w0", "w1", "w2", "w3")
    assert owner.turn(now=102.6) == Membership(2, ("w0", "w1", "w2", "w3")), "silent for over dead_after_s"


def test_a_death_while_a_joiner_waits_takes_it_in_with_the_re_form(store):
    owner = two_joiners_starting(store)
    beats(store, "w0", "w2", "w3", "w4")  # w1 silent since 100.5
    assert owner.turn(now=102.6) == Membership(2, ("w0", "w2", "w3")), "the members stop anyway"


def test_at_the_end_of_the_run_nothing_is_published_though_workers_go_silent(store):
    owner = first_generation(store)
    assert owner.turn(now=200.0, ending=True) is None
    assert latest(store).generation == 1


def test_a_heartbeat_beats_from_its_thread_and_the_first_beat_is_in_before_it_returns(store):
    heartbeat = Heartbeat(services.HOST, store.port, "w5", every_s=0.01)
    first = float(store.get(rendezvous_keys.heartbeat("w5")))  # there already: a request read now finds a beat
    wait_for(lambda: float(store.get(rendezvous_keys.heartbeat("w5"))) > first, "a second beat")
    heartbeat.stop()
    last = store.get(rendezvous_keys.heartbeat("w5"))
    assert store.get(rendezvous_keys.heartbeat("w5")) == last  # stopped: the thread has ended, nothing writes any more


def test_a_worker_says_its_node_under_its_rank_s_name(store):
    announce_node(store, member_name(1), "node-a")
    assert node_of(store, "w1") == "node-a"


def test_the_server_starts_each_worker_group_ray_starts_afresh_and_leaves_an_earlier_group_s_keys_alone():
    server = RendezvousServer(services.HOST, DEAD_AFTER_S, CONFIRM_S)
    try:
        client = dist.TCPStore(services.HOST, server.port, is_master=False, timeout=timedelta(seconds=10))
        first = dist.PrefixStore("group-a", client)
        ask_to_join(first, "w1")  # before its rank 0 registered the group: read all the same
        register_group(client, "group-a", 2)
        ask_to_join(first, "w0")
        assert wait_for(lambda: latest(first).generation, "the first group's first generation") == 1
        assert latest(first).members == ("w0", "w1") and latest(current_group(client)) == latest(first)
        # Ray restarted the group: the same names, generations from 1 again.
        second = dist.PrefixStore("group-b", client)
        register_group(client, "group-b", 1)
        ask_to_join(second, "w0")
        assert wait_for(lambda: latest(second).generation, "the second group's first generation") == 1
        assert latest(current_group(client)).members == ("w0",)
        assert latest(first).members == ("w0", "w1")
    finally:
        server.stop()


def test_a_group_whose_every_member_died_leaves_the_server_serving_the_next_group():
    # Ray kills the last member for its restart (or its node dies): that group cannot re-form,
    # and the restarted group's workers must still get their first generation.
    server = RendezvousServer(services.HOST, DEAD_AFTER_S, CONFIRM_S)
    try:
        client = dist.TCPStore(services.HOST, server.port, is_master=False, timeout=timedelta(seconds=10))
        first = dist.PrefixStore("group-a", client)
        register_group(client, "group-a", 1)
        ask_to_join(first, "w0")
        beat(first, "w0")
        assert wait_for(lambda: latest(first).generation, "the first group's first generation") == 1
        wait_for(lambda: server.owner is None, "the server to give up the group whose last member went silent")
        second = dist.PrefixStore("group-b", client)
        register_group(client, "group-b", 1)
        ask_to_join(second, "w0")
        assert wait_for(lambda: latest(second).generation, "the restarted group's first generation") == 1
    finally:
        server.stop()


def test_ray_s_word_that_a_member_died_has_the_owner_drop_it_within_confirm_s_where_no_collective_failed():
    # A death while a generation's groups form fails no collective: only the heartbeat's silence
    # (elastic.dead_after_s, 60 s here) would drop it, unless the controller passes Ray's word on.
    server = RendezvousServer(services.HOST, dead_after_s=60.0, confirm_s=CONFIRM_S)
    alive = None
    try:
        client = dist.TCPStore(services.HOST, server.port, is_master=False, timeout=timedelta(seconds=10))
        group = dist.PrefixStore("group-a", client)
        register_group(client, "group-a", 2)
        alive = Heartbeat(services.HOST, server.port, "w0", every_s=0.1, prefix="group-a")
        ask_to_join(group, "w0")
        ask_to_join(group, "w1")
        beat(group, "w1")
        assert wait_for(lambda: latest(group).generation, "the first generation") == 1
        # Saying who died asks nothing of the joiners.
        controller = KeepSurvivors(services.HOST, server.port, decide_s=1.0, joiners=SimpleNamespace())
        controller.say_members_died(["w1.1"])  # a joiner that never was a member: nothing to say
        assert not group.check([rendezvous_keys.error(1)])
        controller.say_members_died(["w1"])
        newest = wait_for(
            lambda: latest(group).generation == 2 and latest(group), "w1 dropped", timeout_s=5.0, every_s=0.05
        )
        assert newest.members == ("w0",)
    finally:
        if alive is not None:
            alive.stop()
        server.stop()


def whole_group_with_a_spare(store) -> RendezvousOwner:
    """A group of three, whole (capacity 3), beside spare.1, which started on spare capacity
    and asked at 100.0 with the group's workers: it waits, and the members see one spare."""
    owner = RendezvousOwner(store, initial=3, dead_after_s=DEAD_AFTER_S, confirm_s=CONFIRM_S, capacity=3)
    announce_start(store, "spare.1")
    beats(store, "spare.1")
    for name in ("w2", "w0", "w1"):
        ask_to_join(store, name)
        beat(store, name)
    ask_to_join(store, "spare.1")
    assert owner.turn(now=100.0) == Membership(1, ("w0", "w1", "w2")), "a joiner is never in the first generation"
    beats(store, "w0", "w1", "w2", "spare.1")
    assert owner.turn(now=103.0) is None, "the group is whole: the spare waits"
    assert store.get(rendezvous_keys.SPARES) == b"1"
    return owner


def test_a_spare_takes_a_dead_members_place_in_the_re_form_that_drops_it(store):
    owner = whole_group_with_a_spare(store)
    report_error(store, 1)
    assert owner.turn(now=103.5) is None  # the error read at 103.5
    beats(store, "w0", "w2", "spare.1")  # w1 silent since 103.0
    assert owner.turn(now=104.1) == Membership(2, ("w0", "w2", "spare.1"))
    assert store.get(rendezvous_keys.SPARES) == b"0"


def test_a_spare_whose_node_died_takes_no_place(store):
    owner = whole_group_with_a_spare(store)  # spare.1's last beat at 103.0
    report_error(store, 1)  # read at 106.1, when w1 has been silent for over dead_after_s anyway
    beats(store, "w0", "w2")
    assert store.get(rendezvous_keys.SPARES) == b"1"
    assert owner.turn(now=106.1) == Membership(2, ("w0", "w2")), "silent for over dead_after_s: not taken in"
    assert store.get(rendezvous_keys.SPARES) == b"0"


class CountingStore:
    """A store that counts the round trips made through it."""

    def __init__(self, store) -> None:
        self.store, self.calls = store, 0

    def __getattr__(self, name):
        method = getattr(self.store, name)

        def counted(*args, **kwargs):
            self.calls += 1
            return method(*args, **kwargs)

        return counted


@pytest.mark.parametrize("members", [4, 64])
def test_a_turn_reads_every_heartbeat_in_one_round_trip_whatever_the_members(store, members):
    """The owner turns every 10 ms: a turn whose round trips grew with the members fell behind
    at a thousand of them (issue 60)."""
    counting = CountingStore(store)
    owner = RendezvousOwner(counting, initial=members, dead_after_s=DEAD_AFTER_S, confirm_s=CONFIRM_S)
    names = [member_name(rank) for rank in range(members)]
    for name in names:
        ask_to_join(store, name)
        beat(store, name)
    assert owner.turn(now=100.0) == Membership(1, tuple(names))
    for name in names[1:]:
        beat(store, name)
    counting.calls = 0
    assert owner.turn(now=101.0) is None
    assert counting.calls == 4  # the starts and joins counters, the error key, every heartbeat at once
    report_error(store, 1)
    assert owner.turn(now=101.1) is None  # the error read at 101.1
    for name in names[1:]:
        beat(store, name)
    assert owner.turn(now=101.7) == Membership(2, tuple(names[1:]))


def test_a_joiner_that_has_not_beaten_yet_counts_from_its_request_and_is_read_once_it_beats(store):
    owner = first_generation(store)
    ask_to_join(store, "j1")
    assert owner.turn(now=101.0) == Membership(2, ("w0", "w1", "w2", "j1"))  # no beat yet: alive since asking
    for name in ("w0", "w1", "w2", "j1"):
        beat(store, name)
    assert owner.turn(now=103.1) is None  # j1's first beat is read, not its request's time
    for name in ("w0", "w1", "w2"):
        beat(store, name)
    assert owner.turn(now=105.2) == Membership(3, ("w0", "w1", "w2"))


def test_a_read_of_more_keys_than_a_batch_takes_is_split_and_keeps_their_order(store, monkeypatch):
    monkeypatch.setattr(rendezvous, "READ_BATCH", 16)
    counting = CountingStore(store)
    keys = [f"k{i}" for i in range(40)]
    store.multi_set(keys, [str(i) for i in range(40)])
    assert rendezvous.read_all(counting, keys) == [str(i).encode() for i in range(40)]
    assert counting.calls == 3


class MemberClock:
    """The time source a member's calls into `rendezvous` read: `skew_s` off the owner's `now`."""

    def __init__(self, now: float, skew_s: float) -> None:
        self.now, self.skew_s = now, skew_s

    def time(self) -> float:
        return self.now + self.skew_s


def as_member(monkeypatch, now: float, skew_s: float, call) -> None:
    """`call()` made by a member whose clock reads `now + skew_s` where the owner's reads `now`."""
    monkeypatch.setattr(rendezvous, "time", MemberClock(now, skew_s))
    call()
    monkeypatch.undo()


@pytest.mark.parametrize("skew_s", [-5.0, 5.0], ids=["behind", "ahead"])
def test_a_member_whose_clock_is_off_by_seconds_is_judged_on_the_owner_s_clock_alone(store, monkeypatch, skew_s):
    """w0's clock is `skew_s` off the owner's: beating, it must not be found dead (behind: its
    beats looked older than dead_after_s), and the collective it says failed when w1 died must
    drop w1 within confirm_s (ahead: its error looked newer than every beat)."""
    owner = RendezvousOwner(store, initial=3, dead_after_s=DEAD_AFTER_S, confirm_s=CONFIRM_S)
    skews = {"w0": skew_s, "w1": 0.0, "w2": 0.0}
    for name, skew in skews.items():
        as_member(monkeypatch, 100.0, skew, lambda name=name: (ask_to_join(store, name), beat(store, name)))
    assert owner.turn(now=100.0) == Membership(1, ("w0", "w1", "w2"))
    now, published = 100.0, None
    for tick in range(1, 60):  # a beat every 0.1 s for 5.9 s
        now = 100.0 + tick / 10
        alive = ("w0", "w2") if tick >= 30 else ("w0", "w1", "w2")  # w1 dies at 103.0
        if tick == 30:
            as_member(monkeypatch, now, skew_s, lambda: report_error(store, 1))  # w0's collective with w1 failed
        for name in alive:
            as_member(monkeypatch, now, skews[name], lambda name=name: beat(store, name))
        published = owner.turn(now=now)
        if published is not None:
            break
    assert published == Membership(2, ("w0", "w2")), f"at {now:.1f}: {published}"
    assert 103.0 + CONFIRM_S <= now <= 103.0 + CONFIRM_S + 0.3, f"w1 dropped at {now:.1f}, its death at 103.0"


def test_an_error_inside_the_owner_is_published_to_its_group_and_the_server_serves_the_next_group(monkeypatch):
    server = RendezvousServer(services.HOST, DEAD_AFTER_S, CONFIRM_S)
    try:
        client = dist.TCPStore(services.HOST, server.port, is_master=False, timeout=timedelta(seconds=10))
        first = dist.PrefixStore("group-a", client)
        register_group(client, "group-a", 1)
        ask_to_join(first, "w0")
        assert wait_for(lambda: latest(first).generation, "the first group's first generation") == 1

        def broken(now: float, ending: bool = False):
            raise RuntimeError("the store misbehaved")

        monkeypatch.setattr(server.owner, "turn", broken)
        failure = wait_for(lambda: rendezvous.owner_failure(first), "the owner's failure", timeout_s=2.0)
        assert "the store misbehaved" in failure
        second = dist.PrefixStore("group-b", client)
        register_group(client, "group-b", 1)
        ask_to_join(second, "w0")
        assert wait_for(lambda: latest(second).generation, "the restarted group's first generation") == 1
        assert rendezvous.owner_failure(second) is None
    finally:
        server.stop()
