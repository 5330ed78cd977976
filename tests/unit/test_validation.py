"""Validation's pure parts: which documents are held out, which rows each rank scores, how
many forward passes each rank runs, and the metrics from the reduced sums."""

import math
import warnings

import numpy as np
import pyarrow as pa
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from wildtrain.config import load_config
from wildtrain.data.dataset import OpenedData
from wildtrain.data.manifest import Shard
from wildtrain.data.prepare import RowPacker, held_out, pack_rows
from wildtrain.data.tokenizer import ByteTokenizer
from wildtrain.data.validation import ValidationSet, names_for, rank_share, share_rows
from wildtrain.train.validation import Validator, batch_counts, metrics


def _set(name: str, groups: list[list[int]]) -> ValidationSet:
    return ValidationSet(
        name,
        f"s3://b/{name}",
        tuple(Shard(f"validation-{i:05d}.parquet", sum(g), 0, 0, "", g) for i, g in enumerate(groups)),
    )


def test_a_document_is_held_out_by_its_text_alone_and_the_share_is_the_fraction():
    texts = [f"document number {i}" for i in range(4000)]
    chosen = [t for t in texts if held_out(t, 0.1)]
    assert abs(len(chosen) / len(texts) - 0.1) < 0.02
    assert [t for t in reversed(texts) if held_out(t, 0.1)] == chosen[::-1]  # any order of the corpus
    assert not any(held_out(t, 0.0) for t in texts)


@given(
    world_size=st.integers(1, 7),
    groups=st.lists(st.lists(st.integers(1, 9), min_size=1, max_size=3), min_size=1, max_size=3),
)
def test_every_validation_row_is_scored_once_whatever_the_world_size(world_size, groups):
    sets = [_set("a", groups), _set("b", [[5], [2, 3]])]
    scored = []
    for rank in range(world_size):
        share = rank_share(sets, rank, world_size)
        scored += [(r.set, r.shard, r.group, row) for r in share for row in range(r.start, r.stop)]
        assert sum(r.stop - r.start for r in share) == share_rows(sets, world_size)[rank]
    every = [
        (i, j, k, row)
        for i, s in enumerate(sets)
        for j, shard in enumerate(s.shards)
        for k, rows in enumerate(shard.row_groups)
        for row in range(rows)
    ]
    assert scored == every
    assert max(share_rows(sets, world_size)) - min(share_rows(sets, world_size)) <= 1


def test_a_validator_takes_the_byte_table_read_only_as_ray_hands_it_over_and_warns_nothing():
    table = ByteTokenizer().token_bytes()
    table.flags.writeable = False  # as a worker unpickles it from Ray's object store
    data = OpenedData([], 1, ByteTokenizer().describe(), validation=[_set("a", [[3]])], token_bytes=table)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = load_config(["experiment=tiny"])
        micro_batch = cfg.eval.micro_batch_size or cfg.train.micro_batch_size
        validator = Validator(data, cfg.data.seq_len, micro_batch, cfg.storage, 0, 1, torch.device("cpu"))
    assert validator.token_bytes.tolist() == table.tolist()
    # Its own copy, never a view of the read-only buffer (torch warns of one only once a process).
    assert validator.token_bytes.data_ptr() != table.ctypes.data


def test_every_rank_runs_the_most_forward_passes_any_rank_needs():
    sets = [_set("a", [[3]]), _set("b", [[4]])]
    # 7 rows over 3 ranks: rank 0 scores 2 of a's rows, rank 1 a's last and b's first (one
    # pass each: a micro-batch holds one set's rows), rank 2 b's other 3.
    assert batch_counts(sets, 3, micro_batch=2) == [1, 1 + 1, 2]
    assert batch_counts(sets, 1, micro_batch=4) == [1 + 1]


def test_metrics_are_ratios_of_the_summed_loss_tokens_and_bytes():
    sums = np.array([[10.0, 5.0, 20.0], [30.0, 15.0, 60.0]])
    got = metrics(["a", "b"], sums)
    assert got["val/a/loss"] == 2.0 and got["val/b/loss"] == 2.0
    assert got["val/loss"] == 40.0 / 20.0
    assert got["val/bpb"] == pytest.approx(40.0 / math.log(2) / 80.0)
    assert got["val/a/bpb"] == pytest.approx(10.0 / math.log(2) / 20.0)


def test_datasets_are_named_by_their_folder_and_numbered_where_two_are_alike():
    assert names_for(["s3://b/web", "s3://b/code/"]) == ["web", "code"]
    assert names_for(["s3://a/tiny", "s3://b/tiny"]) == ["tiny0", "tiny1"]


def test_the_packer_fed_batch_by_batch_packs_as_pack_rows_does():
    docs = [pa.array([list(range(n)) for n in sizes], pa.list_(pa.int32())) for sizes in ([3, 5], [7], [2, 9, 4])]
    expected = list(pack_rows(docs, seq_len=4, eos_id=99, rows_per_shard=2))
    packer = RowPacker(4, 99, 2)
    got = [shard for batch in docs for shard in packer.add(batch)] + packer.finish()
    assert len(got) == len(expected)
    for (t, d), (et, ed) in zip(got, expected):
        assert np.array_equal(t, et) and np.array_equal(d, ed)
