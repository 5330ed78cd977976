"""The chaos.* drills of an attempt (a slow forward pass, the failure that fires once per run),
the per-step hook every worker calls (train/hooks.py), and the pace tests keep with it
(tests/helpers/pacing.py)."""

from __future__ import annotations

import time

import pytest
import torch

from tests.helpers.pacing import Pace
from wildtrain.config import ConfigError, load_config
from wildtrain.layout import RunLayout
from wildtrain.train import hooks
from wildtrain.train.drills import Drills

# What the recording hook (`recorder`) was called with, in this process.
CALLS: list[hooks.StepDone] = []


def recorder() -> hooks.StepHook:
    return CALLS.append


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
        cfg.chaos,
        rank,
        restored_step,
        chaos_failed=RunLayout.of(cfg.run, cfg.checkpoint).chaos_failed,
        storage_config=cfg.storage,
        joiner=joiner,
        slowed=slowed,
        model=model if model is not None else torch.nn.Identity(),
        short_of_members=short_of_members,
        spares_wanted=cfg.elastic.spares,
        spares_waiting=spares_waiting,
    )


@pytest.fixture
def recording(monkeypatch):
    """Every Drills made from now on calls `recorder`'s hook; its calls, from none."""
    monkeypatch.setenv(hooks.STEP_HOOK, f"{__name__}:recorder")
    CALLS.clear()
    return CALLS


def test_the_pace_settings_are_no_part_of_the_config():
    for key in ("min_step_s", "short_step_s"):
        with pytest.raises(ConfigError, match=rf"^chaos\.{key}: unknown key"):
            load_config(["experiment=tiny", f"chaos.{key}=1"])


def test_a_hook_is_named_by_its_import_path_with_its_parameters():
    pace = Pace(min_step_s=0.5, short_step_s=4)
    assert pace.spec() == "tests.helpers.pacing:pace?min_step_s=0.5&short_step_s=4"
    assert hooks.load(pace.spec()) == pace
    assert hooks.load("tests.helpers.pacing:pace") == Pace()
    for wrong in ("tests.helpers.pacing", ":pace", "tests.helpers.pacing:pace?min_step_s"):
        with pytest.raises(ConfigError, match=rf"^{hooks.STEP_HOOK}="):
            hooks.load(wrong)


def test_the_driver_hands_its_workers_the_hook_it_was_given_or_its_own_environments(monkeypatch):
    monkeypatch.delenv(hooks.STEP_HOOK, raising=False)
    assert hooks.worker_env() == {}
    paced = Pace(min_step_s=0.5).spec()
    assert hooks.worker_env(paced) == {hooks.STEP_HOOK: paced}
    monkeypatch.setenv(hooks.STEP_HOOK, paced)
    assert hooks.worker_env() == {hooks.STEP_HOOK: paced}
    # Loaded there first: a wrong path fails the driver, not every worker's attempts.
    with pytest.raises(ModuleNotFoundError):
        hooks.worker_env("tests.helpers.no_such_module:pace")


@pytest.mark.parametrize(
    "short_of_members, spares_ready, spares_wanted, short",
    [
        (False, None, 0, False),  # a group of Ray Train workers
        (True, None, 0, True),
        (False, 0, 0, False),  # in-process, no spares asked for
        (False, 0, 1, True),
        (False, 1, 1, False),
        (True, 1, 1, True),
    ],
)
def test_a_group_trains_short_of_members_or_of_spares(short_of_members, spares_ready, spares_wanted, short):
    assert hooks.trains_short(short_of_members, spares_ready, spares_wanted) is short


@pytest.mark.parametrize("short, expected", [(False, 0.5), (True, 2.5)])
def test_a_step_short_of_members_keeps_the_short_pace_and_any_other_the_whole_runs(short, expected):
    assert Pace(min_step_s=0.5, short_step_s=2.5).step_s(short) == expected
    # The longer of the two wins: a short pace below the run's own changes nothing.
    assert Pace(min_step_s=0.5, short_step_s=0.1).step_s(short=True) == 0.5


def test_pace_sleeps_only_what_the_step_has_not_taken():
    pace = Pace(min_step_s=0.2)
    started = time.perf_counter()
    pace(hooks.StepDone(1, 0, started, short=False))
    assert time.perf_counter() - started >= 0.2
    began = time.perf_counter()
    pace(hooks.StepDone(2, 0, started - 10, short=False))  # a step that already took longer
    assert time.perf_counter() - began < 0.1


def test_every_step_calls_the_hook_with_the_step_and_whether_the_group_is_short(tmp_path, recording):
    started = time.perf_counter()
    drills(tmp_path, rank=1).after_step(3, started)
    drills(tmp_path, short_of_members=True).after_step(4, started)
    assert recording == [hooks.StepDone(3, 1, started, False), hooks.StepDone(4, 0, started, True)]


def test_a_group_short_of_its_spares_is_short_until_they_are_ready(tmp_path, recording):
    ready = [0]
    paced = drills(tmp_path, "elastic.in_process=true", "elastic.spares=1", spares_waiting=lambda: ready[0])
    paced.after_step(1, 0.0)
    ready[0] = 1
    paced.after_step(2, 0.0)
    ready[0] = 0  # the spare took a lost member's place: the next one is awaited
    paced.after_step(3, 0.0)
    # Without spares asked for, none is awaited.
    drills(tmp_path, "elastic.in_process=true", spares_waiting=lambda: 0).after_step(4, 0.0)
    assert [call.short for call in recording] == [True, False, True, False]


def test_without_a_hook_a_step_calls_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv(hooks.STEP_HOOK, raising=False)
    asked = []
    quiet = drills(tmp_path, "elastic.in_process=true", "elastic.spares=1", spares_waiting=lambda: asked.append(1))
    quiet.after_step(1, 0.0)
    assert quiet.step_hook is None and not asked  # not even the spares' count


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
