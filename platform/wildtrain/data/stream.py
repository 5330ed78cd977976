"""A rank's training rows, streamed from object storage through Ray Data, step by step.

What a rank reads and in which order is decided by `data.order` (a pure function of the step,
so a restart at any world size resumes exactly); this module does the reading. Every epoch
becomes one Ray Data dataset built from a `Datasource` with one read task per segment: the
manifests already know every shard's row groups and row counts, so Ray Data starts without
listing files or reading Parquet footers, and a read task fetches one row group straight from
the object store (no copy to local disk), permutes it as the order says, and yields the
segment's rows tagged with their stream. Ray Data runs the reads ahead of training (in order,
`preserve_order` on this dataset's own context); `RankStream` routes rows into one queue per
stream and hands out a step's rows, one per stream, as training asks for them.

Memory per rank: about one row group per stream the rank owns, plus Ray Data's prefetch.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from functools import partial
from typing import Iterator

import numpy as np

from wildtrain import storage
from wildtrain.data.order import Segment, Source, plan_epoch, rank_segments, rank_streams, row_order, split_step

STREAM, TOKENS = "stream", "tokens"


@dataclass(frozen=True)
class Dataset:
    """A prepared dataset the run reads: where it is, its shards, and its share of the mixture."""

    root: str
    shard_paths: tuple[str, ...]  # relative to root, in manifest order
    source: Source


def read_segment(dataset: Dataset, segment: Segment, seed: int, epoch: int, seq_len: int):
    """The rows of one segment as one block: stream id, and tokens (rows × seq_len+1)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from ray.data.extensions import ArrowTensorArray

    unit = segment.unit
    uri = storage.join(dataset.root, dataset.shard_paths[unit.shard])
    fs, path = storage.filesystem(uri)
    with fs.open_input_file(path) as f:
        column = pq.ParquetFile(f).read_row_group(unit.row_group, columns=[TOKENS]).column(TOKENS).combine_chunks()
    tokens = column.flatten().to_numpy().reshape(len(column), seq_len + 1)
    rows = row_order(unit, seed, epoch)[segment.start : segment.stop]
    yield pa.table({
        STREAM: pa.array(np.full(len(rows), segment.stream, dtype=np.int32)),
        TOKENS: ArrowTensorArray.from_numpy(tokens[rows].astype(np.int64)),
    })


def epoch_dataset(datasets: list[Dataset], segments: list[Segment], seed: int, epoch: int, seq_len: int, read_cpus: float):
    import ray.data
    from ray.data.block import BlockMetadata
    from ray.data.datasource import Datasource, ReadTask

    row_bytes = (seq_len + 1) * 8

    class Segments(Datasource):
        def estimate_inmemory_data_size(self) -> int:
            return sum(s.stop - s.start for s in segments) * row_bytes

        def get_read_tasks(self, parallelism: int, per_task_row_limit=None, data_context=None) -> list[ReadTask]:
            return [
                ReadTask(
                    partial(read_segment, datasets[s.unit.source], s, seed, epoch, seq_len),
                    BlockMetadata(num_rows=s.stop - s.start, size_bytes=(s.stop - s.start) * row_bytes,
                                  exec_stats=None, input_files=None),
                )
                for s in segments
            ]

    ds = ray.data.read_datasource(Segments(), num_cpus=read_cpus)
    ds.context.execution_options.preserve_order = True  # this dataset's own context copy
    return ds


class RankStream:
    """Rank `rank` of `world_size`'s rows for every step from `from_step` on.

    `next_step()` returns the rows (global_batch/world_size × seq_len+1) and adds the time it
    waited for them to `wait_s`."""

    def __init__(self, datasets: list[Dataset], seq_len: int, global_batch_size: int, seed: int,
                 rank: int, world_size: int, from_step: int, read_cpus: float = 0.5, prefetch_blocks: int = 8) -> None:
        self.datasets = datasets
        self.seq_len = seq_len
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.read_cpus = read_cpus
        self.prefetch_blocks = prefetch_blocks
        self.sources = [d.source for d in datasets]
        self.steps_per_epoch = plan_epoch(self.sources, global_batch_size, seed, 0).steps
        self.streams = rank_streams(rank, world_size, global_batch_size)
        self.step = from_step
        self.wait_s = 0.0
        self._epoch = -1
        self._blocks: Iterator[dict] = iter(())
        self._queues: dict[int, deque] = {}

    def _start_epoch(self, epoch: int, step_in_epoch: int) -> None:
        plan = plan_epoch(self.sources, self.global_batch_size, self.seed, epoch)
        segments = rank_segments(plan, self.rank, self.world_size, self.global_batch_size, step_in_epoch)
        ds = epoch_dataset(self.datasets, segments, self.seed, epoch, self.seq_len, self.read_cpus)
        self._blocks = iter(ds.iter_batches(batch_size=None, batch_format="numpy", prefetch_batches=self.prefetch_blocks))
        self._queues = {stream: deque() for stream in self.streams}
        self._epoch = epoch

    def _fill(self, stream: int) -> None:
        while not self._queues[stream]:
            block = next(self._blocks)
            streams, tokens = block[STREAM], block[TOKENS]
            # Rows of one stream arrive in order; a block may hold several streams' rows.
            for s in np.unique(streams):
                self._queues[int(s)].extend(tokens[streams == s])

    def next_step(self) -> np.ndarray:
        started = time.perf_counter()
        epoch, step_in_epoch = split_step(self.step, self.steps_per_epoch)
        if epoch != self._epoch:
            self._start_epoch(epoch, step_in_epoch)
        rows = []
        for stream in self.streams:
            self._fill(stream)
            rows.append(self._queues[stream].popleft())
        self.step += 1
        self.wait_s += time.perf_counter() - started
        return np.stack(rows)
