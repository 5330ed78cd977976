"""A worker's membership of its group's generations (`elastic.in_process.Member`), two
processes and the driver's rendezvous (`elastic.rendezvous.RendezvousServer`): a member that
dies is lost and the survivor forms the next generation alone; a worker started later joins
it; a rank's own error is nobody's death, and ends both as without in-process recovery; a
joiner that dies while the groups form is given up for the next generation; a member that
hangs is found silent and frees the survivor's wait."""

from __future__ import annotations

import pytest

from tests.helpers.ranks import check_said, member_drill
from wildtrain import services
from wildtrain.elastic.rendezvous import RendezvousServer

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
