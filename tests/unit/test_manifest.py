"""The packed-dataset format: packing, shard encoding, the manifest and its verification
(on local files; tests/integration/test_prepare.py runs the same against SeaweedFS)."""

import hashlib
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given
from hypothesis import strategies as st

from wildtrain import storage
from wildtrain.data.manifest import (
    DataError,
    Manifest,
    encode_shard,
    read_manifest,
    verify,
    write_manifest,
)
from wildtrain.data.prepare import pack_rows

EOS = 0


def batches(*docs_per_batch: list[list[int]]) -> list[pa.ListArray]:
    return [pa.array(docs, pa.list_(pa.int32())) for docs in docs_per_batch]


def test_pack_rows_closes_documents_and_numbers_them():
    shards = list(pack_rows(batches([[1, 2, 3], [4, 5]], [[6, 7, 8, 9]]), seq_len=3, eos_id=EOS, rows_per_shard=2))
    # stream 1 2 3 0 | 4 5 0 6 | 7 8 9 0; documents 0 0 0 0 | 1 1 1 2 | 2 2 2 2
    assert [tokens.tolist() for tokens, _ in shards] == [[[1, 2, 3, 0], [4, 5, 0, 6]], [[7, 8, 9, 0]]]
    assert [doc_ids.tolist() for _, doc_ids in shards] == [[[0, 0, 0, 0], [1, 1, 1, 2]], [[2, 2, 2, 2]]]
    assert all(tokens.dtype == np.int32 and doc_ids.dtype == np.int32 for tokens, doc_ids in shards)


def test_pack_rows_drops_the_tail_that_fills_no_row():
    assert list(pack_rows(batches([[1, 2]]), seq_len=3, eos_id=EOS, rows_per_shard=2)) == []


@given(
    docs=st.lists(st.lists(st.integers(1, 1000), max_size=12), max_size=30),
    cuts=st.lists(st.integers(0, 30), max_size=5),
    seq_len=st.integers(1, 9),
    rows_per_shard=st.integers(1, 4),
)
def test_pack_rows_ignores_batch_boundaries(docs, cuts, seq_len, rows_per_shard):
    bounds = [0, *sorted(min(c, len(docs)) for c in cuts), len(docs)]
    split = batches(*(docs[a:b] for a, b in zip(bounds, bounds[1:])))

    def flat(parts):
        shards = list(pack_rows(parts, seq_len, EOS, rows_per_shard))
        assert all(len(tokens) == rows_per_shard for tokens, _ in shards[:-1])
        return [(tokens.tolist(), doc_ids.tolist()) for tokens, doc_ids in shards]

    assert flat(split) == flat(batches(docs))


def rows(n: int, row_len: int = 4, start: int = 0) -> tuple[np.ndarray, np.ndarray]:
    tokens = np.arange(start, start + n * row_len, dtype=np.int32).reshape(n, row_len)
    return tokens, tokens // 5


def test_encode_shard_is_deterministic_and_describes_itself():
    shard, data = encode_shard("shard-00000.parquet", *rows(10), rows_per_group=4)
    assert encode_shard("shard-00000.parquet", *rows(10), rows_per_group=4) == (shard, data)
    assert (shard.rows, shard.tokens, shard.bytes, shard.row_groups) == (10, 40, len(data), [4, 4, 2])
    assert shard.sha256 == hashlib.sha256(data).hexdigest()
    table = pq.read_table(pa.BufferReader(data))
    assert table.column("tokens").to_pylist() == rows(10)[0].tolist()
    assert table.column("doc_ids").to_pylist() == rows(10)[1].tolist()


@pytest.fixture
def dataset(tmp_path) -> tuple[str, Manifest]:
    """A valid three-shard dataset of seq_len 3 on local disk."""
    root = str(tmp_path / "ds")
    shards = []
    for i, n in enumerate((4, 4, 2)):
        shard, data = encode_shard(f"shard-{i:05d}.parquet", *rows(n, start=100 * i), rows_per_group=3)
        storage.write_bytes(storage.join(root, shard.path), data)
        shards.append(shard)
    manifest = Manifest(
        seq_len=3,
        tokenizer={"kind": "byte", "vocab_size": 257, "eos_id": 256},
        source="test",
        shards=shards,
        rows=10,
        tokens=40,
    )
    assert write_manifest(root, manifest)
    return root, manifest


def test_manifest_round_trips_and_verifies(dataset):
    root, manifest = dataset
    assert read_manifest(root) == manifest
    assert json.loads(storage.read_text(storage.join(root, "manifest.json")))["format"] == "wildtrain-packed-v1"
    verify(root, manifest)
    verify(root, manifest, check_checksums=False)


def test_writing_the_same_manifest_again_writes_nothing(dataset):
    root, manifest = dataset
    assert not write_manifest(root, manifest)
    manifest.source = "elsewhere"
    assert write_manifest(root, manifest)


def test_missing_manifest_and_malformed_manifest_are_named(tmp_path, dataset):
    with pytest.raises(DataError, match=r"nothing/manifest.json: no manifest"):
        read_manifest(str(tmp_path / "nothing"))
    root, _ = dataset
    storage.write_text(storage.join(root, "manifest.json"), json.dumps({"format": "wildtrain-packed-v1"}))
    with pytest.raises(DataError, match=r"manifest.json: not a wildtrain manifest \(no key 'shards'\)"):
        read_manifest(root)


def test_missing_shard_is_named(dataset):
    root, manifest = dataset
    (storage.filesystem(root)[0]).delete_file(storage.join(root, "shard-00001.parquet"))
    with pytest.raises(DataError, match=r"^shard shard-00001.parquet: missing"):
        verify(root, manifest, check_checksums=False)


def test_size_checksum_and_format_mismatches_are_named(dataset):
    root, manifest = dataset
    path = storage.join(root, "shard-00002.parquet")
    data = bytearray(storage.read_bytes(path))
    data[8] ^= 0xFF  # inside the first data page, far from the footer
    storage.write_bytes(path, bytes(data))
    verify(root, manifest, check_checksums=False)  # same size, footer intact: only the checksum tells
    with pytest.raises(DataError, match=r"^shard shard-00002.parquet: sha256 does not match"):
        verify(root, manifest)
    storage.write_bytes(path, bytes(len(data)))
    with pytest.raises(DataError, match=r"^shard shard-00002.parquet: not a readable Parquet file"):
        verify(root, manifest, check_checksums=False)
    storage.write_bytes(path, bytes(data[:-1]))
    with pytest.raises(
        DataError, match=rf"^shard shard-00002.parquet: {len(data) - 1} bytes, the manifest says {len(data)}"
    ):
        verify(root, manifest, check_checksums=False)


def test_wrong_schema_is_named(dataset):
    root, manifest = dataset
    sink = pa.BufferOutputStream()
    pq.write_table(pa.table({"tokens": pa.array([[1, 2, 3, 4]], pa.list_(pa.int64()))}), sink)
    data = sink.getvalue().to_pybytes()
    storage.write_bytes(storage.join(root, "shard-00002.parquet"), data)
    manifest.shards[2].bytes, manifest.shards[2].sha256 = len(data), hashlib.sha256(data).hexdigest()
    with pytest.raises(DataError, match=r"^shard shard-00002.parquet: schema is tokens: list<\w+: int64>, expected"):
        verify(root, manifest)


def test_rows_of_the_wrong_length_are_named(dataset):
    root, manifest = dataset
    shard, data = encode_shard("shard-00002.parquet", *rows(2, row_len=5), rows_per_group=3)
    storage.write_bytes(storage.join(root, shard.path), data)
    shard.tokens = 8  # what 2 rows of seq_len + 1 = 4 would hold: only the rows themselves tell
    manifest.shards[2] = shard
    with pytest.raises(DataError, match=r"^shard shard-00002.parquet: tokens rows must hold seq_len \+ 1 = 4 ids"):
        verify(root, manifest)
    manifest.shards[2].tokens, manifest.tokens = 10, 42
    with pytest.raises(DataError, match=r"^shard shard-00002.parquet: 10 tokens in the manifest, but 2 rows of 4"):
        verify(root, manifest)


def test_totals_that_do_not_match_the_shards_are_named(dataset):
    root, manifest = dataset
    manifest.rows = 11
    with pytest.raises(DataError, match=r"manifest.json: rows is 11, but the shards hold 10"):
        verify(root, manifest)


def test_empty_dataset_is_an_error(dataset):
    root, manifest = dataset
    manifest.shards, manifest.rows, manifest.tokens = [], 0, 0
    with pytest.raises(DataError, match=r"manifest.json: empty dataset"):
        verify(root, manifest)


def test_tokenizer_file_must_match_its_checksum(dataset):
    root, manifest = dataset
    manifest.tokenizer = {"kind": "hf", "vocab_size": 300, "eos_id": 0, "sha256": hashlib.sha256(b"{}").hexdigest()}
    with pytest.raises(DataError, match=r"tokenizer.json: missing"):
        verify(root, manifest)
    storage.write_text(storage.join(root, "tokenizer.json"), "{ }")
    with pytest.raises(DataError, match=r"tokenizer.json: sha256 does not match"):
        verify(root, manifest)
    storage.write_text(storage.join(root, "tokenizer.json"), "{}")
    verify(root, manifest)
