from wildtrain.events import StragglerCheckOff, from_dict
from wildtrain.tracking.worker.stragglers import Straggler, StragglerDetector, cannot_observe


def test_a_rank_slow_for_patience_intervals_is_flagged_once():
    detector = StragglerDetector(factor=1.5, patience=3)
    times = [1.0, 1.1, 2.0, 0.9]  # rank 2 is 2x the median (1.05)
    assert detector.observe(times) == []
    assert detector.observe(times) == []
    (flag,) = detector.observe(times)
    assert flag == Straggler(rank=2, factor=2.0 / 1.05, intervals=3)
    assert detector.observe(times) == [], "flagged once per streak"


def test_a_streak_that_breaks_starts_again():
    detector = StragglerDetector(factor=1.5, patience=2)
    assert detector.observe([1.0, 3.0, 1.0]) == []
    assert detector.observe([1.0, 1.0, 1.0]) == []  # back to normal
    assert detector.observe([1.0, 3.0, 1.0]) == []
    assert [f.rank for f in detector.observe([1.0, 3.0, 1.0])] == [1]


def test_uniformly_slow_ranks_are_not_stragglers():
    detector = StragglerDetector(factor=1.2, patience=1)
    assert detector.observe([5.0, 5.1, 4.9, 5.0]) == []
    assert detector.observe([0.0, 0.0]) == []  # nothing measured yet


def test_zero3_turns_the_check_off_with_a_reason_the_run_records():
    assert [cannot_observe(stage) for stage in (0, 1, 2)] == [None, None, None]
    reason = cannot_observe(3)
    assert "ZeRO-3" in reason and "all-gather" in reason and "health check" in reason
    event = StragglerCheckOff(1.0, reason)
    assert from_dict(event.to_dict()) == event and event.summary() == reason
