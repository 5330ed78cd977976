"""A worker's membership of its group's generations (`elastic.in_process.Member`), two
processes and the driver's rendezvous (`elastic.rendezvous.RendezvousServer`): a member that
dies is lost and the survivor forms the next generation alone; a worker started later joins
it; a rank's own error is nobody's death, and ends both as without in-process recovery; a
joiner that dies while the groups form is given up for the next generation."""

from __future__ import annotations

import pytest

from tests.helpers.ranks import start_ranks
from wildtrain import services
from wildtrain.elastic.rendezvous import RendezvousServer

DEAD_AFTER_S, CONFIRM_S = 10.0, 0.5


@pytest.fixture
def rendezvous():
    server = RendezvousServer(services.HOST, DEAD_AFTER_S, CONFIRM_S)
    yield server
    server.stop()


def run_drill(rendezvous: RendezvousServer, drill: str, processes: int = 2) -> dict[int, list[str]]:
    """What each rank of tests/helpers/member_rank.py printed, its lines (not DeepSpeed's
    bracketed log lines) and its errors."""
    ranks = start_ranks("tests.helpers.member_rank", processes, "--rendezvous-port", rendezvous.port, "--drill", drill)
    return {rank: [line for line in output.splitlines() if not line.startswith("[")] + [f"(stderr: {errors[-2000:]})"]
            for rank, (_, output, errors) in enumerate(ranks.outputs(timeout_s=120))}


def test_a_member_that_dies_is_lost_and_the_survivor_forms_the_next_generation_alone(rendezvous):
    said = run_drill(rendezvous, "dies")
    assert said[1][0] == "formed 1 w0,w1", said[1]
    assert said[0][:4] == ["formed 1 w0,w1", "lost True", "formed 2 w0", "all-reduced"], said[0]


def test_a_rank_s_own_error_is_no_lost_member_and_ends_its_peer_with_its_reason(rendezvous):
    said = run_drill(rendezvous, "fails")
    assert said[1][:3] == ["formed 1 w0,w1", "lost False", "ended RuntimeError rank 1's own error"], said[1]
    assert said[0][0] == "formed 1 w0,w1" and said[0][1] == "lost False", said[0]
    assert said[0][2].startswith("ended PeerFailed") and "rank 1's own error" in said[0][2], said[0]


def test_a_worker_that_asks_to_join_is_taken_in_by_the_survivor_at_its_next_look(rendezvous):
    said = run_drill(rendezvous, "joins", processes=3)
    assert said[0][:7] == ["formed 1 w0,w1", "lost True", "formed 2 w0", "all-reduced", "joiners waiting",
                           "formed 3 w0,w1.1", "all-reduced 2"], (said[0], said[2])
    assert said[2][:2] == ["formed 3 w0,w1.1", "all-reduced 2"], said[2]


def test_a_joiner_that_dies_after_it_arrived_is_given_up_while_the_groups_form(rendezvous):
    # Without the formation's watch, rank 0 waited in the groups' rendezvous for the groups'
    # timeout (60 s here, 300 s by default) and then failed.
    said = run_drill(rendezvous, "ghost", processes=3)
    assert said[2][0] == "arrived 3", said[2]
    assert said[0][:8] == ["formed 1 w0,w1", "lost True", "formed 2 w0", "all-reduced", "joiners waiting",
                           "superseded True", "formed 4 w0", "all-reduced 1"], (said[0], said[2])
