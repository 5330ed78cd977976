"""Small prepared datasets written straight from arrays, for tests that need one without
running the prepare pipeline (no Ray, no object store)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from wildtrain.data.manifest import Manifest, encode_shard, write_manifest
from wildtrain.data.tokenizer import ByteTokenizer


def write_dataset(
    root: Path, shards: list[np.ndarray], rows_per_group: int, validation: list[np.ndarray] = ()
) -> Manifest:
    """`shards[i]` is shard i's (rows, seq_len + 1) token ids, `validation[i]` validation
    shard i's; each row is its own document."""
    root.mkdir(parents=True, exist_ok=True)

    def written(name: str, index: int, tokens: np.ndarray):
        doc_ids = np.repeat(np.arange(len(tokens), dtype=np.int32)[:, None], tokens.shape[1], axis=1)
        shard, data = encode_shard(f"{name}-{index:05d}.parquet", tokens, doc_ids, rows_per_group)
        (root / shard.path).write_bytes(data)
        return shard

    entries = [written("shard", i, tokens) for i, tokens in enumerate(shards)]
    manifest = Manifest(
        seq_len=shards[0].shape[1] - 1,
        tokenizer=ByteTokenizer().describe(),
        source="tests",
        shards=entries,
        rows=sum(s.rows for s in entries),
        tokens=sum(s.tokens for s in entries),
        validation=[written("validation", i, tokens) for i, tokens in enumerate(validation)],
    )
    write_manifest(str(root), manifest)
    return manifest
