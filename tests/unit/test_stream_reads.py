"""How a rank's reads are cut into Ray Data read tasks and how a block's rows are filed back
by stream and step: pure functions, no Ray."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from wildtrain.config import Config
from wildtrain.data import stream
from wildtrain.data.order import Source, plan_epoch, rank_segments
from wildtrain.data.stream import Dataset, RankStream, _runs, task_units

ROW_BYTES = 10


def _units(sources, global_batch, world_size, from_step):
    plan = plan_epoch(sources, global_batch, 5, 0)
    by_unit: dict = {}
    for segment in rank_segments(plan, 0, world_size, global_batch, from_step):
        by_unit.setdefault(segment.unit, []).append(segment)
    return list(by_unit.values())


def _bytes(unit) -> int:
    return sum(s.stop - s.start for s in unit) * ROW_BYTES


shapes = st.lists(st.lists(st.integers(1, 9), min_size=1, max_size=4), min_size=1, max_size=4)


@settings(max_examples=60, deadline=None)
@given(shapes, st.sampled_from([(4, 1), (4, 2), (8, 1)]), st.integers(1, 200))
def test_tasks_keep_the_order_and_are_no_bigger_than_needed(shape, batch, task_bytes):
    global_batch, world_size = batch
    units = _units([Source(tuple(tuple(s) for s in shape))], global_batch, world_size, 0)
    tasks = task_units(units, ROW_BYTES, task_bytes)
    assert [u for task in tasks for u in task] == units
    for task in tasks[:-1]:
        assert sum(map(_bytes, task)) >= task_bytes
    for task in tasks:
        assert sum(map(_bytes, task[:-1])) < task_bytes


def test_a_task_per_unit_when_each_fills_a_task():
    units = _units([Source(((5, 5, 3), (6, 2)))], 4, 1, 0)
    assert task_units(units, ROW_BYTES, 1) == [[u] for u in units]
    assert task_units(units, ROW_BYTES, 10**9) == [units]
    assert task_units([], ROW_BYTES, 1) == []


def test_runs_split_a_block_where_the_stream_changes_or_a_step_is_skipped():
    streams = np.array([0, 0, 0, 1, 1, 0, 0, 2])
    steps = np.array([3, 4, 5, 0, 1, 9, 10, 0])
    assert _runs(streams, steps) == [(0, 3), (3, 5), (5, 7), (7, 8)]
    assert _runs(np.array([0, 0]), np.array([1, 3])) == [(0, 1), (1, 2)]
    assert _runs(np.array([2]), np.array([7])) == [(0, 1)]


def test_opening_a_rank_stream_in_a_later_epoch_plans_that_epoch_alone(monkeypatch):
    # A plan of a 100,000-shard manifest costs seconds of CPU on every rank: opening a stream
    # must not plan epoch 0 for the epoch's length besides the epoch it starts in.
    planned = []
    monkeypatch.setattr(stream, "plan_epoch", lambda *args: planned.append(args[3]) or plan_epoch(*args))
    monkeypatch.setattr(stream, "epoch_dataset", lambda *args: type("Read", (), {"iter_batches": lambda *a, **k: []})())
    monkeypatch.setattr(stream._EpochReads, "next_block", lambda self: None)
    cfg = Config()
    cfg.train.global_batch_size, cfg.train.seed = 4, 5
    source = Source(((3, 4), (5,)))  # 12 rows: 3 steps of 4 an epoch
    opened = RankStream(
        [Dataset("root", ("a", "b"), source)], cfg.data, cfg.train, cfg.storage, 1, 2, from_step=7, doc_ids=False
    )
    opened._open(*stream.split_step(opened.step, opened.steps_per_epoch))
    assert planned == [2]
