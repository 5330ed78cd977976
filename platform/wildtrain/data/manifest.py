"""A prepared dataset: Parquet shards of packed rows, described by manifest.json.

A dataset root holds the shards, the tokenizer.json they were tokenized with (unless
byte-level) and manifest.json, written last: a root without a manifest is an unfinished
preparation. Every shard row holds two columns of `seq_len + 1` int32s: `tokens`, and
`doc_ids`, the document each token belongs to, so attention can be masked per document.
Doc ids tell a row's documents apart and nothing more: they count documents within one
input partition (a row never spans two), modulo 2**31.

The manifest knows every shard's rows, row groups, size and sha256: a reader plans its
reads without listing the bucket or opening every footer, and `verify` proves the stored
shards are the ones that were written.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from wildtrain import storage
from wildtrain.config import StorageConfig

FORMAT = "wildtrain-packed-v1"
MANIFEST = "manifest.json"
TOKENIZER = "tokenizer.json"
SCHEMA = pa.schema([("tokens", pa.list_(pa.int32())), ("doc_ids", pa.list_(pa.int32()))])


class DataError(ValueError):
    """Data that cannot be used; the message names the file, shard or key at fault."""


class ShardCorrupt(DataError):
    """A shard that went bad after the run started (deleted, truncated, rewritten): reading
    it again will not help, unlike a read that failed because the store did not answer."""


@dataclass
class Shard:
    path: str  # relative to the dataset root
    rows: int
    tokens: int  # ids stored: rows * (seq_len + 1)
    bytes: int
    sha256: str
    row_groups: list[int]  # rows per Parquet row group, in file order


@dataclass(kw_only=True)
class Manifest:
    format: str = FORMAT
    seq_len: int
    # {"kind": "byte" | "hf" | "bpe", "vocab_size", "eos_id", "modes" (reserved mode token
    # ids by name), "sentinels" (reserved sentinel ids)}, plus "sha256" of the root's
    # tokenizer.json unless byte-level. Manifests from before reserved ids lack "modes" and
    # "sentinels": causal training reads them, UL2 refuses them.
    tokenizer: dict
    source: str
    shards: list[Shard]
    rows: int
    tokens: int
    # Shards of documents held out for validation (prepare's val_fraction), never trained
    # on; `rows` and `tokens` count the training shards alone.
    validation: list[Shard] = field(default_factory=list)
    # Records skipped as unreadable (prepare's --skip-bad-records), per input file that had any.
    bad_records: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> str:
        data = asdict(self)
        for key in ("validation", "bad_records"):  # a manifest without them reads as it always did
            if not data[key]:
                del data[key]
        return json.dumps(data, indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str, name: str = MANIFEST) -> "Manifest":
        try:
            data = json.loads(text)
            return cls(
                **{
                    **data,
                    "shards": [Shard(**shard) for shard in data["shards"]],
                    "validation": [Shard(**shard) for shard in data.get("validation", [])],
                }
            )
        except KeyError as e:
            raise DataError(f"{name}: not a wildtrain manifest (no key {e})") from None
        except (TypeError, ValueError) as e:
            raise DataError(f"{name}: not a wildtrain manifest ({e})") from None


def encode_shard(path: str, tokens: np.ndarray, doc_ids: np.ndarray, rows_per_group: int) -> tuple[Shard, bytes]:
    """A shard's Parquet bytes and manifest entry from (rows, seq_len + 1) arrays; the same
    rows give the same bytes with the same pyarrow."""
    rows, row_len = tokens.shape
    offsets = pa.array(np.arange(0, rows * row_len + 1, row_len, dtype=np.int32))
    table = pa.Table.from_arrays(
        [pa.ListArray.from_arrays(offsets, pa.array(column.ravel(), pa.int32())) for column in (tokens, doc_ids)],
        schema=SCHEMA,
    )
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, row_group_size=rows_per_group, compression="zstd")
    data = sink.getvalue().to_pybytes()
    metadata = pq.read_metadata(pa.BufferReader(data))
    groups = [metadata.row_group(i).num_rows for i in range(metadata.num_row_groups)]
    return Shard(path, rows, rows * row_len, len(data), hashlib.sha256(data).hexdigest(), groups), data


def write_manifest(root_uri: str, manifest: Manifest, config: Optional[StorageConfig] = None) -> bool:
    """Write manifest.json atomically, unless the root already holds this very manifest;
    True if it wrote."""
    return storage.write_if_changed(storage.join(root_uri, MANIFEST), manifest.to_json().encode(), config)


def retract_manifest(root_uri: str, config: Optional[StorageConfig] = None) -> None:
    """Remove manifest.json, if there is one, before anything it describes is written again:
    an unfinished preparation is a root without a manifest, never one whose manifest is wrong."""
    uri = storage.join(root_uri, MANIFEST)
    fs, path = storage.filesystem(uri, config)
    with storage.errors(uri, config):
        if fs.get_file_info(path).type == pafs.FileType.File:
            fs.delete_file(path)


def read_manifest(root_uri: str, config: Optional[StorageConfig] = None) -> Manifest:
    uri = storage.join(root_uri, MANIFEST)
    text = storage.read_text(uri, config)
    if text is None:
        raise DataError(f"{uri}: no manifest; prepare the dataset with data_pipelines/prepare.py")
    return Manifest.from_json(text, uri)


def verify(
    root_uri: str, manifest: Manifest, check_checksums: bool = True, config: Optional[StorageConfig] = None
) -> None:
    """Raise `DataError` naming the first shard, file or total that does not match the
    manifest. Without `check_checksums` only sizes and Parquet footers are read."""
    where = storage.join(root_uri, MANIFEST)
    if manifest.format != FORMAT:
        raise DataError(f"{where}: format {manifest.format!r}, expected {FORMAT!r}")
    if not manifest.shards or manifest.rows == 0:
        raise DataError(f"{where}: empty dataset (no shards or no rows)")
    for key in ("rows", "tokens"):
        total = sum(getattr(shard, key) for shard in manifest.shards)
        if total != getattr(manifest, key):
            raise DataError(f"{where}: {key} is {getattr(manifest, key)}, but the shards hold {total}")
    for shard in manifest.shards + manifest.validation:
        verify_shard(root_uri, shard, manifest.seq_len + 1, check_checksums, config)
    if "sha256" in manifest.tokenizer:
        _verify_tokenizer(root_uri, manifest.tokenizer["sha256"], config)


def verify_shard(
    root_uri: str, shard: Shard, row_len: int, check_checksums: bool, config: Optional[StorageConfig]
) -> None:
    name = f"shard {shard.path}"
    if shard.tokens != shard.rows * row_len:
        raise DataError(
            f"{name}: {shard.tokens} tokens in the manifest, but {shard.rows} rows of {row_len} hold "
            f"{shard.rows * row_len}"
        )
    uri = storage.join(root_uri, shard.path)
    fs, path = storage.filesystem(uri, config)
    with storage.errors(uri, config):
        info = fs.get_file_info(path)
        if info.type != pafs.FileType.File:
            raise DataError(f"{name}: missing ({uri})")
        if info.size != shard.bytes:
            raise DataError(f"{name}: {info.size} bytes, the manifest says {shard.bytes}")
        if check_checksums:
            with fs.open_input_stream(path) as f:
                data = f.read()
            if hashlib.sha256(data).hexdigest() != shard.sha256:
                raise DataError(f"{name}: sha256 does not match the manifest (corrupt or overwritten)")
            _check_parquet(name, pa.BufferReader(data), shard, row_len, check_rows=True)
        else:
            with fs.open_input_file(path) as f:
                _check_parquet(name, f, shard, row_len, check_rows=False)


def _check_parquet(name: str, source, shard: Shard, row_len: int, check_rows: bool) -> None:
    try:
        parquet = pq.ParquetFile(source)
    except (pa.ArrowException, OSError) as e:  # a damaged footer reads as an I/O error
        raise DataError(f"{name}: not a readable Parquet file ({e})") from None
    if not parquet.schema_arrow.equals(SCHEMA):
        raise DataError(f"{name}: schema is {_describe(parquet.schema_arrow)}, expected {_describe(SCHEMA)}")
    groups = [parquet.metadata.row_group(i).num_rows for i in range(parquet.metadata.num_row_groups)]
    if groups != shard.row_groups:
        raise DataError(f"{name}: row groups of {groups} rows, the manifest says {shard.row_groups}")
    if check_rows:
        table = parquet.read()
        for column in SCHEMA.names:
            if not pc.all(pc.equal(pc.list_value_length(table[column]), row_len)).as_py():
                raise DataError(f"{name}: {column} rows must hold seq_len + 1 = {row_len} ids")


def _verify_tokenizer(root_uri: str, sha256: str, config: Optional[StorageConfig]) -> None:
    uri = storage.join(root_uri, TOKENIZER)
    data = storage.read_bytes(uri, config)
    if data is None:
        raise DataError(f"{uri}: missing; the manifest names a tokenizer.json")
    if hashlib.sha256(data).hexdigest() != sha256:
        raise DataError(f"{uri}: sha256 does not match the manifest")


def _describe(schema: pa.Schema) -> str:
    return ", ".join(f"{f.name}: {f.type}" for f in schema)
