"""Prepare a corpus for training: read raw text from any URI, tokenize, pack into rows of
`seq_len + 1` ids that remember each token's document, and write Parquet shards and a
manifest (see `manifest`) to the output URI.

Ray Data reads and tokenizes in parallel and in input order. The driver packs the token
stream, which is sequential by nature (a row starts where the previous one ended), and
encodes and uploads shards from a few threads. The same input and settings give
byte-identical shards under the same names, so a rerun writes only the shards that are
missing or differ from what is stored, an interrupted run resumes where it stopped, and
manifest.json, written last, marks the dataset complete.
"""

from __future__ import annotations

import hashlib
import logging
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Iterable, Iterator

import numpy as np
import pyarrow as pa

from wildtrain import storage
from wildtrain.config import StorageConfig
from wildtrain.data.manifest import (
    TOKENIZER, DataError, Manifest, Shard, encode_shard, verify, write_manifest,
)
from wildtrain.data.tokenizer import HFTokenizer, Tokenizer, bpe_vocab_size, get_tokenizer, train_bpe

if TYPE_CHECKING:
    from ray.data import Dataset

log = logging.getLogger(__name__)

FORMATS = {".jsonl": "json", ".json": "json", ".txt": "text", ".parquet": "parquet"}
# Shards being encoded and uploaded at once: the upload overlaps packing, and memory stays
# bounded at a few shards.
WRITERS = 4


@dataclass
class PrepareConfig:
    input: str  # a file, or a folder or prefix of .jsonl/.json, .txt or .parquet files
    output: str  # the dataset root
    seq_len: int = 128
    tokenizer: str = "byte"  # byte | bpe:VOCAB (trained on the input) | path or URI of a tokenizer.json
    text_field: str = "text"  # of jsonl records, or the column of Parquet files
    rows_per_shard: int = 8192
    rows_per_group: int = 1024  # Parquet row group: the unit a training reader fetches
    # Documents held out for validation, by a hash of their text (`held_out`): a rerun, or
    # the same corpus in another order, holds out the same ones. 0: none.
    val_fraction: float = 0.0
    storage: StorageConfig = field(default_factory=StorageConfig)


@dataclass
class PrepareResult:
    manifest: Manifest
    written: list[str]  # shards written by this run
    unchanged: list[str]  # shards already stored byte for byte


def prepare(cfg: PrepareConfig) -> PrepareResult:
    _validate(cfg)
    storage.probe(cfg.output, cfg.storage)
    texts = read_texts(cfg)
    tokenizer = _tokenizer(cfg, texts)
    ids = texts.map_batches(_tokenize, batch_format="pyarrow",
                            fn_kwargs={"text_field": cfg.text_field, "tokenizer": tokenizer,
                                       "val_fraction": cfg.val_fraction})
    packers = {False: RowPacker(cfg.seq_len, tokenizer.eos_id, cfg.rows_per_shard),
               True: RowPacker(cfg.seq_len, tokenizer.eos_id, cfg.rows_per_shard)}
    names = {False: "shard", True: "validation"}
    counts = {False: 0, True: 0}
    done: dict[bool, list[tuple[Shard, bool]]] = {False: [], True: []}
    with ThreadPoolExecutor(WRITERS) as pool:
        pending: deque[tuple[bool, Future]] = deque()

        def write(held_out: bool, shards: Iterable[tuple[np.ndarray, np.ndarray]]) -> None:
            for tokens, doc_ids in shards:
                name = f"{names[held_out]}-{counts[held_out]:05d}.parquet"
                counts[held_out] += 1
                pending.append((held_out, pool.submit(_write_shard, cfg, name, tokens, doc_ids)))
            while len(pending) >= WRITERS or (pending and pending[0][1].done()):
                held, future = pending.popleft()
                done[held].append(future.result())

        for batch in ids.iter_batches(batch_format="pyarrow", batch_size=None):
            documents, held_out = batch.column("ids").combine_chunks(), batch.column("validation").to_numpy()
            for held in (False, True):
                part = documents.filter(pa.array(held_out == held))
                write(held, packers[held].add(part) if len(part) else [])
        for held in (False, True):
            write(held, packers[held].finish())
        for held, future in pending:
            done[held].append(future.result())
    shards, validation = ([shard for shard, _ in done[held]] for held in (False, True))
    written = [shard.path for held in done for shard, was_written in done[held] if was_written]
    if not shards:
        raise DataError(f"input: {cfg.input} holds no text that fills one row of seq_len + 1 = {cfg.seq_len + 1} tokens")
    if cfg.val_fraction and not validation:
        raise DataError(f"val_fraction: {cfg.val_fraction} of {cfg.input} held out too little text to fill one row "
                        f"of seq_len + 1 = {cfg.seq_len + 1} tokens; hold out more")
    manifest = Manifest(
        seq_len=cfg.seq_len,
        tokenizer=tokenizer.describe(),
        source=storage.resolve(cfg.input),
        shards=shards,
        rows=sum(shard.rows for shard in shards),
        tokens=sum(shard.tokens for shard in shards),
        validation=validation,
    )
    write_manifest(cfg.output, manifest, cfg.storage)
    verify(cfg.output, manifest, check_checksums=False, config=cfg.storage)
    log.info("%s: %d rows, %d tokens in %d shards, %d validation shards (%d written)", cfg.output, manifest.rows,
             manifest.tokens, len(shards), len(validation), len(written))
    return PrepareResult(manifest, written,
                         [shard.path for held in done for shard, was_written in done[held] if not was_written])


def held_out(text: str, fraction: float) -> bool:
    """Whether a document is held out for validation: its text's sha256, read as a number in
    [0, 1), is below `fraction`, the same on every run and in any order of the corpus."""
    return fraction > 0 and int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") < fraction * 2**64


class RowPacker:
    """Packs batches of tokenized documents into shards of rows (see `pack_rows`), fed batch
    by batch, so one pass over a corpus can fill two packers (training and validation)."""

    def __init__(self, seq_len: int, eos_id: int, rows_per_shard: int) -> None:
        self.row_len = seq_len + 1
        self.shard_len = rows_per_shard * self.row_len
        self.eos_id = eos_id
        self._tokens: list[np.ndarray] = []
        self._doc_ids: list[np.ndarray] = []
        self._buffered = self._next_doc = 0

    def add(self, batch: pa.ListArray) -> list[tuple[np.ndarray, np.ndarray]]:
        """The shards that `batch` completes."""
        lengths = batch.value_lengths().to_numpy(zero_copy_only=False)
        self._tokens.append(np.insert(batch.flatten().to_numpy(zero_copy_only=False), np.cumsum(lengths),
                                      self.eos_id).astype(np.int32))
        self._doc_ids.append(np.repeat(np.arange(self._next_doc, self._next_doc + len(lengths), dtype=np.int32),
                                       lengths + 1))
        self._next_doc += len(lengths)
        self._buffered += len(self._tokens[-1])
        if self._buffered < self.shard_len:
            return []
        stream, docs = np.concatenate(self._tokens), np.concatenate(self._doc_ids)
        full = self._buffered // self.shard_len * self.shard_len
        shards = [(stream[start:start + self.shard_len].reshape(-1, self.row_len),
                   docs[start:start + self.shard_len].reshape(-1, self.row_len))
                  for start in range(0, full, self.shard_len)]
        self._tokens, self._doc_ids, self._buffered = [stream[full:]], [docs[full:]], self._buffered - full
        return shards

    def finish(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """The last, shorter shard; the tail that fills no row is dropped."""
        rows = self._buffered // self.row_len
        if not rows:
            return []
        return [(np.concatenate(self._tokens)[:rows * self.row_len].reshape(rows, self.row_len),
                 np.concatenate(self._doc_ids)[:rows * self.row_len].reshape(rows, self.row_len))]


def pack_rows(documents: Iterable[pa.ListArray], seq_len: int, eos_id: int,
              rows_per_shard: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Shards of packed rows from batches of tokenized documents: (tokens, doc_ids), each
    (rows, seq_len + 1) int32. Every document is closed by `eos_id`, which belongs to it;
    doc_ids count documents from 0 in input order. Only the last shard may be shorter, and
    the tail that fills no row is dropped. Pure: batch boundaries do not change the result."""
    packer = RowPacker(seq_len, eos_id, rows_per_shard)
    for batch in documents:
        yield from packer.add(batch)
    yield from packer.finish()


def read_texts(cfg: PrepareConfig) -> Dataset:
    """A Ray dataset of the input's documents, in input order, as a column `text_field` of strings."""
    import ray.data

    fs, paths = storage.list_files(cfg.input, cfg.storage)
    if not paths:
        raise DataError(f"input: {cfg.input} does not exist")
    formats = {FORMATS.get(PurePosixPath(p).suffix) for p in paths} - {None}
    if not formats:
        raise DataError(f"input: no {', '.join(FORMATS)} files in {cfg.input}")
    if len(formats) > 1:
        raise DataError(f"input: {cfg.input} mixes {' and '.join(sorted(formats))} files; prepare one kind at a time")
    (kind,) = formats
    paths = [p for p in paths if FORMATS.get(PurePosixPath(p).suffix) == kind]
    # Determinism: the same documents must reach the packer in the same order on every run.
    ray.data.DataContext.get_current().execution_options.preserve_order = True
    if kind == "text":
        return ray.data.read_binary_files(paths, filesystem=fs).map_batches(
            _decode, batch_format="pyarrow", fn_kwargs={"text_field": cfg.text_field}
        )
    texts = (ray.data.read_parquet if kind == "parquet" else ray.data.read_json)(paths, filesystem=fs)
    schema = texts.schema()  # Parquet's from its footer; JSON's by reading the first block only
    if schema is None:
        raise DataError(f"input: {cfg.input} holds no documents")
    _require_text(schema.names, schema.types, cfg.text_field, paths[0])
    return texts.select_columns([cfg.text_field])


def _require_text(names: list[str], types: list, text_field: str, path: str) -> None:
    if text_field not in names:
        raise DataError(f"text_field: no field {text_field!r} in {path} (fields: {', '.join(names)})")
    kind = types[names.index(text_field)]
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise DataError(f"text_field: {text_field!r} in {path} is {kind}, not text")


def _tokenizer(cfg: PrepareConfig, texts: Dataset) -> Tokenizer:
    """The tokenizer, trained first for bpe:VOCAB; any but byte-level is saved as the dataset's
    tokenizer.json, so the dataset carries what it was tokenized with."""
    vocab_size = bpe_vocab_size(cfg.tokenizer)
    if vocab_size is not None:
        log.info("training a BPE of %d ids on %s", vocab_size, cfg.input)
        tokenizer = train_bpe(_iter_texts(texts, cfg.text_field), vocab_size)
    else:
        tokenizer = get_tokenizer(cfg.tokenizer, cfg.storage)
    if isinstance(tokenizer, HFTokenizer):
        storage.write_if_changed(storage.join(cfg.output, TOKENIZER), tokenizer.json.encode(), cfg.storage)
    return tokenizer


def _iter_texts(texts: Dataset, text_field: str) -> Iterator[str]:
    for batch in texts.iter_batches(batch_format="pyarrow", batch_size=None):
        yield from filter(None, batch.column(text_field).to_pylist())


def _decode(batch: pa.Table, text_field: str) -> pa.Table:
    # A stray invalid byte must not stop a corpus of millions of files.
    texts = [data.decode("utf-8", errors="replace") for data in batch.column("bytes").to_pylist()]
    return pa.table({text_field: pa.array(texts, pa.string())})


def _tokenize(batch: pa.Table, text_field: str, tokenizer: Tokenizer, val_fraction: float) -> pa.Table:
    # Missing and empty texts are no documents: they would pack as a lone end-of-document id.
    texts = [text for text in batch.column(text_field).to_pylist() if text]
    return pa.table({"ids": pa.array([tokenizer.encode(text) for text in texts], pa.list_(pa.int32())),
                     "validation": pa.array([held_out(text, val_fraction) for text in texts], pa.bool_())})


def _write_shard(cfg: PrepareConfig, path: str, tokens: np.ndarray, doc_ids: np.ndarray) -> tuple[Shard, bool]:
    shard, data = encode_shard(path, tokens, doc_ids, cfg.rows_per_group)
    written = storage.write_if_changed(storage.join(cfg.output, path), data, cfg.storage)
    log.info("%s: %d rows, %s", path, shard.rows, "written" if written else "unchanged")
    return shard, written


def _validate(cfg: PrepareConfig) -> None:
    for key in ("seq_len", "rows_per_shard", "rows_per_group"):
        if getattr(cfg, key) < 1:
            raise DataError(f"{key}: must be positive, got {getattr(cfg, key)}")
    if not 0 <= cfg.val_fraction < 1:
        raise DataError(f"val_fraction: must be at least 0 and below 1, got {cfg.val_fraction}")
    if cfg.rows_per_shard * (cfg.seq_len + 1) >= 2**31:
        # Parquet list offsets are int32: a shard column holds fewer than 2**31 ids.
        raise DataError(f"rows_per_shard: {cfg.rows_per_shard} rows of {cfg.seq_len + 1} ids exceed 2**31 ids per shard")
