"""The chaos.* drills of an attempt: the pace a step keeps, a slow forward pass, and the failure that fires once
per run."""

from __future__ import annotations

import time

import pytest
import torch

from wildtrain.config import load_config
from wildtrain.train.drills import Drills


def drills(
    tmp_path,
    *overrides,
    rank=0,
    restored_step=0,
    joiner=False,
    slowed=False,
    model=None,
    short_of_members=False,
    spares_waiting=None,
) -> Drills:
    cfg = load_config(["experiment=tiny", f"run.storage={tmp_path}", "run.name=drills", *overrides])
    return Drills(
        cfg,
        rank,
        restored_step,
        joiner=joiner,
        slowed=slowed,
        model=model if model is not None else torch.nn.Identity(),
        short_of_members=short_of_members,
        spares_waiting=spares_waiting,
    )


PACES = ("chaos.min_step_s=0.5", "chaos.short_step_s=2.5")


@pytest.mark.parametrize("short, expected", [(False, 0.5), (True, 2.5)])
def test_a_step_short_of_members_keeps_the_short_pace_and_any_other_the_whole_runs(tmp_path, short, expected):
    assert drills(tmp_path, *PACES, short_of_members=short).step_s() == expected
    # The longer of the two wins: a short pace below the run's own changes nothing.
    assert drills(tmp_path, "chaos.min_step_s=0.5", "chaos.short_step_s=0.1", short_of_members=True).step_s() == 0.5


def test_a_group_short_of_its_spares_keeps_the_short_pace_until_they_are_ready(tmp_path):
    ready = [0]
    paced = drills(tmp_path, *PACES, "elastic.in_process=true", "elastic.spares=1", spares_waiting=lambda: ready[0])
    assert paced.step_s() == 2.5
    ready[0] = 1
    assert paced.step_s() == 0.5
    ready[0] = 0  # the spare took a lost member's place: the next one is awaited
    assert paced.step_s() == 2.5
    # Without spares asked for, none is awaited.
    assert drills(tmp_path, *PACES, "elastic.in_process=true", spares_waiting=lambda: 0).step_s() == 0.5


def test_pace_sleeps_only_what_the_step_has_not_taken(tmp_path):
    paced = drills(tmp_path, "chaos.min_step_s=0.2")
    started = time.perf_counter()
    paced.pace(started)
    assert time.perf_counter() - started >= 0.2
    began = time.perf_counter()
    paced.pace(started - 10)  # a step that already took longer
    assert time.perf_counter() - began < 0.1


def test_a_slowed_rank_sleeps_in_every_training_forward_pass_of_its_model(tmp_path):
    def forward_s(model: torch.nn.Module) -> float:
        started = time.perf_counter()
        model(torch.zeros(1, 2))
        return time.perf_counter() - started

    slowed = torch.nn.Linear(2, 2)
    drills(tmp_path, "chaos.slow_rank=0", "chaos.slow_step_s=0.2", slowed=True, model=slowed)
    assert forward_s(slowed) >= 0.2 and forward_s(slowed) >= 0.2
    assert forward_s(slowed.eval()) < 0.2  # validation's forward passes keep their pace
    # A rank the monitor did not find slowed, or a drill without a delay, leaves its model alone.
    for overrides, slowed_by_chaos in ((("chaos.slow_step_s=0.2",), False), ((), True)):
        model = torch.nn.Linear(2, 2)
        drills(tmp_path, *overrides, slowed=slowed_by_chaos, model=model)
        assert not model._forward_pre_hooks


def test_a_rank_fails_its_step_once_per_run_and_a_restarted_group_passes_it(tmp_path):
    failing = drills(tmp_path, "chaos.fail_rank=1", "chaos.fail_at_step=3", rank=1)
    failing.before_step(2)
    with pytest.raises(RuntimeError, match=r"rank 1 fails in step 3 \(chaos.fail_rank\)"):
        failing.before_step(3)
    drills(tmp_path, "chaos.fail_rank=1", "chaos.fail_at_step=3", rank=1).before_step(3)  # the marker is there
    drills(tmp_path / "other", "chaos.fail_rank=1", "chaos.fail_at_step=3", rank=0).before_step(3)  # not its rank


def test_a_joiner_fails_its_first_step_under_fail_joiner_and_a_member_does_not(tmp_path):
    drills(tmp_path, "chaos.fail_joiner=true", restored_step=7).before_step(8)  # a member
    with pytest.raises(RuntimeError, match=r"rank 1 fails in step 8 \(chaos.fail_joiner\)"):
        drills(tmp_path, "chaos.fail_joiner=true", rank=1, restored_step=7, joiner=True).before_step(8)
