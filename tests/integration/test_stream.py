"""RankStream reads, through Ray Data, exactly the rows the pure data order names: for every
rank at several world sizes, and from the middle of an epoch into the next one."""

from __future__ import annotations

import threading

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.helpers.waiting import wait_for
from wildtrain.config import Config
from wildtrain.data import stream
from wildtrain.data.order import Source, plan_epoch, rank_segments, row_order
from wildtrain.data.stream import Dataset, RankStream, sample_ids

pytestmark = pytest.mark.integration

SEQ_LEN = 7
GLOBAL_BATCH = 4
SEED = 11
ROW_GROUPS = ((5, 5, 3), (6, 2))  # rows per row group, per shard: 21 rows, 5 steps per epoch
ROW_BYTES = (SEQ_LEN + 1) * 4


def _write(root, row_groups: tuple[tuple[int, ...], ...]) -> Dataset:
    """Shards whose token rows encode (shard, row): row i of shard s is all s*1000+i."""
    paths = []
    for shard, groups in enumerate(row_groups):
        rows = sum(groups)
        tokens = np.repeat(shard * 1000 + np.arange(rows, dtype=np.int32)[:, None], SEQ_LEN + 1, axis=1)
        documents = np.zeros_like(tokens)  # one document per row, as `prepare` writes short ones
        table = pa.table(
            {
                "tokens": pa.array(list(tokens), type=pa.list_(pa.int32())),
                "doc_ids": pa.array(list(documents), type=pa.list_(pa.int32())),
            }
        )
        path = f"shard-{shard:05d}.parquet"
        with pq.ParquetWriter(root / path, table.schema) as writer:
            start = 0
            for size in groups:
                writer.write_table(table.slice(start, size))
                start += size
        assert pq.ParquetFile(root / path).metadata.num_row_groups == len(groups)
        paths.append(path)
    return Dataset(str(root), tuple(paths), Source(row_groups))


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Dataset:
    return _write(tmp_path_factory.mktemp("stream"), ROW_GROUPS)


def _config() -> Config:
    cfg = Config()
    cfg.data.seq_len, cfg.train.global_batch_size, cfg.train.seed = SEQ_LEN, GLOBAL_BATCH, SEED
    return cfg


def _sections(cfg: Config) -> tuple:
    """What a stream reads of the config: the data, train and storage sections."""
    return cfg.data, cfg.train, cfg.storage


def _expected(step: int, rank: int, world_size: int) -> np.ndarray:
    """The row ids (shard*1000 + row in shard) the order gives the rank at a run step."""
    plan = plan_epoch([Source(ROW_GROUPS)], GLOBAL_BATCH, SEED, 0)
    epoch, in_epoch = divmod(step, plan.steps)
    plan = plan_epoch([Source(ROW_GROUPS)], GLOBAL_BATCH, SEED, epoch)
    ids = []
    for segment in rank_segments(plan, rank, world_size, GLOBAL_BATCH, in_epoch):
        if segment.first_step != in_epoch:
            continue
        unit = segment.unit
        first_row_of_group = sum(ROW_GROUPS[unit.shard][: unit.row_group])
        ids.append(unit.shard * 1000 + first_row_of_group + row_order(unit, SEED, epoch)[segment.start])
    return np.array(ids)


# Read tasks of every unit alone, of a few units, and of the whole epoch: rows that arrive
# in one block or across several, ahead of their turn or just in time.
@pytest.mark.parametrize(
    "world_size,from_step,task_bytes", [(1, 0, 1), (2, 3, 3 * ROW_BYTES), (4, 4, stream.READ_TASK_BYTES)]
)
def test_every_rank_reads_the_rows_the_order_names(
    ray_cluster, dataset, monkeypatch, world_size, from_step, task_bytes
):
    monkeypatch.setattr(stream, "READ_TASK_BYTES", task_bytes)
    steps = 7  # across the end of the first epoch (5 steps)
    for rank in range(world_size):
        # doc_ids read only where asked for: a plain causal run reads half the bytes.
        with_doc_ids = world_size == 2
        reader = RankStream([dataset], *_sections(_config()), rank, world_size, from_step, doc_ids=with_doc_ids)
        for step in range(from_step, from_step + steps):
            rows = reader.next_step()
            assert rows.tokens.shape == (GLOBAL_BATCH // world_size, SEQ_LEN + 1)
            if with_doc_ids:
                assert rows.doc_ids.shape == rows.tokens.shape
            else:
                assert rows.doc_ids is None
            assert (rows.tokens == rows.tokens[:, :1]).all()
            expected = _expected(step, rank, world_size)
            np.testing.assert_array_equal(rows.tokens[:, 0], expected, err_msg=f"step {step} rank {rank}")
            shard, row = expected // 1000, expected % 1000
            np.testing.assert_array_equal(rows.sample_ids, sample_ids(0, shard, row))
        assert reader.wait_s > 0


def _executors() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("StreamingExecutor-")}


def test_a_closed_stream_stops_reading_ahead(ray_cluster, tmp_path, monkeypatch):
    # A read task per row group and room for one block ahead, over 800 row groups: reads go on
    # after the first steps, held back only by what training takes.
    monkeypatch.setattr(stream, "READ_TASK_BYTES", 1)
    cfg = _config()
    cfg.data.prefetch_blocks = 1
    before = _executors()
    reader = RankStream([_write(tmp_path, ((1,) * 400, (1,) * 400))], *_sections(cfg), 0, 2, 0, doc_ids=False)
    for _ in range(2):
        reader.next_step()
    reading = {t for t in _executors() - before if t.is_alive()}
    assert reading  # the epoch's reads, through Ray Data's executor
    # A group re-formed at another size in the same process reads through a new stream: the
    # old one must stop now, not when it is collected.
    reader.close()
    wait_for(lambda: not any(t.is_alive() for t in reading), "the closed stream's executor to stop")


def test_a_shard_that_goes_bad_mid_run_is_one_error_naming_it(ray_cluster, dataset, tmp_path):
    import shutil

    from wildtrain.data.manifest import ShardCorrupt

    copy = tmp_path / "copy"
    shutil.copytree(dataset.root, copy)
    broken = Dataset(str(copy), dataset.shard_paths, dataset.source)
    (copy / dataset.shard_paths[1]).write_bytes(b"not parquet any more")  # rewritten under the run
    reader = RankStream([broken], *_sections(_config()), 0, 1, 0, doc_ids=True)
    with pytest.raises(ShardCorrupt, match=rf"^shard {copy}/shard-00001.parquet: row group \d unreadable"):
        for _ in range(5):  # one epoch reads every shard
            reader.next_step()


def _starts() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("rank-stream-start")}


def test_a_started_stream_reads_before_its_first_step_is_asked_for(ray_cluster, tmp_path, monkeypatch):
    # A re-formed group starts its stream before it builds its engine: the same rows, read meanwhile.
    monkeypatch.setattr(stream, "READ_TASK_BYTES", 1)
    cfg = _config()
    cfg.data.prefetch_blocks = 1  # the reads stay held back, and their executor alive, until training takes rows
    data = _write(tmp_path, ((1,) * 400, (1,) * 400))
    before = _executors()
    started = RankStream([data], *_sections(cfg), 1, 2, 3, doc_ids=False)
    started.start()
    wait_for(lambda: any(t.is_alive() for t in _executors() - before), "the started stream's reads")
    plain = RankStream([data], *_sections(cfg), 1, 2, 3, doc_ids=False)
    for _ in range(4):
        expected, got = plain.next_step(), started.next_step()
        assert got.step == expected.step
        np.testing.assert_array_equal(got.sample_ids, expected.sample_ids)
        np.testing.assert_array_equal(got.tokens, expected.tokens)
    plain.close()
    started.close()


def test_a_stream_closed_while_it_starts_stops_reading(ray_cluster, tmp_path, monkeypatch):
    # An attempt dropped while it builds (a member lost mid re-form) closes a stream whose start still reads.
    monkeypatch.setattr(stream, "READ_TASK_BYTES", 1)
    cfg = _config()
    cfg.data.prefetch_blocks = 1
    before, starts_before = _executors(), _starts()
    reader = RankStream([_write(tmp_path, ((1,) * 400, (1,) * 400))], *_sections(cfg), 0, 2, 0, doc_ids=False)
    reader.start()
    reader.close()
    wait_for(lambda: not any(t.is_alive() for t in _starts() - starts_before), "the start to end")
    wait_for(lambda: not any(t.is_alive() for t in _executors() - before), "the closed stream's executor to stop")


def test_a_started_stream_raises_its_reading_error_at_the_first_step(ray_cluster, dataset, tmp_path):
    from wildtrain.data.manifest import ShardCorrupt

    broken = tmp_path / "broken"
    broken.mkdir()
    for path in dataset.shard_paths:
        (broken / path).write_bytes(b"not parquet")
    reader = RankStream(
        [Dataset(str(broken), dataset.shard_paths, dataset.source)], *_sections(_config()), 0, 1, 0, doc_ids=False
    )
    reader.start()
    with pytest.raises(ShardCorrupt, match=rf"^shard {broken}/shard-0000\d.parquet"):
        reader.next_step()


def test_a_warm_up_read_leaves_nothing_reading(ray_cluster, tmp_path, monkeypatch):
    # A joiner reads once before it asks to join; reads left running would compete with its training.
    monkeypatch.setattr(stream, "READ_TASK_BYTES", 1)
    cfg = _config()
    cfg.data.prefetch_blocks = 1
    before = _executors()
    data = _write(tmp_path, ((1,) * 400, (1,) * 400))
    stream.warm_up([data], *_sections(cfg))
    wait_for(lambda: not any(t.is_alive() for t in _executors() - before), "the warm-up's executor to stop")
    # It did read: a shard gone bad fails it.
    (tmp_path / data.shard_paths[0]).write_bytes(b"not parquet")
    from wildtrain.data.manifest import ShardCorrupt

    with pytest.raises(ShardCorrupt):
        stream.warm_up([data], *_sections(cfg))


def _opens(monkeypatch) -> list[tuple[int, int, str]]:
    """(epoch, step in epoch, thread) of every epoch's reads the streams open, once its first block is in."""
    opened, open_reads = [], RankStream._open

    def recorded(self, epoch, step_in_epoch):
        reads = open_reads(self, epoch, step_in_epoch)
        opened.append((epoch, step_in_epoch, threading.current_thread().name))
        return reads

    monkeypatch.setattr(RankStream, "_open", recorded)
    return opened


# A block for the whole epoch (read ahead from its first step), and a read task per unit (the
# epoch's last rows may arrive only at its last step).
@pytest.mark.parametrize("task_bytes", [ROW_BYTES, stream.READ_TASK_BYTES])
def test_the_next_epochs_first_rows_are_read_before_training_reaches_it(ray_cluster, dataset, monkeypatch, task_bytes):
    # Crossing into an epoch waited for Ray Data to start its reads: 123 times in a 15,000-step tiny run.
    monkeypatch.setattr(stream, "READ_TASK_BYTES", task_bytes)
    opened = _opens(monkeypatch)
    reader = RankStream([dataset], *_sections(_config()), 1, 2, 3, doc_ids=True)
    for step in range(3, 3 + 3 * 5):  # across three epochs' ends (5 steps each)
        epoch, in_epoch = divmod(step, 5)
        if in_epoch == 0:
            assert reader._ahead is not None, f"step {step}: the epoch's reads not begun"
            wait_for(reader._ahead.done, "the next epoch's first block")
            assert opened[-1][:2] == (epoch, 0) and opened[-1][2].startswith("rank-stream-ahead")
        rows = reader.next_step()
        np.testing.assert_array_equal(rows.tokens[:, 0], _expected(step, 1, 2), err_msg=f"step {step}")
    # The boundaries opened nothing in training's own thread: only the first epoch, mid-way.
    assert [(e, s) for e, s, thread in opened if not thread.startswith("rank-stream-")] == [(0, 3)]
    reader.close()


def _aheads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("rank-stream-ahead")}


def test_a_stream_closed_while_the_next_epoch_opens_stops_reading(ray_cluster, tmp_path, monkeypatch):
    # Reads of a few rows each, held back to one block: the second epoch's stay open until the stream is closed.
    monkeypatch.setattr(stream, "READ_TASK_BYTES", 1)
    cfg = _config()
    cfg.data.prefetch_blocks = 1
    before, aheads_before = _executors(), _aheads()
    reader = RankStream([_write(tmp_path, ((1,) * 20, (1,) * 20))], *_sections(cfg), 0, 2, 0, doc_ids=False)
    while reader._ahead is None:  # to the epoch's last rows (10 steps an epoch)
        reader.next_step()
    reader.close()
    wait_for(lambda: not any(t.is_alive() for t in _aheads() - aheads_before), "the next epoch's opening to end")
    wait_for(lambda: not any(t.is_alive() for t in _executors() - before), "every executor of the stream to stop")
