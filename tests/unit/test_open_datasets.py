"""A run's data is checked before any worker starts, and every problem names its dataset
key and shard: local prepared datasets, no Ray."""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers.datasets import write_dataset
from wildtrain.config import ConfigError, load_config
from wildtrain.data.dataset import DataError
from wildtrain.driver import open_data

SEQ_LEN = 16


@pytest.fixture
def dataset(tmp_path):
    root = tmp_path / "data"
    rng = np.random.default_rng(0)
    write_dataset(root, [rng.integers(0, 256, (40, SEQ_LEN + 1), dtype=np.int32) for _ in range(3)], rows_per_group=8)
    return root


def _config(*datasets, extra=()):
    listed = ", ".join(f"{{uri: {uri}, weight: {weight}}}" for uri, weight in datasets)
    return load_config([f"data.datasets=[{listed}]", f"data.seq_len={SEQ_LEN}", "train.global_batch_size=8", *extra])


def test_a_good_dataset_opens_with_its_row_groups(dataset):
    opened = open_data(_config((dataset, 1)))
    (only,) = opened.datasets
    assert only.shard_paths == ("shard-00000.parquet", "shard-00001.parquet", "shard-00002.parquet")
    assert only.source.row_groups == ((8,) * 5,) * 3
    assert opened.steps_per_epoch == 120 // 8
    assert opened.tokenizer["kind"] == "byte" and not opened.skipped_shards


def test_seq_len_other_than_the_datasets_names_the_key(dataset):
    with pytest.raises(DataError, match=r"^data.datasets.0.uri: prepared with seq_len 16, but data.seq_len is 32"):
        open_data(_config((dataset, 1), extra=["data.seq_len=32", "model.max_seq_len=64"]))


def test_tokenizer_larger_than_the_model_names_the_key(dataset):
    with pytest.raises(
        DataError, match=r"^data.datasets.0.uri: its byte tokenizer has 320 ids, more than model.vocab_size \(200\)"
    ):
        open_data(_config((dataset, 1), extra=["model.vocab_size=200"]))


def test_missing_shard_names_it_or_is_skipped_when_configured(dataset):
    (dataset / "shard-00001.parquet").unlink()
    with pytest.raises(DataError, match=r"^data.datasets.0.uri: shard shard-00001.parquet: missing .*skip_bad_shards"):
        open_data(_config((dataset, 1)))
    opened = open_data(_config((dataset, 1), extra=["data.skip_bad_shards=true"]))
    assert opened.datasets[0].source.row_groups[1] == ()
    assert opened.steps_per_epoch == 80 // 8
    assert len(opened.skipped_shards) == 1 and "shard-00001.parquet: " in opened.skipped_shards[0]


def test_corrupt_shard_is_found_by_its_checksum(dataset):
    shard = dataset / "shard-00002.parquet"
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF  # same size: only the checksum can tell
    shard.write_bytes(bytes(data))
    open_data(_config((dataset, 1)))  # sizes and footers only: not noticed
    with pytest.raises(DataError, match=r"shard shard-00002.parquet: sha256 does not match the manifest"):
        open_data(_config((dataset, 1), extra=["data.verify_checksums=true"]))


def test_mixture_of_differently_tokenized_datasets_is_refused(dataset, tmp_path):
    other = tmp_path / "other"
    write_dataset(other, [np.zeros((16, SEQ_LEN + 1), dtype=np.int32)], rows_per_group=8)
    manifest = (other / "manifest.json").read_text().replace('"vocab_size": 320', '"vocab_size": 250')
    (other / "manifest.json").write_text(manifest)
    with pytest.raises(DataError, match=r"^data.datasets.1.uri: tokenized with"):
        open_data(_config((dataset, 1), (other, 1)))


def test_too_few_rows_for_one_global_batch(tmp_path):
    small = tmp_path / "small"
    write_dataset(small, [np.zeros((6, SEQ_LEN + 1), dtype=np.int32)], rows_per_group=8)
    with pytest.raises(DataError, match=r"^data.datasets: 6 rows in all, fewer than one global batch"):
        open_data(_config((small, 1)))


def test_weights_must_be_positive(dataset):
    # The config refuses it before anything opens (the weight's declaration in config/training.py).
    with pytest.raises(ConfigError, match=r"^data.datasets.0.weight: must be positive"):
        open_data(_config((dataset, 0)))


def test_held_out_shards_and_validation_datasets_are_the_validation_set(tmp_path, dataset):
    rng = np.random.default_rng(1)
    write_dataset(
        tmp_path / "web",
        [rng.integers(0, 256, (16, SEQ_LEN + 1), dtype=np.int32)],
        rows_per_group=8,
        validation=[rng.integers(0, 256, (5, SEQ_LEN + 1), dtype=np.int32)],
    )
    opened = open_data(_config((tmp_path / "web", 1), extra=[f"data.validation=[{{uri: {dataset}}}]"]))
    assert [(v.name, v.rows) for v in opened.validation] == [("web", 5), ("data", 120)]
    assert opened.token_bytes[:256].sum() == 256 and opened.token_bytes[256:].sum() == 0
    assert not open_data(_config((dataset, 1))).validation


def test_watching_the_validation_loss_without_a_validation_set_names_the_key(dataset):
    with pytest.raises(DataError, match=r"^early_stop.metric: val/loss needs a validation set"):
        open_data(_config((dataset, 1), extra=["early_stop.enabled=true", "early_stop.metric=val/loss"]))


def test_a_missing_validation_shard_stops_the_run_naming_it(tmp_path):
    rng = np.random.default_rng(1)
    write_dataset(
        tmp_path / "web",
        [rng.integers(0, 256, (16, SEQ_LEN + 1), dtype=np.int32)],
        rows_per_group=8,
        validation=[rng.integers(0, 256, (5, SEQ_LEN + 1), dtype=np.int32)],
    )
    (tmp_path / "web" / "validation-00000.parquet").unlink()
    with pytest.raises(DataError, match=r"^data.datasets.0.uri: shard validation-00000.parquet: missing"):
        open_data(_config((tmp_path / "web", 1)))
