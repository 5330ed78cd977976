"""A rank's training rows, streamed from object storage through Ray Data, step by step.

What a rank reads and in which order is decided by `data.order` (a pure function of the step,
so a restart at any world size resumes exactly); this module does the reading. Every epoch
becomes one Ray Data dataset built from a `Datasource` with one read task per row group the
rank needs: the manifests already know every shard's row groups and row counts, so Ray Data
starts without listing files or reading Parquet footers, and a read task fetches its row
group straight from the object store (no copy to local disk), permutes it as the order says,
and yields the rank's rows of it tagged with their stream and step. Ray Data runs the reads
ahead of training (in order, `preserve_order` on this dataset's own context); `RankStream`
files the rows by stream and step and hands out a step's rows, one per stream, as training
asks for them.

Memory per rank: about one row group per stream the rank owns, plus Ray Data's prefetch.
"""

from __future__ import annotations

import re
import time
import traceback
from dataclasses import dataclass
from functools import partial
from typing import Iterator

import numpy as np

from wildtrain import storage
from wildtrain.config import Config, StorageConfig
from wildtrain.data.manifest import DataError, ShardCorrupt
from wildtrain.data.order import Segment, Source, plan_epoch, rank_segments, rank_streams, row_order, split_step

STREAM, STEP, TOKENS, SAMPLE_IDS = "stream", "step", "tokens", "sample_ids"


@dataclass(frozen=True)
class Dataset:
    """A prepared dataset the run reads: where it is, its shards, and its share of the mixture."""

    root: str
    shard_paths: tuple[str, ...]  # relative to root, in manifest order
    source: Source


def sample_ids(source, shard, rows_in_shard) -> np.ndarray:
    """One int64 per row that names it across the run's datasets: (dataset, shard, row)."""
    source, shard, row = (np.asarray(x, dtype=np.int64) for x in (source, shard, rows_in_shard))
    return (source << 48) | (shard << 28) | row


def read_unit(dataset: Dataset, segments: list[Segment], seed: int, epoch: int, seq_len: int, config: StorageConfig):
    """One block from one read of a unit's row group: the rows of each of `segments` (all
    of that unit) with their stream, the step (in the epoch) that trains on them, sample ids,
    and tokens as (rows × seq_len+1) int32."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from ray.data.extensions import ArrowTensorArray

    unit = segments[0].unit
    uri = storage.join(dataset.root, dataset.shard_paths[unit.shard])
    fs, path = storage.filesystem(uri, config)
    try:
        with storage.errors(uri, config), fs.open_input_file(path) as f:
            column = pq.ParquetFile(f).read_row_group(unit.row_group, columns=[TOKENS]).column(TOKENS).combine_chunks()
    except (OSError, pa.ArrowException) as e:
        gone = isinstance(e.__cause__, FileNotFoundError) or isinstance(e, FileNotFoundError)
        # A store that does not answer may answer the restarted group; a shard that is gone
        # or no longer Parquet will not be back.
        error = ShardCorrupt if gone or not isinstance(e, OSError) else DataError
        raise error(f"shard {uri}: row group {unit.row_group} unreadable: {e}") from None
    if len(column) != unit.size:
        raise ShardCorrupt(f"shard {uri}: row group {unit.row_group} has {len(column)} rows, the manifest says {unit.size}")
    tokens = column.flatten().to_numpy().reshape(len(column), seq_len + 1)
    order = row_order(unit, seed, epoch)
    rows = np.concatenate([order[s.start : s.stop] for s in segments])
    streams = np.concatenate([np.full(s.stop - s.start, s.stream, dtype=np.int32) for s in segments])
    steps = np.concatenate([np.arange(s.first_step, s.first_step + s.stop - s.start, dtype=np.int32) for s in segments])
    first_row = sum(dataset.source.row_groups[unit.shard][: unit.row_group])
    yield pa.table({
        STREAM: pa.array(streams),
        STEP: pa.array(steps),
        SAMPLE_IDS: pa.array(sample_ids(unit.source, unit.shard, first_row + rows)),
        TOKENS: ArrowTensorArray.from_numpy(tokens[rows]),
    })


def epoch_dataset(datasets: list[Dataset], segments: list[Segment], seed: int, epoch: int, seq_len: int,
                  read_cpus: float, config: StorageConfig):
    """The rank's segments as a Ray Data dataset: one read task per unit (a row group read
    once, even where two of the rank's streams meet in it), in the order the rank first
    needs each unit."""
    import ray.data
    from ray.data.block import BlockMetadata
    from ray.data.datasource import Datasource, ReadTask

    by_unit: dict = {}
    for segment in segments:  # in the order they are needed: dicts keep first insertion
        by_unit.setdefault(segment.unit, []).append(segment)
    row_bytes = (seq_len + 1) * 4

    class Units(Datasource):
        def estimate_inmemory_data_size(self) -> int:
            return sum(s.stop - s.start for s in segments) * row_bytes

        def get_read_tasks(self, parallelism: int, per_task_row_limit=None, data_context=None) -> list[ReadTask]:
            tasks = []
            for unit, unit_segments in by_unit.items():
                rows = sum(s.stop - s.start for s in unit_segments)
                read = partial(read_unit, datasets[unit.source], unit_segments, seed, epoch, seq_len, config)
                tasks.append(ReadTask(read, BlockMetadata(num_rows=rows, size_bytes=rows * row_bytes,
                                                          exec_stats=None, input_files=None)))
            return tasks

    ds = ray.data.read_datasource(Units(), num_cpus=read_cpus)
    # This dataset's own context copy: rows in read-task order, and no progress bars, which
    # would bury the run's progress lines; the data wait is a step metric instead.
    ds.context.execution_options.preserve_order = True
    ds.context.enable_progress_bars = False
    return ds


@dataclass(frozen=True)
class Step:
    """One rank's share of one optimizer step."""

    sample_ids: np.ndarray  # (rows,) see `sample_ids`
    tokens: np.ndarray  # (rows, seq_len + 1) int32


class RankStream:
    """Rank `rank` of `world_size`'s rows for every step from `from_step` on.

    `next_step()` returns global_batch/world_size rows and adds the time it waited for them
    to `wait_s`."""

    def __init__(self, datasets: list[Dataset], cfg: Config, rank: int, world_size: int, from_step: int) -> None:
        self.datasets = datasets
        self.cfg = cfg
        self.rank = rank
        self.world_size = world_size
        self.sources = [d.source for d in datasets]
        self.steps_per_epoch = plan_epoch(self.sources, cfg.train.global_batch_size, cfg.train.seed, 0).steps
        self.streams = rank_streams(rank, world_size, cfg.train.global_batch_size)
        self.step = from_step
        self.wait_s = 0.0
        self._epoch = -1
        self._blocks: Iterator[dict] = iter(())
        self._pending: dict[int, dict[int, tuple]] = {}

    def _start_epoch(self, epoch: int, step_in_epoch: int) -> None:
        cfg = self.cfg
        plan = plan_epoch(self.sources, cfg.train.global_batch_size, cfg.train.seed, epoch)
        segments = rank_segments(plan, self.rank, self.world_size, cfg.train.global_batch_size, step_in_epoch)
        ds = epoch_dataset(self.datasets, segments, cfg.train.seed, epoch, cfg.data.seq_len, cfg.data.read_cpus, cfg.storage)
        batches = ds.iter_batches(batch_size=None, batch_format="numpy", prefetch_batches=cfg.data.prefetch_blocks)
        self._blocks = iter(batches)
        self._pending = {stream: {} for stream in self.streams}
        self._epoch = epoch

    def _take(self, stream: int, step: int) -> tuple:
        """(sample id, tokens) of the stream's row for `step`. A row group shared by two
        streams arrives when the first of them needs it, so rows can come ahead of their
        turn: they wait here, keyed by step."""
        pending = self._pending[stream]
        while step not in pending:
            try:
                block = next(self._blocks)
            except Exception as e:
                # Ray Data re-raises a read task's error wrapped in its own; the shard's
                # message survives only as text.
                corrupt = re.search(rf"{ShardCorrupt.__name__}: (shard .*)", "".join(traceback.format_exception(e)))
                if corrupt:
                    raise ShardCorrupt(corrupt[1]) from None
                raise
            for row_stream, row_step, sample_id, tokens in zip(block[STREAM], block[STEP], block[SAMPLE_IDS], block[TOKENS]):
                self._pending[int(row_stream)][int(row_step)] = (sample_id, tokens)
        return pending.pop(step)

    def next_step(self) -> Step:
        started = time.perf_counter()
        epoch, step_in_epoch = split_step(self.step, self.steps_per_epoch)
        if epoch != self._epoch:
            self._start_epoch(epoch, step_in_epoch)
        rows = [self._take(stream, step_in_epoch) for stream in self.streams]
        self.step += 1
        self.wait_s += time.perf_counter() - started
        return Step(np.array([i for i, _ in rows]), np.stack([t for _, t in rows]))
