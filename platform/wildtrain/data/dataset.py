"""The run's datasets, opened from their manifests and checked before any worker starts.

Everything that can be wrong with prepared data is found here, on the driver, with the
dataset and shard named: a missing manifest, a seq_len or tokenizer that does not fit the
model, datasets of a mixture tokenized differently, a shard that is missing or does not
match its manifest, too few rows for one global batch. The workers then stream the shards
(`data.stream`) in the order `data.order` derives from the step.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from wildtrain import storage
from wildtrain.config import Config
from wildtrain.data.manifest import MANIFEST, DataError, Manifest, verify_shard
from wildtrain.data.objectives import Objective
from wildtrain.data.order import Source, plan_epoch
from wildtrain.data.stream import Dataset

__all__ = ["DataError", "OpenedData", "open_datasets"]


@dataclass
class OpenedData:
    datasets: list[Dataset]
    steps_per_epoch: int
    tokenizer: dict
    # "<dataset uri>/<shard>: <why>" for each shard left out (data.skip_bad_shards).
    skipped_shards: list[str] = field(default_factory=list)
    # sha256 of each dataset's manifest.json, in the order of `datasets`: the order of the
    # rows depends on the manifests, so the run record pins them (see `data.pins`).
    manifest_sha256: list[str] = field(default_factory=list)


def open_datasets(cfg: Config) -> OpenedData:
    datasets, skipped, tokenizer, hashes = [], [], None, []
    for index, spec in enumerate(cfg.data.datasets):
        key = f"data.datasets.{index}.uri"
        root = storage.resolve(spec.uri)
        text = storage.read_text(storage.join(root, MANIFEST), cfg.storage)
        if text is None:
            raise DataError(
                f"{key}: no {MANIFEST} at {root}; prepare the dataset first: "
                f"python data_pipelines/prepare.py --input <corpus> --output {spec.uri}"
            )
        manifest = Manifest.from_json(text, storage.join(root, MANIFEST))
        hashes.append(hashlib.sha256(text.encode()).hexdigest())
        _check_fits(cfg, key, manifest)
        if tokenizer is not None and manifest.tokenizer != tokenizer:
            raise DataError(f"{key}: tokenized with {manifest.tokenizer}, data.datasets.0 with {tokenizer}")
        tokenizer = manifest.tokenizer
        if spec.weight <= 0:
            raise DataError(f"data.datasets.{index}.weight: must be positive, got {spec.weight}")

        row_groups = []
        for shard in manifest.shards:
            try:
                verify_shard(root, shard, manifest.seq_len + 1, cfg.data.verify_checksums, cfg.storage)
                row_groups.append(tuple(shard.row_groups))
            except DataError as e:
                if not cfg.data.skip_bad_shards:
                    raise DataError(f"{key}: {e} (set data.skip_bad_shards=true to train without it)") from None
                skipped.append(f"{root}/{shard.path}: {e}")
                row_groups.append(())
        source = Source(tuple(row_groups), spec.weight)
        if source.rows == 0:
            raise DataError(f"{key}: no usable rows in {root}")
        datasets.append(Dataset(root, tuple(s.path for s in manifest.shards), source))

    Objective.of(cfg, tokenizer)  # the objective's reserved ids are in the tokenizer, or the run stops here
    steps = plan_epoch([d.source for d in datasets], cfg.train.global_batch_size, cfg.train.seed, 0).steps
    if steps == 0:
        rows = sum(d.source.rows for d in datasets)
        raise DataError(
            f"data.datasets: {rows} rows in all, fewer than one global batch "
            f"(train.global_batch_size={cfg.train.global_batch_size})"
        )
    return OpenedData(datasets, steps, tokenizer, skipped, hashes)


def _check_fits(cfg: Config, key: str, manifest: Manifest) -> None:
    if manifest.seq_len != cfg.data.seq_len:
        raise DataError(f"{key}: prepared with seq_len {manifest.seq_len}, but data.seq_len is {cfg.data.seq_len}")
    vocab = manifest.tokenizer["vocab_size"]
    if vocab > cfg.model.vocab_size:
        raise DataError(
            f"{key}: its {manifest.tokenizer['kind']} tokenizer has {vocab} ids, more than "
            f"model.vocab_size ({cfg.model.vocab_size})"
        )
