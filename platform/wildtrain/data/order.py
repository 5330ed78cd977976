"""The order a run trains on its data in: a pure function of the step, at any world size.

Ray Data streams rows but cannot save or restore an iterator's position, so the position is
not kept at all: which rows step s trains on follows from (the datasets' manifests, the
mixture weights, the seed, s), and a restart at any world size recomputes it.

- **Units.** An epoch is a list of units, each (part of) one Parquet row group. Every dataset
  of the mixture contributes rows in proportion to its weight (the epoch has as many rows as
  all datasets together): its row groups in a seeded order, repeated when it is upsampled,
  the last one cut short; the units of all datasets are then shuffled together, seeded.
  Inside a unit, rows are read in a seeded permutation of its row group.
- **Streams.** The epoch's N rows, laid end to end, are cut into G streams (G = global batch)
  of S = N // G rows each; the remaining N - G·S rows sit out this epoch. Step s trains on
  row s of every stream, streams in order: the global batch is the same G rows at every
  world size.
- **Ranks.** Rank r of W owns the contiguous streams [r·G/W, (r+1)·G/W) (the batch plan
  guarantees W divides G), so it reads only its share of the data: long contiguous runs of
  row groups, each read once, none by two ranks (apart from a row group split at a stream
  boundary). It reads them as segments, ordered by the step that first needs them.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Source:
    """One prepared dataset as the order sees it: the rows of each row group, shard by shard."""

    row_groups: tuple[tuple[int, ...], ...]
    weight: float = 1.0

    @property
    def rows(self) -> int:
        return sum(sum(shard) for shard in self.row_groups)


@dataclass(frozen=True)
class Unit:
    source: int
    shard: int
    row_group: int
    size: int  # rows in the row group
    rows: int  # rows this epoch takes from it, the first `rows` of its permutation
    repeat: int  # 0 the first time the row group appears in the epoch, 1 the next, ...


@dataclass(frozen=True)
class Segment:
    """Rows [start, stop) of a unit's row order, read by one stream; the stream needs the
    first of them at step `first_step` of the epoch and one more at every step after it."""

    stream: int
    first_step: int
    unit: Unit
    start: int
    stop: int


@dataclass(frozen=True)
class EpochPlan:
    units: tuple[Unit, ...]
    offsets: np.ndarray  # offsets[i]: the position in the epoch of units[i]'s first row
    steps: int  # S: rows per stream, optimizer steps in the epoch


def _rng(seed: int, *key: int) -> np.random.Generator:
    return np.random.default_rng([seed, *key])


def _wanted(sources: list[Source]) -> list[int]:
    """The rows each source gives every epoch: its weight's share of all sources' rows."""
    total_rows = sum(s.rows for s in sources)
    total_weight = sum(s.weight for s in sources)
    return [round(total_rows * source.weight / total_weight) for source in sources]


def epoch_steps(sources: list[Source], global_batch_size: int) -> int:
    """S, the steps of every epoch (`plan_epoch(...).steps`), without planning one: an epoch
    takes the same rows from each source whatever its order."""
    return sum(_wanted(sources)) // global_batch_size


def epoch_units(sources: list[Source], seed: int, epoch: int) -> list[Unit]:
    units: list[Unit] = []
    for index, (source, wanted) in enumerate(zip(sources, _wanted(sources))):
        groups = [
            (shard, group, rows) for shard, sizes in enumerate(source.row_groups) for group, rows in enumerate(sizes)
        ]
        if not groups:
            raise ValueError(f"dataset {index} of the mixture has no rows")
        order = _rng(seed, epoch, index).permutation(len(groups))
        taken = 0
        for n in itertools.count():
            if taken >= wanted:
                break
            repeat, position = divmod(n, len(groups))
            shard, group, size = groups[order[position]]
            rows = min(size, wanted - taken)
            units.append(Unit(index, shard, group, size, rows, repeat))
            taken += rows
    shuffled = _rng(seed, epoch).permutation(len(units))
    return [units[i] for i in shuffled]


def plan_epoch(sources: list[Source], global_batch_size: int, seed: int, epoch: int) -> EpochPlan:
    units = epoch_units(sources, seed, epoch)
    sizes = np.array([u.rows for u in units], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]) if len(units) else np.zeros(0, np.int64)
    return EpochPlan(tuple(units), offsets, int(sizes.sum()) // global_batch_size)


def row_order(unit: Unit, seed: int, epoch: int) -> np.ndarray:
    """Row indices within the unit's row group, in the order the epoch reads them."""
    key = (epoch, unit.source, unit.shard, unit.row_group, unit.repeat)
    return _rng(seed, *key).permutation(unit.size)[: unit.rows]


def rank_streams(rank: int, world_size: int, global_batch_size: int) -> range:
    per_rank = global_batch_size // world_size
    return range(rank * per_rank, (rank + 1) * per_rank)


def rank_segments(plan: EpochPlan, rank: int, world_size: int, global_batch_size: int, from_step: int) -> list[Segment]:
    """The segments rank `rank` of `world_size` reads to train steps [from_step, plan.steps)
    of the epoch, in the order it needs them."""
    segments = []
    for stream in rank_streams(rank, world_size, global_batch_size):
        position, end = stream * plan.steps + from_step, (stream + 1) * plan.steps
        while position < end:
            index = int(np.searchsorted(plan.offsets, position, side="right")) - 1
            unit, unit_start = plan.units[index], int(plan.offsets[index])
            stop = min(end, unit_start + unit.rows)
            segments.append(
                Segment(stream, position - stream * plan.steps, unit, position - unit_start, stop - unit_start)
            )
            position = stop
    return sorted(segments, key=lambda s: (s.first_step, s.stream))


def split_step(step: int, steps_per_epoch: int) -> tuple[int, int]:
    """(epoch, step within the epoch) of a run's optimizer step."""
    if steps_per_epoch == 0:
        raise ValueError("the data cannot fill one global batch")
    return divmod(step, steps_per_epoch)
