"""Training data: documents → token ids → packed sequences, read through Ray Data.

Every row is one packed sequence of `seq_len + 1` ids (inputs are the first `seq_len`,
targets the last `seq_len`); documents are joined with the tokenizer's end-of-document id
so no compute is spent on padding. The driver builds the dataset (`training_dataset`) and
Ray Train splits it evenly over the workers; each worker reads its split with
`micro_batches`, which also owns the worker's position in the data so a restart continues
within the epoch instead of starting it over.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from wildtrain.config import DataConfig
from wildtrain.data.tokenizer import get_tokenizer


class DataError(ValueError):
    pass


@dataclass
class DataPosition:
    epoch: int = 0
    # Micro-batches each worker has consumed of its split of `epoch`.
    micro_batches: int = 0


def find_documents(cfg: DataConfig) -> list[Path]:
    path = Path(cfg.path).expanduser().resolve()
    if path.is_dir():
        files = sorted(path.glob("*.jsonl"))
        if not files:
            raise DataError(f"data.path: no .jsonl files in {path}")
        return files
    if path.is_file():
        return [path]
    raise DataError(f"data.path: {cfg.path} does not exist (resolved to {path})")


def pack(documents: list[list[int]], seq_len: int, eos_id: int) -> np.ndarray:
    """Concatenate documents, each closed by `eos_id`, and cut the stream into rows of
    `seq_len + 1` ids; the tail that does not fill a row is dropped."""
    stream = [token for doc in documents for token in (*doc, eos_id)]
    rows = len(stream) // (seq_len + 1)
    return np.asarray(stream[: rows * (seq_len + 1)], dtype=np.int64).reshape(rows, seq_len + 1)


def training_dataset(cfg: DataConfig):
    import ray.data

    files = find_documents(cfg)
    tokenizer = get_tokenizer(cfg.tokenizer)
    text_field, seq_len = cfg.text_field, cfg.seq_len

    def tokenize_and_pack(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if text_field not in batch:
            raise DataError(f"data.text_field: no field {text_field!r} in the documents (fields: {', '.join(batch)})")
        return {"tokens": pack([tokenizer.encode(text) for text in batch[text_field]], seq_len, tokenizer.eos_id)}

    return ray.data.read_json([str(f) for f in files]).map_batches(
        tokenize_and_pack, batch_format="numpy", batch_size=512
    )


def micro_batches(shard, micro_batch_size: int, start: DataPosition) -> Iterator[tuple[DataPosition, torch.Tensor]]:
    """Endless micro-batches `[micro_batch_size, seq_len + 1]` from this worker's split,
    epoch after epoch, each paired with the position just after it."""
    epoch, skip = start.epoch, start.micro_batches
    while True:
        index = -1
        for index, batch in enumerate(
            shard.iter_torch_batches(batch_size=micro_batch_size, drop_last=True, dtypes=torch.long)
        ):
            if index >= skip:
                yield DataPosition(epoch, index + 1), batch["tokens"]
        if index < 0:
            raise DataError(
                f"data.path: this worker's split holds fewer than {micro_batch_size} sequences; "
                "the dataset is empty or too small for the batch plan"
            )
        epoch, skip = epoch + 1, 0
