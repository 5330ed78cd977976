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
from typing import Optional

import numpy as np

from wildtrain import storage
from wildtrain.config import DataConfig, ModelConfig, ObjectiveConfig, StorageConfig, TrainConfig
from wildtrain.data.manifest import MANIFEST, DataError, Manifest, Shard, verify_shard
from wildtrain.data.objectives import Objective
from wildtrain.data.order import Source, epoch_steps
from wildtrain.data.stream import Dataset
from wildtrain.data.tokenizer import dataset_tokenizer
from wildtrain.data.validation import ValidationSet, names_for

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
    # What every validation scores (data.validation): the datasets' held-out shards, then
    # the validation datasets, and the UTF-8 bytes each token id spells (for bits per byte).
    validation: list[ValidationSet] = field(default_factory=list)
    token_bytes: Optional[np.ndarray] = None
    # Records each dataset's preparation skipped as unreadable (its manifest's bad_records), in order.
    bad_records: list[int] = field(default_factory=list)

    @property
    def no_validation(self) -> Optional[str]:
        """The line a run without validation rows says at its start, where no val/loss would
        otherwise go missing silently; None when it has some."""
        if self.validation:
            return None
        return (
            "no validation set: the datasets hold out no documents and data.validation names none, so no "
            "val/loss is logged (prepare with --val-fraction above 0, or name data.validation)"
        )


def open_datasets(
    data: DataConfig,
    config: StorageConfig,
    *,
    model: ModelConfig,
    train: TrainConfig,
    objective: ObjectiveConfig,
    needs_validation: bool,
) -> OpenedData:
    """The datasets of `data` read with `config`, checked against what the rest of the run
    asks of them: token ids within `model.vocab_size`, the reserved ids of the objective
    (`Objective.of`), one global batch of `train` at least, and a validation set where
    `needs_validation` (early stopping on the validation loss)."""
    datasets, skipped, tokenizer, hashes, held_out, bad_records = [], [], None, [], [], []
    for index, spec in enumerate(data.datasets):
        key = f"data.datasets.{index}.uri"
        root, manifest, text = _manifest(config, key, spec.uri)
        hashes.append(hashlib.sha256(text.encode()).hexdigest())
        bad_records.append(sum(manifest.bad_records.values()))
        _check_fits(data, model, key, manifest)
        if tokenizer is not None and manifest.tokenizer != tokenizer:
            raise DataError(f"{key}: tokenized with {manifest.tokenizer}, data.datasets.0 with {tokenizer}")
        tokenizer = manifest.tokenizer
        if spec.weight <= 0:
            raise DataError(f"data.datasets.{index}.weight: must be positive, got {spec.weight}")

        row_groups = []
        for shard in manifest.shards:
            try:
                verify_shard(root, shard, manifest.seq_len + 1, data.verify_checksums, config)
                row_groups.append(tuple(shard.row_groups))
            except DataError as e:
                if not data.skip_bad_shards:
                    raise DataError(f"{key}: {e} (set data.skip_bad_shards=true to train without it)") from None
                skipped.append(f"{root}/{shard.path}: {e}")
                row_groups.append(())
        source = Source(tuple(row_groups), spec.weight)
        if source.rows == 0:
            raise DataError(f"{key}: no usable rows in {root}")
        datasets.append(Dataset(root, tuple(s.path for s in manifest.shards), source))
        if manifest.validation:
            held_out.append((root, _verified(data, config, key, root, manifest, manifest.validation)))

    for index, spec in enumerate(data.validation):
        key = f"data.validation.{index}.uri"
        root, manifest, _ = _manifest(config, key, spec.uri)
        _check_fits(data, model, key, manifest)
        if manifest.tokenizer != tokenizer:
            raise DataError(f"{key}: tokenized with {manifest.tokenizer}, the training data with {tokenizer}")
        held_out.append((root, _verified(data, config, key, root, manifest, manifest.shards + manifest.validation)))

    Objective.of(
        objective, train, model, tokenizer
    )  # the objective's reserved ids are in the tokenizer, or the run stops here
    steps = epoch_steps([d.source for d in datasets], train.global_batch_size)
    if steps == 0:
        rows = sum(d.source.rows for d in datasets)
        raise DataError(
            f"data.datasets: {rows} rows in all, fewer than one global batch "
            f"(train.global_batch_size={train.global_batch_size})"
        )
    if needs_validation and not held_out:
        raise DataError(
            "early_stop.metric: val/loss needs a validation set: prepare the data with --val-fraction, "
            "or name validation datasets in data.validation"
        )
    validation = [
        ValidationSet(name, root, tuple(shards))
        for name, (root, shards) in zip(names_for([root for root, _ in held_out]), held_out)
    ]
    token_bytes = dataset_tokenizer(datasets[0].root, tokenizer, config).token_bytes() if validation else None
    return OpenedData(datasets, steps, tokenizer, skipped, hashes, validation, token_bytes, bad_records)


def _manifest(config: StorageConfig, key: str, uri: str) -> tuple[str, Manifest, str]:
    root = storage.resolve(uri)
    text = storage.read_text(storage.join(root, MANIFEST), config)
    if text is None:
        raise DataError(
            f"{key}: no {MANIFEST} at {root}; prepare the dataset first: "
            f"python data_pipelines/prepare.py --input <corpus> --output {uri}"
        )
    return root, Manifest.from_json(text, storage.join(root, MANIFEST)), text


def _verified(
    data: DataConfig, config: StorageConfig, key: str, root: str, manifest: Manifest, shards: list[Shard]
) -> list[Shard]:
    """`shards`, each checked against the manifest: a validation shard that went bad stops
    the run (a validation set missing a part would not compare with the runs before)."""
    for shard in shards:
        try:
            verify_shard(root, shard, manifest.seq_len + 1, data.verify_checksums, config)
        except DataError as e:
            raise DataError(f"{key}: {e}") from None
    return shards


def _check_fits(data: DataConfig, model: ModelConfig, key: str, manifest: Manifest) -> None:
    if manifest.seq_len != data.seq_len:
        raise DataError(f"{key}: prepared with seq_len {manifest.seq_len}, but data.seq_len is {data.seq_len}")
    vocab = manifest.tokenizer["vocab_size"]
    if vocab > model.vocab_size:
        raise DataError(
            f"{key}: its {manifest.tokenizer['kind']} tokenizer has {vocab} ids, more than "
            f"model.vocab_size ({model.vocab_size})"
        )
