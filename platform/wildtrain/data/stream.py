"""A rank's training rows, streamed from object storage through Ray Data, step by step.

What a rank reads and in which order is decided by `data.order` (a pure function of the step,
so a restart at any world size resumes exactly); this module does the reading. Every epoch
becomes one Ray Data dataset built from a `Datasource` whose read tasks each read a run of
the row groups the rank needs, in the order it first needs them: the manifests already know
every shard's row groups and row counts, so Ray Data starts without listing files or reading
Parquet footers up front. A read task fetches its row groups straight from the object store
(no copy to local disk, a few shards at a time), permutes each as the order says, and
yields one block of the rank's rows tagged with their stream and step. Ray Data runs the
reads ahead of training within `data.read_cpus` (in order, `preserve_order` on this
dataset's own context); `RankStream` files each block's rows as runs of consecutive steps
per stream and hands out a step's rows, one per stream, as training asks for them.

Memory per rank: about one row group per stream the rank owns, plus `data.prefetch_blocks`
read tasks' blocks; near an epoch's end, once its rows are all read, as much again for the
next epoch's reads, begun then so that crossing into it waits for no start.
"""

from __future__ import annotations

import re
import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Iterator, Optional

import numpy as np

from wildtrain import storage
from wildtrain.config import DataConfig, StorageConfig, TrainConfig
from wildtrain.data.manifest import DataError, ShardCorrupt
from wildtrain.data.order import (
    Segment,
    Source,
    Unit,
    epoch_steps,
    plan_epoch,
    rank_segments,
    rank_streams,
    row_order,
    split_step,
)

STREAM, STEP, TOKENS, DOC_IDS, SAMPLE_IDS = "stream", "step", "tokens", "doc_ids", "sample_ids"


def columns(doc_ids: bool) -> tuple[str, ...]:
    """What a read task reads of each row: the tokens, and the document of each only for
    document-based masks and the objectives that build one example per document (reading
    them doubles the bytes of a plain causal run)."""
    return (TOKENS, DOC_IDS) if doc_ids else (TOKENS,)


# Tokens one read task reads, in bytes. Opening a shard (a HEAD and a footer read) and
# starting a Ray task each cost about as much as reading a row group, so a task reads many
# (bench/data_throughput.py; docs/benchmarks.md, data).
READ_TASK_BYTES = 16 << 20
# Shards a read task reads at once. A task spends most of its wall time waiting on the
# store (docs/benchmarks.md, data), so a few requests in flight keep its one CPU busy.
READ_THREADS = 4


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


def read_units(
    datasets: list[Dataset],
    units: list[list[Segment]],
    seed: int,
    epoch: int,
    seq_len: int,
    read: tuple[str, ...],
    config: StorageConfig,
):
    """One block of a read task's units, each a list of the segments read from it: per row,
    its stream, the step (in the epoch) that trains on it, its sample id, and its `read`
    columns (see `columns`) as (seq_len+1) int32s each. Each row group is read once, even
    where two of the rank's streams meet in it."""
    import pyarrow as pa
    from ray.data.extensions import ArrowTensorArray

    by_shard: dict[tuple[int, int], dict[int, Unit]] = {}  # a row group repeated in the epoch is read once
    for segments in units:
        unit = segments[0].unit
        by_shard.setdefault((unit.source, unit.shard), {})[unit.row_group] = unit
    groups = {}
    with ThreadPoolExecutor(READ_THREADS) as pool:
        for done in pool.map(
            partial(_read_row_groups, datasets, seq_len, read, config), [list(g.values()) for g in by_shard.values()]
        ):
            groups.update(done)
    # Each row group's rows go, permuted, straight into the block: one copy of the tokens.
    rows_in_block = sum(s.stop - s.start for segments in units for s in segments)
    arrays = {name: np.empty((rows_in_block, seq_len + 1), np.int32) for name in read}
    columns: list[tuple[np.ndarray, ...]] = []
    at = 0
    for segments in units:
        unit = segments[0].unit
        order = row_order(unit, seed, epoch)
        rows = np.concatenate([order[s.start : s.stop] for s in segments])
        for name, group in zip(read, groups[unit.source, unit.shard, unit.row_group]):
            np.take(group, rows, axis=0, out=arrays[name][at : at + len(rows)])
        at += len(rows)
        first_row = sum(datasets[unit.source].source.row_groups[unit.shard][: unit.row_group])
        columns.append(
            (
                np.concatenate([np.full(s.stop - s.start, s.stream, dtype=np.int32) for s in segments]),
                np.concatenate(
                    [np.arange(s.first_step, s.first_step + s.stop - s.start, dtype=np.int32) for s in segments]
                ),
                sample_ids(unit.source, unit.shard, first_row + rows),
            )
        )
    streams, steps, ids = (np.concatenate(c) for c in zip(*columns))
    yield pa.table(
        {
            STREAM: streams,
            STEP: steps,
            SAMPLE_IDS: ids,
            **{name: ArrowTensorArray.from_numpy(array) for name, array in arrays.items()},
        }
    )


def _read_row_groups(
    datasets: list[Dataset], seq_len: int, read: tuple[str, ...], config: StorageConfig, units: list[Unit]
) -> dict:
    """{(source, shard, row group): its `read` columns as (rows, seq_len+1) int32 each} for units
    of one shard, opened (a HEAD and a footer read) once for all of them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    dataset = datasets[units[0].source]
    uri = storage.join(dataset.root, dataset.shard_paths[units[0].shard])
    groups = {}
    unit = units[0]
    try:
        with storage.errors(uri, config):
            fs, path = storage.filesystem(uri, config)
            parquet = pq.ParquetFile(fs.open_input_file(path))
            for unit in units:
                table = parquet.read_row_group(unit.row_group, columns=list(read))
                if len(table) != unit.size:
                    raise ShardCorrupt(
                        f"shard {uri}: row group {unit.row_group} has {len(table)} rows, the manifest says {unit.size}"
                    )
                groups[unit.source, unit.shard, unit.row_group] = tuple(
                    table.column(name).combine_chunks().flatten().to_numpy().reshape(len(table), seq_len + 1)
                    for name in read
                )
    except (OSError, pa.ArrowException) as e:
        gone = isinstance(e.__cause__, FileNotFoundError) or isinstance(e, FileNotFoundError)
        # A store that does not answer may answer the restarted group; a shard that is gone
        # or no longer Parquet will not be back.
        error = ShardCorrupt if gone or not isinstance(e, OSError) else DataError
        raise error(f"shard {uri}: row group {unit.row_group} unreadable: {e}") from None
    return groups


def task_units(units: list[list[Segment]], row_bytes: int, task_bytes: int) -> list[list[list[Segment]]]:
    """The units (each the list of segments read from it), in the order given, cut into
    consecutive lists of at least `task_bytes` of rows (but the last): one read task each."""
    tasks: list[list[list[Segment]]] = []
    held = task_bytes
    for segments in units:
        if held >= task_bytes:
            tasks.append([])
            held = 0
        tasks[-1].append(segments)
        held += sum(s.stop - s.start for s in segments) * row_bytes
    return tasks


def epoch_dataset(
    datasets: list[Dataset],
    segments: list[Segment],
    seed: int,
    epoch: int,
    seq_len: int,
    read: tuple[str, ...],
    read_cpus: float,
    prefetch_blocks: int,
    config: StorageConfig,
):
    """The rank's segments as a Ray Data dataset: read tasks of several units each, in the
    order the rank first needs each unit, together using at most `read_cpus` CPUs."""
    import ray.data
    from ray.data.block import BlockMetadata
    from ray.data.datasource import Datasource, ReadTask

    by_unit: dict = {}
    for segment in segments:  # in the order they are needed: dicts keep first insertion
        by_unit.setdefault(segment.unit, []).append(segment)
    row_bytes = (seq_len + 1) * 4 * len(read)
    tasks = task_units(list(by_unit.values()), row_bytes, READ_TASK_BYTES)

    class Units(Datasource):
        def estimate_inmemory_data_size(self) -> int:
            return sum(s.stop - s.start for s in segments) * row_bytes

        def get_read_tasks(self, parallelism: int, per_task_row_limit=None, data_context=None) -> list[ReadTask]:
            read_tasks = []
            for units in tasks:
                rows = sum(s.stop - s.start for segments in units for s in segments)
                read_block = partial(read_units, datasets, units, seed, epoch, seq_len, read, config)
                read_tasks.append(
                    ReadTask(
                        read_block,
                        BlockMetadata(num_rows=rows, size_bytes=rows * row_bytes, exec_stats=None, input_files=None),
                    )
                )
            return read_tasks

    ds = ray.data.read_datasource(Units(), num_cpus=read_cpus, override_num_blocks=max(1, len(tasks)))
    # This dataset's own context copy: rows in read-task order; the rank's reads within the
    # CPUs the run set aside for them (`elastic.data_cpus`); and no progress bars or
    # execution plans, which would bury the run's progress lines (the data wait is a step
    # metric instead).
    ds.context.execution_options.preserve_order = True
    ds.context.execution_options.resource_limits = ray.data.ExecutionResources(
        cpu=read_cpus, object_store_memory=prefetch_blocks * READ_TASK_BYTES
    )
    ds.context.enable_progress_bars = False
    ds.context.print_on_execution_start = False
    return ds


@dataclass(frozen=True)
class Step:
    """One rank's share of one optimizer step."""

    step: int  # the run's step (from 0) that trains on these rows
    sample_ids: np.ndarray  # (rows,) see `sample_ids`
    tokens: np.ndarray  # (rows, seq_len + 1) int32
    doc_ids: Optional[np.ndarray]  # (rows, seq_len + 1) int32, when the stream reads them


@dataclass(frozen=True)
class _Run:
    """A stream's rows for consecutive steps from `first_step` on, as one block holds them."""

    first_step: int
    sample_ids: np.ndarray
    tokens: np.ndarray
    doc_ids: Optional[np.ndarray]

    def holds(self, step: int) -> bool:
        return self.first_step <= step < self.first_step + len(self.sample_ids)


def _runs(streams: np.ndarray, steps: np.ndarray) -> list[tuple[int, int]]:
    """[start, stop) of each stretch of a block's rows that one stream trains on at
    consecutive steps."""
    breaks = np.flatnonzero((np.diff(streams) != 0) | (np.diff(steps) != 1)) + 1
    bounds = [0, *breaks.tolist(), len(streams)]
    return list(zip(bounds[:-1], bounds[1:]))


def warm_up(datasets: list[Dataset], data: DataConfig, train: TrainConfig, config: StorageConfig) -> None:
    """Read the first step's rows of a world of one, and drop them. A process's first read
    through Ray Data takes seconds (its imports, the executor's start, worker processes for
    the read tasks) where a read after it takes milliseconds: a worker that joins a running group
    does this before it asks to join, not while the members wait for its first step."""
    stream = RankStream(datasets, data, train, config, 0, 1, 0, doc_ids=False)
    # The first step's rows taken from its epoch's reads, not by `next_step`, which would begin the next epoch's.
    reads = stream._open(0, 0)
    try:
        for row in stream.streams:
            reads.take(row, 0)
    finally:
        reads.close()


def warm_up_ahead(datasets: list[Dataset], data: DataConfig, train: TrainConfig, config: StorageConfig) -> Future:
    """`warm_up`, begun in a thread of its own: the future of its end."""
    return _in_a_thread("wildtrain-first-read", warm_up, datasets, data, train, config)


def _in_a_thread(name: str, read, *args) -> Future:
    """`read(*args)` in a new thread named `name`, which ends with it: its future."""
    pool = ThreadPoolExecutor(1, thread_name_prefix=name)
    reading = pool.submit(read, *args)
    pool.shutdown(wait=False)
    return reading


class _EpochReads:
    """A rank's reads of one epoch, from one of its steps on: the blocks as Ray Data yields them,
    and their rows filed as runs by stream and first step until training takes them."""

    def __init__(self, epoch: int, blocks: Iterator[dict], streams: range, rows: int) -> None:
        self.epoch = epoch
        self._blocks = blocks
        self._current: dict[int, _Run] = {}
        self._pending: dict[int, dict[int, _Run]] = {stream: {} for stream in streams}
        self._unfiled = rows  # the rank's rows of the epoch no block has brought yet

    @property
    def all_in(self) -> bool:
        """Whether every row the rank trains on this epoch is filed: its reads are over."""
        return self._unfiled == 0

    def next_block(self) -> None:
        """File the next block's rows as runs, keyed by stream and first step."""
        try:
            block = next(self._blocks)
        except Exception as e:
            # Ray Data re-raises a read task's error wrapped in its own; the shard's
            # message survives only as text.
            corrupt = re.search(rf"{ShardCorrupt.__name__}: (shard .*)", "".join(traceback.format_exception(e)))
            if corrupt:
                raise ShardCorrupt(corrupt[1]) from None
            raise
        streams, steps = block[STREAM], block[STEP]
        for start, stop in _runs(streams, steps):
            run = _Run(
                int(steps[start]),
                block[SAMPLE_IDS][start:stop],
                block[TOKENS][start:stop],
                block[DOC_IDS][start:stop] if DOC_IDS in block else None,
            )
            self._pending[int(streams[start])][run.first_step] = run
        self._unfiled -= len(streams)

    def take(self, stream: int, step: int) -> tuple:
        """(sample id, tokens, doc_ids) of the stream's row for `step`. A row group shared by two
        streams arrives when the first of them needs it, so rows can come ahead of their
        turn: they wait here, keyed by the step they start at."""
        run = self._current.get(stream)
        if run is None or not run.holds(step):
            pending = self._pending[stream]
            while step not in pending:
                self.next_block()
            run = self._current[stream] = pending.pop(step)
        at = step - run.first_step
        return run.sample_ids[at], run.tokens[at], None if run.doc_ids is None else run.doc_ids[at]

    def close(self) -> None:
        """Stop the epoch's reads now: Ray Data shuts its executor down then rather than when the
        iterator is collected."""
        close = getattr(self._blocks, "close", None)
        if close is not None:
            close()
        self._blocks = iter(())


def _close_when_read(opening: Future) -> None:
    """Close the epoch reads `opening` returns, once it has; an opening that failed has none."""
    if opening.exception() is None:
        opening.result().close()


class RankStream:
    """Rank `rank` of `world_size`'s rows for every step from `from_step` on.

    `next_step()` returns global_batch/world_size rows (with their doc_ids if `doc_ids`) and
    adds the time it waited for them to `wait_s`. Reading begins with the first `next_step()`,
    or before it with `start()`. Once an epoch's reads are over, the next epoch's begin in the
    background, so that crossing into it waits for nothing: ahead by at most its first block
    and `data.prefetch_blocks` read tasks."""

    def __init__(
        self,
        datasets: list[Dataset],
        data: DataConfig,
        train: TrainConfig,
        config: StorageConfig,
        rank: int,
        world_size: int,
        from_step: int,
        *,
        doc_ids: bool,
    ) -> None:
        self.datasets = datasets
        self.read = columns(doc_ids)
        self.data, self.train, self.config = data, train, config
        self.rank = rank
        self.world_size = world_size
        self.sources = [d.source for d in datasets]
        self.steps_per_epoch = epoch_steps(self.sources, train.global_batch_size)
        self.streams = rank_streams(rank, world_size, train.global_batch_size)
        self.step = from_step
        self.wait_s = 0.0
        self._reads: Optional[_EpochReads] = None
        # The reads of the epoch `next_step` enters next, opening in a thread of their own.
        self._ahead: Optional[Future] = None

    def start(self) -> None:
        """Begin reading the first step's rows in the background, while the caller does other
        work (builds its engine): Ray Data takes a second or two to start an epoch's reads,
        which the first `next_step()` would otherwise wait for."""
        self._ahead = _in_a_thread("rank-stream-start", self._open, *split_step(self.step, self.steps_per_epoch))

    def _open(self, epoch: int, step_in_epoch: int) -> _EpochReads:
        """The rank's reads of `epoch` from `step_in_epoch` on, with their first block in."""
        data, train = self.data, self.train
        plan = plan_epoch(self.sources, train.global_batch_size, train.seed, epoch)
        segments = rank_segments(plan, self.rank, self.world_size, train.global_batch_size, step_in_epoch)
        ds = epoch_dataset(
            self.datasets,
            segments,
            train.seed,
            epoch,
            data.seq_len,
            self.read,
            data.read_cpus,
            data.prefetch_blocks,
            self.config,
        )
        # No prefetch here: Ray Data's iterator holds back the first batch until its prefetch
        # window is full, which every restart would wait for; the executor reads ahead anyway.
        batches = ds.iter_batches(batch_size=None, batch_format="numpy", prefetch_batches=0)
        reads = _EpochReads(epoch, iter(batches), self.streams, len(self.streams) * (plan.steps - step_in_epoch))
        try:
            reads.next_block()
        except BaseException:
            reads.close()
            raise
        return reads

    def _enter(self, epoch: int, step_in_epoch: int) -> None:
        """Make `epoch`'s reads the stream's: those begun ahead (their error is the stream's), or
        begun now."""
        if self._reads is not None:
            self._reads.close()  # the last epoch's, which may still run ahead
        self._reads = None
        ahead, self._ahead = self._ahead, None
        self._reads = ahead.result() if ahead is not None else self._open(epoch, step_in_epoch)

    def close(self) -> None:
        """Stop reading: Ray Data shuts the epoch's executor down now rather than when its
        iterator is collected (a group re-formed at another size in the same process reads
        through a new stream, and the old one would read ahead meanwhile). Reads begun in the
        background are not waited for: they stop once their first block is in."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead.add_done_callback(_close_when_read)
        if self._reads is not None:
            self._reads.close()
            self._reads = None

    def next_step(self) -> Step:
        started = time.perf_counter()
        epoch, step_in_epoch = split_step(self.step, self.steps_per_epoch)
        if self._reads is None or self._reads.epoch != epoch:
            self._enter(epoch, step_in_epoch)
        reads = self._reads
        ids, tokens, doc_ids = zip(*(reads.take(stream, step_in_epoch) for stream in self.streams))
        if self._ahead is None and reads.all_in:
            # The epoch's reads are over: the next epoch's begin while its rows last.
            self._ahead = _in_a_thread("rank-stream-ahead", self._open, epoch + 1, 0)
        step = Step(self.step, np.array(ids), np.stack(tokens), None if doc_ids[0] is None else np.stack(doc_ids))
        self.step += 1
        self.wait_s += time.perf_counter() - started
        return step
