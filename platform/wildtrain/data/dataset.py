"""Training data: documents → token ids → packed sequences, prepared by Ray Data.

Every row is one packed sequence of `seq_len + 1` ids (inputs are the first `seq_len`,
targets the last `seq_len`); documents are joined with the tokenizer's end-of-document id
so no compute is spent on padding. The driver runs the Ray Data pipeline (read, tokenize,
pack) once, in file order, and hands the workers references to the packed blocks in Ray's
object store; which rows a rank trains on at a step is decided by `sampler`, not by the
order the blocks arrive in, so a restart at any world size continues exactly.

Every worker holds all rows in memory: right for corpora of a few GB; streaming sharded
data from object storage replaces `PackedRows` without touching the training loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from wildtrain.config import DataConfig
from wildtrain.data.tokenizer import get_tokenizer


class DataError(ValueError):
    pass


@dataclass
class PackedRows:
    """The packed rows in Ray's object store, on the driver's node: blocks left on a
    worker node would die with it."""

    ref: object  # ray.ObjectRef[np.ndarray]
    num_rows: int

    def load(self) -> np.ndarray:
        import ray

        return ray.get(self.ref)


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


def pack_dataset(cfg: DataConfig) -> PackedRows:
    import ray
    import ray.data

    files = find_documents(cfg)
    tokenizer = get_tokenizer(cfg.tokenizer)
    text_field, seq_len = cfg.text_field, cfg.seq_len

    def tokenize_and_pack(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if text_field not in batch:
            raise DataError(f"data.text_field: no field {text_field!r} in the documents (fields: {', '.join(batch)})")
        return {"tokens": pack([tokenizer.encode(text) for text in batch[text_field]], seq_len, tokenizer.eos_id)}

    # The same documents must give the same rows in the same order on every submission.
    ray.data.DataContext.get_current().execution_options.preserve_order = True
    packed = (
        ray.data.read_json([str(f) for f in files])
        .map_batches(tokenize_and_pack, batch_format="numpy", batch_size=512)
        .materialize()
    )
    blocks = ray.get(packed.to_numpy_refs(column="tokens"))
    rows = np.concatenate(blocks) if blocks else np.empty((0, seq_len + 1), dtype=np.int64)
    return PackedRows(ref=ray.put(rows), num_rows=len(rows))
