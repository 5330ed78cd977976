"""A rank-local error ends the attempt on every rank within seconds (`collectives.failing_together`),
on gloo, in real processes: one rank raises mid-step while the other waits in a collective
for it, as a CUDA OOM or a corrupt shard on one rank leaves its peers."""

from __future__ import annotations

import datetime
import multiprocessing
import queue
import socket
import time
import traceback

import pytest
import torch
import torch.distributed as dist

from wildtrain.elastic.signals import PeerFailed, PlannedRegrow
from wildtrain.train import collectives

ATTEMPT_ENDS_WITHIN_S = 10.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, failing: str, results) -> None:
    # The default group's own timeout is Ray's 1800 s: without the fail-fast, the waiting
    # rank would sit in its all-reduce that long.
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=1800)
    )
    collectives.open_control_group(1800)
    started = time.monotonic()
    try:
        with collectives.failing_together(rank, together=(PlannedRegrow,)):
            gradients = torch.ones(1024)
            collectives.sum_(gradients)  # a step both ranks finish
            if rank == 1:
                time.sleep(0.5)  # the peer is in its collective by now
                raise {
                    "error": RuntimeError("CUDA out of memory (drill)"),
                    "regrow": PlannedRegrow("room for more workers"),
                }[failing]
            collectives.sum_(gradients)  # waits for rank 1, which never comes
            collectives.all_ranks(True)
        results.put((rank, "finished", "", time.monotonic() - started))
    except BaseException as e:  # noqa: BLE001
        results.put((rank, type(e).__name__, str(e) + traceback.format_exc()[-300:], time.monotonic() - started))
    # A Ray worker outlives its training function's exception: its sockets stay open, so its
    # peers learn nothing from a closed connection.
    time.sleep(120)


def _run(failing: str, timeout_s: float) -> dict:
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    ranks = [ctx.Process(target=_rank, args=(rank, port, failing, results), daemon=True) for rank in (0, 1)]
    for p in ranks:
        p.start()
    outcomes = {}
    try:
        for _ in ranks:
            rank, kind, text, seconds = results.get(timeout=timeout_s)
            outcomes[rank] = (kind, text, seconds)
    finally:
        for p in ranks:
            p.kill()
            p.join()
    return outcomes


def test_a_rank_that_raises_takes_its_peer_out_of_its_collective_within_seconds():
    outcomes = _run("error", timeout_s=60)
    kind, text, _ = outcomes[1]
    assert kind == "RuntimeError" and "CUDA out of memory" in text
    kind, text, seconds = outcomes[0]
    assert kind == "PeerFailed", text
    assert "rank 0 stopped because another rank failed: rank 1: RuntimeError: CUDA out of memory (drill)" in text
    assert seconds < ATTEMPT_ENDS_WITHIN_S, f"the peer took {seconds:.1f} s to stop"


def test_an_exception_every_rank_raises_together_tells_no_one():
    # A planned regrow is raised by every rank at the same step; here only rank 1 raises it,
    # so rank 0 waits on in its collective: nobody aborted it. (Also the control for the
    # test above: without the signal, nothing else would have ended rank 0's wait.)
    with pytest.raises(queue.Empty):
        _run("regrow", timeout_s=6)


def test_without_a_process_group_the_watch_is_inert():
    with collectives.failing_together(0) as watch:
        pass
    assert watch.peer_failure is None
    with pytest.raises(ValueError):
        with collectives.failing_together(0):
            raise ValueError("a rank of one has no peers to tell")


def test_peer_failed_says_whose_error_stopped_the_rank():
    assert "rank 3 stopped because another rank failed: rank 0: boom" in str(PeerFailed(3, "rank 0: boom"))


# The default group's timeout is short, as elastic.collective_timeout_s makes it in a run;
# rank 0 takes longer than that before it answers, as when it converts a checkpoint to the
# universal format while the others wait for the result.
SHORT_TIMEOUT_S = 5


def _long_wait(rank: int, port: int, over: str, results) -> None:
    try:
        # The rendezvous waits long: on a loaded machine a spawned rank comes up seconds after
        # its peer (a 2 s store timeout failed there before any collective ran). Both leave
        # the store's start together, so the group's own start fits its short timeout.
        store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=120))
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=SHORT_TIMEOUT_S)
        )
        if over == "control":
            collectives.open_control_group(60)
    except BaseException as e:  # noqa: BLE001
        results.put((rank, "not started", f"{type(e).__name__}: {str(e)[:200]}"))
        return
    try:
        if rank == 0:
            time.sleep(2 * SHORT_TIMEOUT_S)
        results.put((rank, "ok", collectives.broadcast_object("converted" if rank == 0 else None)))
    except BaseException as e:  # noqa: BLE001
        results.put((rank, type(e).__name__, str(e)[:200]))
    time.sleep(30)


@pytest.mark.parametrize("over, outlasts", [("control", True), ("default", False)])
def test_a_long_wait_for_one_rank_outlasts_the_collective_timeout_only_over_the_control_group(over, outlasts):
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    ranks = [ctx.Process(target=_long_wait, args=(rank, port, over, results), daemon=True) for rank in (0, 1)]
    for p in ranks:
        p.start()
    try:
        outcomes = dict((rank, rest) for rank, *rest in (results.get(timeout=180) for _ in ranks))
    finally:
        for p in ranks:
            p.kill()
            p.join()
    assert all(kind != "not started" for kind, _ in outcomes.values()), outcomes
    waiting = outcomes[1]
    if outlasts:
        assert waiting == ["ok", "converted"], waiting
    else:  # the control: the same wait over the default group times out
        assert waiting[0] == "RuntimeError" and "Timed out waiting" in waiting[1], waiting


def test_a_failure_aborts_every_group_of_the_rank_deepspeeds_own_too(monkeypatch):
    # gloo's abort frees no wait (its peers are freed by the failed rank's exit), so what is
    # checked is that each group is aborted: on NCCL that is what frees its collectives.
    aborted = []
    monkeypatch.setattr(dist.ProcessGroup, "abort", lambda group: aborted.append(group))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        collectives.open_control_group(60)
        gradients = dist.new_group(ranks=[0])  # as DeepSpeed's clone of the world group
        collectives.abort_groups()
        assert {id(g) for g in aborted} == {id(dist.group.WORLD), id(collectives.control_group()), id(gradients)}
    finally:
        dist.destroy_process_group()
