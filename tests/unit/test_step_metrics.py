"""A metrics window closes on the host alone (no collective, no device sync) and windows are
resolved together when a report goes out: each keeps its own steps, loss and timings."""

import os
import time

import pytest
import torch

from tests.helpers.ranks import spawned_pair
from wildtrain.train.step import StepMetrics


def _steps(window: StepMetrics, losses: list[float]) -> None:
    for loss in losses:
        with window.timed("forward"):
            pass
        window.add_loss(torch.tensor(loss))
        window.end_step()


def test_windows_closed_at_log_steps_resolve_later_to_their_own_figures():
    window = StepMetrics(tokens_per_step=100, flops_per_token=1.0, peak=None, world_size=1, device=torch.device("cpu"))
    _steps(window, [4.0, 2.0])
    first = window.close(step=2, lr=0.1)
    _steps(window, [1.0])
    with window.timed("report_wait"):
        time.sleep(0.01)
    second = window.close(step=3, lr=0.2)
    assert torch.is_tensor(first.loss)  # not read yet: reading it on a GPU would wait for the device
    resolved = window.resolve([first, second])
    assert [(m["step"], m["lr"], m["loss"]) for m in resolved] == [(2, 0.1, 3.0), (3, 0.2, 1.0)]
    assert resolved[0]["time/report_wait_s"] == 0.0
    assert resolved[1]["time/report_wait_s"] >= 0.01  # one step in the window: the whole wait
    assert resolved[0]["at"] <= resolved[1]["at"]
    assert window.resolve([]) == []


def test_flush_is_a_window_closed_and_resolved_at_once():
    window = StepMetrics(tokens_per_step=100, flops_per_token=1.0, peak=None, world_size=1, device=torch.device("cpu"))
    _steps(window, [3.0, 5.0])
    metrics = window.flush(step=2)
    assert metrics["loss"] == 4.0 and metrics["step"] == 2
    assert metrics["tokens_per_s"] == pytest.approx(200 / (2 * metrics["step_time_s"]))
    assert window.busy_s == pytest.approx(metrics["time/forward_s"] * 2)


def _settling_rank(rank: int, results) -> None:
    window = StepMetrics(tokens_per_step=100, flops_per_token=1.0, peak=None, world_size=2, device=torch.device("cpu"))
    _steps(window, [1.0 + rank, 3.0 + rank])  # rank 0: mean 2, rank 1: mean 3
    window.settle()
    if rank == 1:
        os._exit(0)  # a member dies right after the step committed
    # The peer is gone: closing, judging and resolving the committed window needs no collective.
    closed = window.close(step=2)
    results.put((closed.settled, closed.loss.item(), window.resolve([closed])[0]["loss"]))


def test_a_settled_window_resolves_to_the_loss_over_ranks_without_its_peers():
    """elastic.in_process: a step commits with its window's loss settled over the ranks, so a
    member that dies after the commit takes no logged loss with it."""
    with spawned_pair(_settling_rank) as results:
        settled, loss, resolved = results.get(timeout=60)
    assert settled and loss == resolved == 2.5
