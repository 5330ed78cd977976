"""Straggler detection: the detector's verdicts, and the watch that judges every rank's
gathered busy times on every rank alike."""

import dataclasses
from types import SimpleNamespace

from tests.helpers.ranks import spawned_pair
from wildtrain.config import load_config
from wildtrain.events import Straggler as StragglerEvent
from wildtrain.events import StragglerCheckOff, from_dict
from wildtrain.tracking.worker.stragglers import Straggler, StragglerDetector, cannot_observe
from wildtrain.train.monitor import StragglerWatch


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


def _watch(rank: int, results) -> None:
    cfg = load_config(["monitor.straggler_every=2", "monitor.straggler_patience=2", "monitor.straggler_factor=1.5"])
    watch = StragglerWatch(cfg.monitor, cfg.deepspeed.zero_stage, ["node-a", "node-b"])
    busy_s, events = 0.0, []
    for step in range(1, 7):
        busy_s += 0.1 if rank == 0 else 0.5  # two ranks: above 1.5x their median is above 3x the other
        events += watch.step_done(step, SimpleNamespace(busy_s=busy_s))
    results.put((rank, events))


def test_every_rank_finds_the_same_stragglers():
    """The controller logs rank 0's reports; where rank 0's node takes one before the
    controller collected it, rank 1's stands in, and must carry the same stragglers."""
    with spawned_pair(_watch) as results:
        found = dict(results.get(timeout=60) for _ in range(2))
    [flagged] = found[0]  # checked at steps 2, 4 and 6: slow twice in a row by step 4, flagged once
    assert isinstance(flagged, StragglerEvent)
    assert (flagged.step, flagged.rank, flagged.node, flagged.intervals) == (4, 1, "node-b", 2)
    assert [dataclasses.replace(e, at=0) for e in found[1]] == [dataclasses.replace(flagged, at=0)]
