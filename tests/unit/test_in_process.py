"""A worker's membership of its group's generations (`elastic.in_process.Member`), two
processes and the driver's rendezvous (`elastic.rendezvous.RendezvousServer`): a member that
dies is lost and the survivor forms the next generation alone; a worker started later joins
it; a rank's own error is nobody's death, and ends both as without in-process recovery; a
joiner that dies while the groups form is given up for the next generation; a member that
hangs is found silent and frees the survivor's wait."""

from __future__ import annotations

import threading
import time

import pytest

from tests.helpers.ranks import check_said, member_drill
from wildtrain import services
from wildtrain.config.system import ElasticConfig
from wildtrain.elastic.rendezvous import RendezvousFailed, RendezvousServer
from wildtrain.train.in_process import Member

DEAD_AFTER_S, CONFIRM_S = 10.0, 0.5


@pytest.fixture
def rendezvous():
    server = RendezvousServer(services.HOST, DEAD_AFTER_S, CONFIRM_S)
    yield server
    server.stop()


def test_a_member_that_dies_is_lost_and_the_survivor_forms_the_next_generation_alone(rendezvous):
    said, _ = member_drill(rendezvous, "dies")
    check_said(said, "dies")


def test_a_rank_s_own_error_is_no_lost_member_and_ends_its_peer_with_its_reason(rendezvous):
    said, _ = member_drill(rendezvous, "fails")
    check_said(said, "fails")
    assert said[0][3].startswith("ended PeerFailed") and "rank 1's own error" in said[0][3], said[0]


def test_a_worker_that_asks_to_join_is_taken_in_by_the_survivor_at_its_next_look(rendezvous):
    said, _ = member_drill(rendezvous, "joins", processes=3)
    check_said(said, "joins")


def test_a_hung_member_frees_the_survivor_s_wait_once_it_is_found_silent(rendezvous):
    # Nothing fails when a member hangs: without the loss watch, rank 0 waited in its
    # all-reduce for the collective's timeout (60 s here, 300 s by default).
    said, times = member_drill(rendezvous, "hangs")
    check_said(said, "hangs")
    # Silent from its last beat, up to a beat before it stopped.
    assert DEAD_AFTER_S - 0.5 <= times[0]["waited"] < DEAD_AFTER_S + 10, times


def test_a_joiner_that_dies_after_it_arrived_is_given_up_while_the_groups_form(rendezvous):
    # Without the formation's watch, rank 0 waited in the groups' rendezvous for the groups'
    # timeout (60 s here, 300 s by default) and then failed.
    said, _ = member_drill(rendezvous, "ghost", processes=3)
    check_said(said, "ghost")


def members_of_one_group(server: RendezvousServer, control_timeout_s: float = 60.0, ranks: int = 2) -> list[Member]:
    """The first `ranks` of Ray's two workers, as they make their members (no process group: their
    waits are the store's)."""
    cfg = ElasticConfig(heartbeat_s=0.05, dead_after_s=DEAD_AFTER_S, confirm_s=CONFIRM_S)
    address = (services.HOST, server.port)
    return [
        Member(address, "group-a", f"w{rank}", 2, f"node-{rank}", cfg, "gloo", control_timeout_s, registers=rank == 0)
        for rank in range(ranks)
    ]


def waits(member: Member, within_s: float) -> BaseException | None:
    """What `member`'s wait for its next generation raised within `within_s` (a wait longer than
    that fails the test: it is the hang)."""
    raised: list[BaseException] = []

    def wait() -> None:
        try:
            member._next_generation()
        except BaseException as e:  # noqa: BLE001 - the test reads it
            raised.append(e)

    waiting = threading.Thread(target=wait, daemon=True)
    started = time.monotonic()
    waiting.start()
    waiting.join(within_s)
    assert not waiting.is_alive(), f"{member.name} still waits for a generation after {within_s:g} s"
    assert time.monotonic() - started <= within_s
    return raised[0] if raised else None


def test_members_waiting_for_a_generation_fall_back_to_a_restart_when_the_owner_fails(rendezvous, monkeypatch):
    members = members_of_one_group(rendezvous)
    try:
        for member in members:
            member.membership = member._next_generation()
        assert members[0].membership.members == ("w0", "w1")

        def broken(now: float, ending: bool = False):
            raise RuntimeError("a joiner's entry never came")

        monkeypatch.setattr(rendezvous.owner, "turn", broken)
        for member in members:  # as survivors whose collective failed, waiting for the owner's verdict
            error = waits(member, within_s=2.0)
            assert isinstance(error, RendezvousFailed), repr(error)
            assert "a joiner's entry never came" in str(error)
    finally:
        for member in members:
            member.heartbeat.stop()


def test_a_member_waits_for_its_generation_no_longer_than_the_control_timeout(rendezvous):
    # w1 never asks (its process died before it could): the owner never publishes the first generation.
    [member] = members_of_one_group(rendezvous, control_timeout_s=1.0, ranks=1)
    try:
        error = waits(member, within_s=3.0)
        assert isinstance(error, RendezvousFailed), repr(error)
    finally:
        member.heartbeat.stop()
