"""A run's validation rows: the documents its datasets hold out (prepare's --val-fraction,
in each manifest's `validation` shards) and the datasets named in `data.validation`.

Every rank reads a contiguous share of all validation rows, the shares as equal as the row
count allows (`rank_share`), so each row is scored exactly once whatever the world size.
The shares are small beside the training data, and read once per worker (`read_share`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from wildtrain import storage
from wildtrain.config import StorageConfig
from wildtrain.data.manifest import DataError, Shard


@dataclass(frozen=True)
class ValidationSet:
    """One dataset's validation rows: its name (in `val/<name>/*`), root and shards."""

    name: str
    root: str
    shards: tuple[Shard, ...]

    @property
    def rows(self) -> int:
        return sum(shard.rows for shard in self.shards)


@dataclass(frozen=True)
class RowRange:
    """Rows `start`..`stop` (exclusive) of row group `group` of shard `shard` of set `set`."""

    set: int
    shard: int
    group: int
    start: int
    stop: int


def names_for(roots: list[str]) -> list[str]:
    """A short name per dataset root for its metrics: its last path component, numbered
    where two are alike."""
    names = [root.rstrip("/").rsplit("/", 1)[-1] or "data" for root in roots]
    return [f"{name}{i}" if names.count(name) > 1 else name for i, name in enumerate(names)]


def rank_share(sets: list[ValidationSet], rank: int, world_size: int) -> list[RowRange]:
    """The validation rows `rank` scores: the `rank`-th of `world_size` contiguous, equal
    (to a row) slices of every set's rows in order. Pure."""
    total = sum(s.rows for s in sets)
    first, last = total * rank // world_size, total * (rank + 1) // world_size
    ranges, offset = [], 0
    for i, s in enumerate(sets):
        for j, shard in enumerate(s.shards):
            for k, rows in enumerate(shard.row_groups):
                start, stop = max(first, offset), min(last, offset + rows)
                if start < stop:
                    ranges.append(RowRange(i, j, k, start - offset, stop - offset))
                offset += rows
    return ranges


def share_rows(sets: list[ValidationSet], world_size: int) -> list[int]:
    """How many rows each rank scores (`rank_share`), in rank order."""
    total = sum(s.rows for s in sets)
    return [total * (r + 1) // world_size - total * r // world_size for r in range(world_size)]


def read_share(
    sets: list[ValidationSet], ranges: list[RowRange], seq_len: int, config: Optional[StorageConfig] = None
) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """(set index, tokens, doc_ids) per range, each (rows, seq_len + 1) int32."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = []
    opened: dict[tuple[int, int], pq.ParquetFile] = {}
    for r in ranges:
        s = sets[r.set]
        uri = storage.join(s.root, s.shards[r.shard].path)
        try:
            with storage.errors(uri, config):
                if (r.set, r.shard) not in opened:
                    fs, path = storage.filesystem(uri, config)
                    opened[r.set, r.shard] = pq.ParquetFile(fs.open_input_file(path))
                table = opened[r.set, r.shard].read_row_group(r.group, columns=["tokens", "doc_ids"])
        except (OSError, pa.ArrowException) as e:
            raise DataError(f"validation shard {uri}: row group {r.group} unreadable: {e}") from None
        tokens, doc_ids = (
            table.column(name).combine_chunks().flatten().to_numpy().reshape(len(table), seq_len + 1)
            for name in ("tokens", "doc_ids")
        )
        out.append((r.set, tokens[r.start : r.stop], doc_ids[r.start : r.stop]))
    return out
