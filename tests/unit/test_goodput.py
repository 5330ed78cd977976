import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wildtrain.tracking.reports.goodput import (
    BADPUT_CAUSES,
    AttemptStarted,
    CapacityWait,
    GroupStopped,
    RunStarted,
    RunStopped,
    Steps,
    account,
    goodput_over_time,
    stalled_s,
)


def parts(goodput) -> dict:
    return {"productive": goodput.productive_s, **{k: v for k, v in goodput.badput_s.items() if v}}


def assert_adds_up(goodput) -> None:
    assert set(goodput.badput_s) == set(BADPUT_CAUSES)
    assert goodput.productive_s + sum(goodput.badput_s.values()) == goodput.wall_s
    assert goodput.productive_s >= 0 and min(goodput.badput_s.values()) >= 0


def test_a_run_without_failures():
    events = [
        RunStarted(0.0),
        AttemptStarted(10.0, restored_step=0),
        Steps(1, 10, 12.0, 112.0, data_wait_s=5.0, checkpoint_stall_s=3.0),
        Steps(11, 20, 112.0, 212.0, data_wait_s=5.0, checkpoint_stall_s=7.0),
        RunStopped(214.0),
    ]
    goodput = account(events, now=214.0)
    assert_adds_up(goodput)
    # start-up until the first step, and stopping after the last
    assert parts(goodput) == {"productive": 180.0, "startup": 12.0 + 2.0, "data_wait": 10.0, "checkpoint_stall": 10.0}
    assert goodput.goodput == 180.0 / 214.0


def test_time_blocked_handing_a_report_to_the_controller_is_badput_of_its_own():
    events = [
        RunStarted(0.0),
        AttemptStarted(10.0, restored_step=0),
        Steps(1, 10, 12.0, 112.0, data_wait_s=5.0, report_wait_s=20.0),
        Steps(11, 20, 112.0, 212.0, report_wait_s=1.5),
        RunStopped(212.0),
    ]
    goodput = account(events, now=212.0)
    assert_adds_up(goodput)
    assert parts(goodput) == {"productive": 200.0 - 5.0 - 21.5, "startup": 12.0, "data_wait": 5.0, "report_wait": 21.5}
    # A step's usual time leaves the report's wait out: a window that waited on reports is not "slow".
    assert Steps(1, 10, 0.0, 100.0, report_wait_s=60.0).step_s == 4.0


def test_time_spent_on_validation_is_badput_of_its_own():
    events = [
        RunStarted(0.0),
        AttemptStarted(0.0, restored_step=0),
        Steps(1, 10, 0.0, 100.0, eval_s=4.0, checkpoint_stall_s=2.0),
        RunStopped(100.0),
    ]
    goodput = account(events, now=100.0)
    assert_adds_up(goodput)
    assert parts(goodput) == {"productive": 94.0, "eval": 4.0, "checkpoint_stall": 2.0}


def test_one_failure_loses_the_steps_after_the_restored_checkpoint():
    events = [
        RunStarted(0.0),
        AttemptStarted(4.0, restored_step=0),
        Steps(1, 10, 10.0, 110.0),
        Steps(11, 20, 110.0, 210.0, data_wait_s=10.0, checkpoint_stall_s=2.0),
        GroupStopped(215.0, "failure"),
        AttemptStarted(225.0, restored_step=15, restore_s=5.0, reshard_s=3.0),
        Steps(16, 20, 240.0, 290.0),
        Steps(21, 30, 290.0, 390.0),
    ]
    goodput = account(events, now=390.0)
    assert_adds_up(goodput)
    # Steps 16..20 ran twice: the second half of the window [110, 210) is lost, with the
    # step in flight until the failure was noticed; the kept half keeps half the parts.
    assert parts(goodput) == {
        "productive": 100.0 + (50.0 - 5.0 - 1.0) + 50.0 + 100.0,
        "lost": 50.0 + 5.0,
        "restore": 8.0,
        "startup": 10.0 + 10.0 + 7.0,
        "data_wait": 5.0,
        "checkpoint_stall": 1.0,
    }


def test_failures_during_recovery_count_each_redone_step_each_time_and_each_instant_once():
    events = [
        RunStarted(0.0),
        AttemptStarted(0.0, restored_step=0),
        Steps(1, 10, 0.0, 100.0),
        GroupStopped(100.0, "failure"),
        AttemptStarted(110.0, restored_step=5, restore_s=5.0),
        Steps(6, 8, 120.0, 150.0),
        GroupStopped(150.0, "failure"),
        GroupStopped(152.0, "failure"),  # the same outage, reported twice
        AttemptStarted(160.0, restored_step=5, restore_s=30.0),
        GroupStopped(175.0, "failure"),  # a failure while restoring: the restore still claims its time
        AttemptStarted(200.0, restored_step=5, restore_s=5.0),
        Steps(6, 10, 210.0, 260.0),
    ]
    goodput = account(events, now=260.0)
    assert_adds_up(goodput)
    assert parts(goodput) == {
        "productive": 50.0 + 50.0,
        "lost": 50.0 + 30.0,  # steps 6..10 of the first attempt and 6..8 of the second
        "restore": 5.0 + 30.0 + 5.0,
        "startup": 10.0 + 5.0 + 10.0 + 10.0 + 5.0,
    }


def test_waiting_for_resources_and_a_resubmission():
    events = [
        RunStarted(0.0),
        CapacityWait(2.0, 30.0),
        AttemptStarted(35.0, restored_step=0),
        Steps(1, 5, 40.0, 90.0),
        GroupStopped(90.0, "failure"),  # right after the checkpoint of step 5: nothing lost
        CapacityWait(95.0, 195.0),
        AttemptStarted(200.0, restored_step=5, restore_s=2.0, reshard_s=6.0),
        Steps(6, 10, 210.0, 260.0),
        RunStopped(262.0),
        RunStarted(1000.0),
        AttemptStarted(1010.0, restored_step=10, restore_s=2.0),
        Steps(11, 12, 1015.0, 1035.0),
        RunStopped(1036.0),
    ]
    goodput = account(events, now=1036.0)
    assert_adds_up(goodput)
    assert parts(goodput) == {
        "productive": 50.0 + 50.0 + 20.0,
        "waiting": 28.0 + 100.0,
        "restore": 8.0 + 2.0,
        "stopped": 1000.0 - 262.0,
        "startup": 2.0 + 10.0 + 5.0 + 5.0 + 2.0 + 2.0 + 10.0 + 3.0 + 1.0,
    }


@pytest.mark.parametrize(
    "kind, badput",
    [
        ("failure", {"lost": 3.0, "startup": 7.0}),  # the step in flight died with the group
        ("resize", {"startup": 3.0 + 7.0}),  # handing over to a bigger group
    ],
)
def test_time_after_the_last_step_goes_to_what_interrupted_the_group(kind, badput):
    events = [RunStarted(0.0), Steps(1, 4, 0.0, 40.0), GroupStopped(43.0, kind), AttemptStarted(50.0, restored_step=4)]
    assert parts(account(events, now=50.0)) == {"productive": 40.0, **badput}


def test_time_since_the_newest_report_of_a_running_group_is_unreported():
    events = [RunStarted(0.0), Steps(1, 4, 0.0, 40.0), Steps(5, 8, 42.0, 80.0)]
    assert parts(account(events, now=100.0)) == {"productive": 78.0, "unreported": 2.0 + 20.0}


def test_an_instant_claimed_twice_counts_once_for_the_badput():
    events = [RunStarted(0.0), Steps(1, 10, 0.0, 100.0), CapacityWait(50.0, 70.0), Steps(11, 12, 90.0, 110.0)]
    assert parts(account(events, now=110.0)) == {"productive": 90.0, "waiting": 20.0}


def test_a_window_far_slower_than_the_usual_counts_its_excess_as_stalled():
    # Windows of 10 steps at 1 s each; one was held up for 60 s (a report blocked on a
    # stopped tracking server): only its time beyond the usual 10 s is stalled.
    events = [RunStarted(0.0)] + [Steps(10 * i + 1, 10 * i + 10, 10.0 * i, 10.0 * (i + 1)) for i in range(5)]
    events += [Steps(51, 60, 50.0, 120.0, data_wait_s=2.0), Steps(61, 70, 120.0, 130.0)]
    goodput = account(events, now=130.0)
    assert_adds_up(goodput)
    assert parts(goodput) == {"productive": 50.0 + 10.0 + 10.0, "stalled": 70.0 - 2.0 - 10.0, "data_wait": 2.0}
    assert stalled_s([e for e in events if isinstance(e, Steps)]) == [0.0] * 5 + [58.0, 0.0]


def test_slower_steps_at_a_smaller_world_size_are_not_a_stall():
    fast = [Steps(i, i, float(i), i + 1.0, world_size=4) for i in range(1, 6)]
    slow = [Steps(i, i, 2.0 + 4 * i, 6.0 + 4 * i, world_size=1) for i in range(6, 9)]  # a quarter of the workers
    assert stalled_s(fast + slow) == [0.0] * 8
    # Too few windows at one size to know its usual: none is judged.
    assert stalled_s([Steps(1, 1, 0.0, 1.0), Steps(2, 2, 1.0, 100.0)]) == [0.0, 0.0]


def test_a_stalled_window_whose_steps_were_redone_is_lost():
    events = [RunStarted(0.0), AttemptStarted(0.0, 0)] + [Steps(i, i, i - 1.0, float(i)) for i in range(1, 5)]
    events += [Steps(5, 5, 4.0, 64.0), GroupStopped(64.0, "failure"), AttemptStarted(70.0, restored_step=4)]
    assert parts(account(events, now=70.0)) == {"productive": 4.0, "lost": 60.0, "startup": 6.0}


def test_parts_larger_than_their_window_are_cut_to_fit_it():
    events = [RunStarted(0.0), Steps(1, 1, 0.0, 10.0, data_wait_s=8.0, checkpoint_stall_s=8.0)]
    assert parts(account(events, now=10.0)) == {"productive": 0.0, "data_wait": 8.0, "checkpoint_stall": 2.0}


def test_the_parts_add_up_exactly_with_times_that_floats_cannot_hold():
    start = 1.7e9 + 0.1
    events = [RunStarted(start)] + [
        Steps(i, i, start + 0.3 * i, start + 0.3 * (i + 1), data_wait_s=0.01) for i in range(1, 1000)
    ]
    goodput = account(events, now=start + 400.7)
    assert_adds_up(goodput)
    assert goodput.wall_s == pytest.approx(400.7, abs=1e-3)


def test_goodput_over_time_ends_at_the_runs_goodput():
    events = [
        RunStarted(0.0),
        AttemptStarted(0.0, 0),
        Steps(1, 10, 20.0, 120.0),
        GroupStopped(120.0, "failure"),
        AttemptStarted(140.0, restored_step=5),
        Steps(6, 10, 140.0, 190.0),
    ]
    curve = goodput_over_time(events, 190.0, [0.0, 20.0, 70.0, 120.0, 190.0, 500.0])
    # steps 6..10 first ran over [70, 120) and were redone: that stretch counts as lost
    assert curve[:5] == [0.0, 0.0, 50.0 / 70.0, 50.0 / 120.0, 100.0 / 190.0]
    assert curve[-1] == curve[-2] == account(events, 190.0).goodput


def test_the_wall_time_needs_the_runs_start():
    with pytest.raises(ValueError, match="RunStarted"):
        account([Steps(1, 2, 0.0, 1.0)], now=1.0)
    with pytest.raises(ValueError, match="before the run started"):
        account([RunStarted(10.0)], now=5.0)
    with pytest.raises(ValueError, match="first <= last"):
        account([RunStarted(0.0), Steps(3, 2, 0.0, 1.0)], now=1.0)


times = st.floats(0.0, 1000.0)
durations = st.floats(0.0, 100.0)
steps = st.integers(0, 40)
events = st.one_of(
    st.builds(RunStarted, times),
    st.builds(RunStopped, times),
    st.builds(lambda t, d: CapacityWait(t, t + d), times, durations),
    st.builds(AttemptStarted, times, steps, durations, durations),
    st.builds(GroupStopped, times, st.sampled_from(["failure", "resize"])),
    st.builds(
        lambda first, n, t, d, w, c, size: Steps(first, first + n, t, t + d, w, c, size),
        steps,
        st.integers(0, 9),
        times,
        durations,
        durations,
        durations,
        st.integers(0, 2),
    ),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(events, max_size=30), times, st.floats(0.0, 2000.0), st.sampled_from([0.0, 1.7e9]))
def test_the_parts_are_never_negative_and_always_add_up_to_the_wall_time(events, start, lasted, epoch):
    shifted = [RunStarted(start)] + events
    shifted = [_shift(e, epoch) for e in shifted]
    goodput = account(shifted, now=epoch + start + lasted)
    assert_adds_up(goodput)
    assert 0.0 <= goodput.goodput <= 1.0
    earliest = min(e.at for e in shifted if isinstance(e, RunStarted))
    assert goodput.wall_s == pytest.approx(epoch + start + lasted - earliest, abs=2 / 1024)  # ends rounded to 1/1024 s
    assert math.isclose(goodput_over_time(shifted, epoch + start + lasted, [epoch + 3000.0])[0], goodput.goodput)


def _shift(e, by: float):
    fields = {name: value + by for name, value in vars(e).items() if name in ("at", "start", "end")}
    return type(e)(**(vars(e) | fields))
