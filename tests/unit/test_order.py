"""The data order: every row once per epoch, the same global batches at every world size,
and a resume at any step and world size that continues exactly."""

from __future__ import annotations

from collections import Counter

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from wildtrain.data.order import Source, epoch_steps, plan_epoch, rank_segments, row_order, split_step

SEED = 3


def _steps(sources, global_batch, world_size, epoch=0, from_step=0, seed=SEED):
    """{step: [row ids of the global batch, ranks in order]}; a row id is
    (source, shard, row group, row in the row group)."""
    plan = plan_epoch(sources, global_batch, seed, epoch)
    batches = {step: [] for step in range(from_step, plan.steps)}
    for rank in range(world_size):
        streams: dict[int, list] = {}
        for segment in rank_segments(plan, rank, world_size, global_batch, from_step):
            unit = segment.unit
            rows = row_order(unit, seed, epoch)[segment.start : segment.stop]
            assert segment.first_step == from_step + len(streams.get(segment.stream, []))
            streams.setdefault(segment.stream, []).extend(
                (unit.source, unit.shard, unit.row_group, int(r)) for r in rows
            )
        for stream in sorted(streams):
            assert len(streams[stream]) == plan.steps - from_step
            for offset, row in enumerate(streams[stream]):
                batches[from_step + offset].append(row)
    return batches


shapes = st.lists(st.lists(st.integers(1, 9), min_size=1, max_size=4), min_size=1, max_size=4)


@settings(max_examples=60, deadline=None)
@given(shapes, st.sampled_from([(4, [1, 2, 4]), (6, [1, 2, 3, 6]), (8, [1, 2, 4, 8])]), st.integers(0, 2))
def test_global_batches_are_the_same_at_every_world_size_and_every_row_is_used_once(row_groups, batch, epoch):
    global_batch, world_sizes = batch
    sources = [Source(tuple(tuple(shard) for shard in row_groups))]
    total = sources[0].rows
    reference = _steps(sources, global_batch, 1, epoch)
    assert len(reference) == total // global_batch
    used = [row for batch_rows in reference.values() for row in batch_rows]
    assert len(used) == len(set(used)) == (total // global_batch) * global_batch
    all_rows = {(0, s, g, r) for s, shard in enumerate(row_groups) for g, size in enumerate(shard) for r in range(size)}
    assert set(used) <= all_rows
    for world_size in world_sizes:
        assert _steps(sources, global_batch, world_size, epoch) == reference


@settings(max_examples=40, deadline=None)
@given(shapes, st.integers(0, 30), st.sampled_from([1, 2, 4]))
def test_resuming_at_a_step_continues_with_exactly_the_remaining_batches(row_groups, from_step, world_size):
    sources = [Source(tuple(tuple(shard) for shard in row_groups))]
    full = _steps(sources, 4, 1)
    from_step = min(from_step, len(full))
    resumed = _steps(sources, 4, world_size, from_step=from_step)
    assert resumed == {step: rows for step, rows in full.items() if step >= from_step}


def test_each_rank_reads_only_its_own_rows():
    sources = [Source(((64,) * 8,))]
    plan = plan_epoch(sources, 8, SEED, 0)
    read = Counter()
    for rank in range(4):
        for segment in rank_segments(plan, rank, 4, 8, 0):
            read[(segment.unit.row_group, rank)] += segment.stop - segment.start
    assert sum(read.values()) == plan.steps * 8 == 512
    ranks_per_group = Counter(group for group, _ in read)
    assert max(ranks_per_group.values()) <= 2  # a row group shared only where a stream boundary cuts it


def test_mixture_takes_rows_in_proportion_to_the_weights():
    big = Source(((10,) * 30,), weight=1.0)  # 300 rows
    small = Source(((10,) * 3,), weight=3.0)  # 30 rows, upsampled
    plan = plan_epoch([big, small], 10, SEED, 0)
    rows = Counter()
    for unit in plan.units:
        rows[unit.source] += unit.rows
    assert rows == {0: round(330 * 1 / 4), 1: round(330 * 3 / 4)}
    repeats = Counter((u.shard, u.row_group) for u in plan.units if u.source == 1)
    assert set(repeats.values()) <= {8, 9}  # 247 rows from 3 row groups of 10: each about 8 times
    assert max(u.repeat for u in plan.units if u.source == 1) == 8


def test_the_order_depends_on_seed_and_epoch_only():
    sources = [Source(((16,) * 6,))]
    same = _steps(sources, 4, 2, epoch=1, seed=5)
    assert same == _steps(sources, 4, 2, epoch=1, seed=5)
    assert same != _steps(sources, 4, 2, epoch=2, seed=5)
    assert same != _steps(sources, 4, 2, epoch=1, seed=6)


def test_split_step_counts_epochs():
    assert split_step(0, 10) == (0, 0)
    assert split_step(25, 10) == (2, 5)
    np.testing.assert_raises(ValueError, split_step, 3, 0)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.lists(st.lists(st.integers(1, 9), min_size=1, max_size=3), min_size=1, max_size=3), min_size=1, max_size=3
    ),
    st.lists(st.floats(0.1, 3.0), min_size=3, max_size=3),
    st.integers(1, 12),
    st.integers(0, 3),
)
def test_the_steps_of_an_epoch_need_no_plan(shapes, weights, global_batch, epoch):
    sources = [Source(tuple(tuple(s) for s in shape), weight) for shape, weight in zip(shapes, weights)]
    assert epoch_steps(sources, global_batch) == plan_epoch(sources, global_batch, SEED, epoch).steps
