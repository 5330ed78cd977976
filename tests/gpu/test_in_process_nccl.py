"""In-process recovery on NCCL (issue 24): tests/helpers/member_rank.py's drills with
`--device cuda`, the ranks sharing the machine's one GPU, each an NCCL host of its own, in
the environment an in-process GPU worker gets (`survivor_env.SURVIVOR_ENV`). A survivor
whose NCCL all-reduce waits for a dead or hung member is freed (its communicators aborted)
and forms the next generation's NCCL group in the same process; a joiner forms one with it.
The same drills on gloo are tests/unit/test_in_process.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.member_rank import SAYS
from tests.helpers.ranks import NCCL_ON_ONE_GPU, check_said, member_drill
from wildtrain import services
from wildtrain.elastic.rendezvous import RendezvousServer

pytestmark = pytest.mark.gpu

DEAD_AFTER_S, CONFIRM_S = 10.0, 0.5
ENV = NCCL_ON_ONE_GPU | {"TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "3"}
# A survivor steps again this long after it re-formed: past the 3 s after which a heartbeat
# monitor that took the peer's death for a hang would end it (SURVIVOR_ENV says why one could).
LINGER_S = 10


@pytest.fixture
def rendezvous():
    server = RendezvousServer(services.HOST, DEAD_AFTER_S, CONFIRM_S)
    yield server
    server.stop()


def nccl_drill(
    rendezvous: RendezvousServer, name: str, logs: Path, processes: int = 2, timeout_s: float = 60, *args: str
):
    """member_drill on the GPU; NCCL's own account of it printed after it (NCCL_DEBUG=INFO:
    the transport it chose, its errors, where it stopped), for the GPU run's record (-rA)."""
    logs.mkdir()
    said, times = member_drill(
        rendezvous,
        name,
        processes,
        "--device",
        "cuda",
        *args,
        timeout_s=timeout_s,
        env=ENV | {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_FILE": str(logs / "rank.%p.log")},
    )
    print(f"{name}: rank 0's failed all-reduce {times[0]}")
    for log in sorted(logs.iterdir()):
        print(f"--- {log.name}\n{log.read_text()[-3000:]}")
    return said, times


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> dict[int, list[str]]:
    """What two ranks of one NCCL group on the GPU said after one all-reduce (the `pair` drill)."""
    server = RendezvousServer(services.HOST, DEAD_AFTER_S, CONFIRM_S)
    try:
        return nccl_drill(server, "pair", tmp_path_factory.mktemp("pair") / "nccl", timeout_s=30)[0]
    finally:
        server.stop()


def drill(
    rendezvous: RendezvousServer, pair: dict[int, list[str]], tmp_path: Path, name: str, processes: int = 2, *args: str
):
    if pair[0][:1] != SAYS["pair"][0]:
        pytest.skip("two NCCL ranks on the GPU did not all-reduce (test_two_nccl_ranks_share_the_gpu)")
    return nccl_drill(rendezvous, name, tmp_path / "nccl", processes, 60, *args)


def test_two_nccl_ranks_share_the_gpu(pair):
    check_said(pair, "pair")


def test_a_member_that_dies_is_lost_and_the_survivor_forms_an_nccl_group_alone(rendezvous, pair, tmp_path):
    said, times = drill(rendezvous, pair, tmp_path, "dies", 2, "--linger-s", LINGER_S)
    check_said(said, "dies")
    assert times[0]["waited"] < DEAD_AFTER_S, "the death was seen, not waited out"
    assert said[0][len(SAYS["dies"][0])] == "all-reduced 1", ("the survivor stepped again later", said[0])


def test_a_hung_member_s_nccl_wait_is_freed_once_it_is_found_silent(rendezvous, pair, tmp_path):
    said, times = drill(rendezvous, pair, tmp_path, "hangs", 2, "--linger-s", LINGER_S)
    check_said(said, "hangs")
    assert said[0][len(SAYS["hangs"][0])] == "all-reduced 1", ("the survivor stepped again later", said[0])
    # Silent from its last beat, up to a beat before it stopped.
    assert DEAD_AFTER_S - 0.5 <= times[0]["waited"] < DEAD_AFTER_S + 10, times


def test_a_joiner_on_the_gpu_forms_the_next_nccl_group_with_the_survivor(rendezvous, pair, tmp_path):
    said, _ = drill(rendezvous, pair, tmp_path, "joins", processes=3)
    check_said(said, "joins")
