"""Prepare a corpus for training: read raw text from any URI, tokenize, pack into rows of
`seq_len + 1` ids that remember each token's document, and write Parquet shards and a
manifest (see `manifest`) to the output URI.

The input is split into partitions (`records`: files, or byte ranges of large JSONL and
Parquet files). A Ray task per partition reads, tokenizes and packs it into shards of its
own, named by the partition's index (`shard-PPPPP-SSSSS.parquet`), and writes a part record
(`parts/PPPPP.json`) last; the driver only orders the partitions' shards into the manifest.
A row never spans two partitions: each partition drops its tail that fills no row.

The same input and settings give byte-identical shards under the same names, so a rerun
writes only the shards that are missing or differ from what is stored; a partition whose
part record matches (the same settings and the same input bytes, by sha256) and whose shards
verify is not read again, so an interrupted run resumes where it stopped. manifest.json,
written last, marks the dataset complete; a partition about to be written again removes it
first, so a run that stops on the way never leaves a manifest naming shards it rewrote.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Iterator, Optional

import numpy as np
import pyarrow as pa

from wildtrain import storage
from wildtrain.config import StorageConfig
from wildtrain.data import records
from wildtrain.data.manifest import (
    FORMAT,
    TOKENIZER,
    DataError,
    Manifest,
    Shard,
    encode_shard,
    retract_manifest,
    verify,
    verify_shard,
    write_manifest,
)
from wildtrain.data.parts import Part, PartResult
from wildtrain.data.progress import Progress, ReadSoFar, Reporter
from wildtrain.data.records import Partition
from wildtrain.data.tokenizer import HFTokenizer, Tokenizer, bpe_vocab_size, get_tokenizer, train_bpe

log = logging.getLogger(__name__)

PARTS = "parts"  # the folder of part records under the dataset root
EXECUTORS = ("ray", "local")
VAL_FRACTION = 0.005  # the share of documents held out for validation unless told otherwise
# The default share is raised for a small input until it holds out about this many rows of
# text at one byte per token (a quarter as many of a BPE's), up to VAL_CAP of the documents.
VAL_FLOOR_ROWS = 8
VAL_CAP = 0.05


@dataclass
class PrepareConfig:
    input: str  # a file, or a folder or prefix of input files (see `records`)
    output: str  # the dataset root
    seq_len: int = 128
    tokenizer: str = "byte"  # byte | bpe:VOCAB (trained on the input) | path or URI of a tokenizer.json
    text_field: str = "text"  # of jsonl records, or the column of Parquet and Arrow files
    rows_per_shard: int = 8192
    rows_per_group: int = 1024  # Parquet row group: the unit a training reader fetches
    # Documents held out for validation, by a hash of their text (`held_out`): a rerun, or
    # the same corpus in another order, holds out the same ones. 0: none. None: VAL_FRACTION,
    # raised for a small input (`val_share`), and no validation rows where that fills none;
    # a share given that fills no row stops the preparation.
    val_fraction: Optional[float] = None
    # Count and skip records that are not UTF-8, not JSON, lack the text field or are longer
    # than max_record_bytes, and unreadable Parquet and Arrow files, rather than stop at the
    # first, naming it.
    skip_bad_records: bool = False
    max_record_bytes: int = records.MAX_RECORD_BYTES
    partition_bytes: int = 256 << 20  # a plain JSONL or Parquet file larger than this is read in ranges of it
    executor: str = "ray"  # ray: a task per partition on the cluster | local: one after another, here
    progress_every: float = 30.0  # seconds between progress lines when stderr is no terminal
    storage: StorageConfig = field(default_factory=StorageConfig)


@dataclass
class PrepareResult:
    manifest: Manifest
    written: list[str]  # shards written by this run
    unchanged: list[str]  # shards already stored byte for byte
    parts: list[PartResult] = field(default_factory=list)
    val_share: float = 0.0  # of the documents, held out for validation (`val_share`)

    @property
    def held_out(self) -> int:
        """Documents held out for validation."""
        return sum(r.part.held_out for r in self.parts)


def prepare(cfg: PrepareConfig) -> PrepareResult:
    _validate(cfg)
    storage.probe(cfg.output, cfg.storage)
    parts = partitions(cfg)
    asked = cfg.val_fraction
    cfg = replace(cfg, val_fraction=val_share(asked, sum(p.bytes for p in parts), cfg.seq_len))
    tokenizer = _tokenizer(cfg, parts)
    progress = Progress(sum(p.bytes for p in parts), len(parts), cfg.progress_every)
    run = _run_ray if cfg.executor == "ray" else _run_local
    results = run(cfg, tokenizer, parts, progress)
    progress.finish()
    shards = [s for r in results for s in r.part.shards]
    validation = [s for r in results for s in r.part.validation]
    bad: dict[str, int] = {}
    for part, result in zip(parts, results):
        if result.part.bad_records:
            bad[part.name] = bad.get(part.name, 0) + result.part.bad_records
    if not any(r.part.documents for r in results):
        raise DataError(f"input: {cfg.input} holds no documents")
    if not shards:
        raise DataError(
            f"input: {cfg.input} holds no text that fills one row of seq_len + 1 = {cfg.seq_len + 1} tokens"
        )
    if asked is not None and cfg.val_fraction and not validation:
        raise DataError(
            f"val_fraction: {asked} of {cfg.input} held out too little text to fill one row "
            f"of seq_len + 1 = {cfg.seq_len + 1} tokens; hold out more, or none with --val-fraction 0"
        )
    manifest = Manifest(
        seq_len=cfg.seq_len,
        tokenizer=tokenizer.describe(),
        source=storage.resolve(cfg.input),
        shards=shards,
        rows=sum(shard.rows for shard in shards),
        tokens=sum(shard.tokens for shard in shards),
        validation=validation,
        bad_records=bad,
    )
    write_manifest(cfg.output, manifest, cfg.storage)
    verify(cfg.output, manifest, check_checksums=False, config=cfg.storage)
    return PrepareResult(
        manifest,
        [path for r in results for path in r.written],
        [path for r in results for path in r.unchanged],
        results,
        cfg.val_fraction,
    )


def partitions(cfg: PrepareConfig) -> list[Partition]:
    _, listed = storage.list_sizes(cfg.input, cfg.storage)
    if not listed:
        raise DataError(f"input: {cfg.input} does not exist")
    files = records.documents(*map(list, zip(*listed)))
    if not files:
        raise DataError(f"input: no {', '.join(records.FORMATS)} files in {cfg.input}")
    resolved = storage.resolve(cfg.input)
    scheme = resolved[: resolved.index("://") + 3] if "://" in resolved else ""
    return records.split(files, cfg.partition_bytes, scheme)


def val_share(fraction: Optional[float], input_bytes: int, seq_len: int) -> float:
    """The share of documents held out for validation: `fraction` as given; by default
    VAL_FRACTION, raised for an input so small that it would hold out fewer than VAL_FLOOR_ROWS
    rows of one byte per token, up to VAL_CAP. Of the input's stored size alone (compressed,
    for a compressed file), so a rerun holds out the same documents. Pure."""
    if fraction is not None:
        return fraction
    return max(VAL_FRACTION, min(VAL_FLOOR_ROWS * (seq_len + 1) / max(input_bytes, 1), VAL_CAP))


def held_out(text: str, fraction: float) -> bool:
    """Whether a document is held out for validation: its text's sha256, read as a number in
    [0, 1), is below `fraction`, the same on every run and in any order of the corpus."""
    return fraction > 0 and int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") < fraction * 2**64


def part_key(cfg: PrepareConfig, tokenizer: Tokenizer, part: Partition, sha256: str) -> dict:
    """What a partition's shards follow from (`sha256`: of its bytes): a stored part record
    with another key is stale."""
    return {
        "format": FORMAT,
        "input": part.name,
        "start": part.start,
        "stop": part.stop,
        "size": part.size,
        "sha256": sha256,
        "seq_len": cfg.seq_len,
        "tokenizer": tokenizer.describe(),
        "text_field": cfg.text_field,
        "rows_per_shard": cfg.rows_per_shard,
        "rows_per_group": cfg.rows_per_group,
        "val_fraction": cfg.val_fraction,
        "skip_bad_records": cfg.skip_bad_records,
        "max_record_bytes": cfg.max_record_bytes,
    }


def prepare_part(
    cfg: PrepareConfig,
    tokenizer: Tokenizer,
    index: int,
    part: Partition,
    on_batch: Optional[Callable[[int, int, int, int], None]] = None,
) -> PartResult:
    """Read, tokenize and pack partition `index` into its shards and part record, unless its
    stored part record has the same key and its shards verify. `on_batch(bytes, documents,
    tokens, shards written)` follows the reading."""
    started = time.process_time()
    fs, _ = storage.filesystem(cfg.input, cfg.storage)
    with storage.errors(part.name, cfg.storage):
        key = part_key(cfg, tokenizer, part, records.digest(fs, part))
    record_uri = storage.join(cfg.output, PARTS, f"{index:05d}.json")
    stored = _stored(cfg, record_uri, key)
    if stored is not None:
        paths = [s.path for s in stored.shards + stored.validation]
        return PartResult(index, stored, [], paths, False, time.process_time() - started)
    retract_manifest(cfg.output, cfg.storage)
    packers = {held: RowPacker(cfg.seq_len, tokenizer.eos_id, cfg.rows_per_shard) for held in (False, True)}
    shards: dict[bool, list[Shard]] = {False: [], True: []}
    written, unchanged = [], []
    documents = bad = tokens = held_documents = 0

    def write(held: bool, packed: Iterable[tuple[np.ndarray, np.ndarray]]) -> None:
        for rows, doc_ids in packed:
            name = f"{'validation' if held else 'shard'}-{index:05d}-{len(shards[held]):05d}.parquet"
            shard, data = encode_shard(name, rows, doc_ids, cfg.rows_per_group)
            (
                written if storage.write_if_changed(storage.join(cfg.output, name), data, cfg.storage) else unchanged
            ).append(name)
            shards[held].append(shard)

    with storage.errors(part.name, cfg.storage):
        for texts, skipped, read in records.read(
            fs, part, cfg.text_field, cfg.skip_bad_records, max_bytes=cfg.max_record_bytes
        ):
            bad += skipped
            documents += len(texts)
            batch_tokens, shards_before = 0, len(written)
            if texts:
                ids, lengths = tokenizer.encode_batch(texts)
                batch_tokens = len(ids) + len(texts)
                batch = pa.LargeListArray.from_arrays(np.concatenate([[0], np.cumsum(lengths)]), ids)
                held = np.fromiter((held_out(t, cfg.val_fraction) for t in texts), bool, count=len(texts))
                held_documents += int(held.sum())
                for flag in (False, True):
                    chosen = batch.filter(pa.array(held == flag))
                    if len(chosen):
                        write(flag, packers[flag].add(chosen))
            tokens += batch_tokens
            if on_batch:
                on_batch(read, len(texts), batch_tokens, len(written) - shards_before)
    for flag in (False, True):
        write(flag, packers[flag].finish())
    result = Part(key, shards[False], shards[True], documents, bad, tokens, held_documents)
    storage.write_if_changed(record_uri, result.to_json().encode(), cfg.storage)
    return PartResult(index, result, written, unchanged, True, time.process_time() - started)


def _stored(cfg: PrepareConfig, uri: str, key: dict) -> Optional[Part]:
    """The partition's stored part record if it has `key` and every shard it names verifies."""
    text = storage.read_text(uri, cfg.storage)
    if text is None:
        return None
    try:
        part = Part.from_json(text)
    except (TypeError, ValueError, KeyError):
        return None  # a record from another version: the partition is prepared again
    if part.key != key:
        return None
    try:
        for shard in part.shards + part.validation:
            verify_shard(cfg.output, shard, cfg.seq_len + 1, True, cfg.storage)
    except DataError:
        return None
    return part


def _run_local(
    cfg: PrepareConfig, tokenizer: Tokenizer, parts: list[Partition], progress: Progress
) -> list[PartResult]:
    results = []
    for i, part in enumerate(parts):
        results.append(prepare_part(cfg, tokenizer, i, part, progress.advance))
        progress.part_done(results[-1], part.bytes)
    return results


def _run_ray(cfg: PrepareConfig, tokenizer: Tokenizer, parts: list[Partition], progress: Progress) -> list[PartResult]:
    """A task per partition, a few per CPU of the cluster in flight: the driver waits, orders
    and reports; the tasks read, tokenize, pack and write."""
    import ray

    from wildtrain.storage import StorageError

    if not ray.is_initialized():
        ray.init(log_to_driver=False)
    # The tasks write to the store with this process's endpoint and keys.
    task = ray.remote(prepare_part).options(num_cpus=1, runtime_env={"env_vars": storage.handover_env(cfg.storage)})
    cfg_ref, tokenizer_ref = ray.put(cfg), ray.put(tokenizer)
    read_so_far = ray.remote(num_cpus=0)(ReadSoFar).remote()
    window = 2 * max(int(ray.cluster_resources().get("CPU", 1)), 1)
    results: list[Optional[PartResult]] = [None] * len(parts)
    pending: dict = {}
    submitted = 0
    try:
        while submitted < len(parts) or pending:
            while submitted < len(parts) and len(pending) < window:
                pending[
                    task.remote(cfg_ref, tokenizer_ref, submitted, parts[submitted], Reporter(read_so_far, submitted))
                ] = submitted
                submitted += 1
            done, _ = ray.wait(list(pending), num_returns=len(pending), timeout=1.0, fetch_local=True)
            for ref in done:
                index = pending.pop(ref)
                try:
                    results[index] = ray.get(ref)
                except ray.exceptions.RayTaskError as e:
                    # The task's own one-line error, not Ray's wrapper with both tracebacks.
                    if isinstance(e.cause, (DataError, StorageError)):
                        raise e.cause from None
                    raise
                progress.part_done(results[index], parts[index].bytes)
            if pending:
                progress.running = np.array(ray.get(read_so_far.of.remote(list(pending.values()))), np.int64)
            progress.show()
    finally:
        for ref in pending:
            ray.cancel(ref)
        ray.kill(read_so_far)
    return results  # type: ignore[return-value]


class RowPacker:
    """Packs batches of tokenized documents into shards of rows (see `pack_rows`), fed batch
    by batch, so one pass over a corpus can fill two packers (training and validation).
    Documents are numbered from `first_doc`, modulo 2**31 so that they fit the shards' int32:
    a row holds far fewer documents, so its ids still tell them apart."""

    def __init__(self, seq_len: int, eos_id: int, rows_per_shard: int, first_doc: int = 0) -> None:
        self.row_len = seq_len + 1
        self.shard_len = rows_per_shard * self.row_len
        self.eos_id = eos_id
        self._tokens: list[np.ndarray] = []
        self._doc_ids: list[np.ndarray] = []
        self._buffered = 0
        self._next_doc = first_doc  # a Python int: no overflow however many documents

    def add(self, batch: pa.ListArray) -> list[tuple[np.ndarray, np.ndarray]]:
        """The shards that `batch` completes."""
        lengths = batch.value_lengths().to_numpy(zero_copy_only=False)
        self._tokens.append(
            np.insert(batch.flatten().to_numpy(zero_copy_only=False), np.cumsum(lengths), self.eos_id).astype(np.int32)
        )
        numbers = np.arange(self._next_doc, self._next_doc + len(lengths), dtype=np.int64) % 2**31
        self._doc_ids.append(np.repeat(numbers.astype(np.int32), lengths + 1))
        self._next_doc += len(lengths)
        self._buffered += len(self._tokens[-1])
        if self._buffered < self.shard_len:
            return []
        stream, docs = np.concatenate(self._tokens), np.concatenate(self._doc_ids)
        full = self._buffered // self.shard_len * self.shard_len
        shards = [
            (
                stream[start : start + self.shard_len].reshape(-1, self.row_len),
                docs[start : start + self.shard_len].reshape(-1, self.row_len),
            )
            for start in range(0, full, self.shard_len)
        ]
        self._tokens, self._doc_ids, self._buffered = [stream[full:]], [docs[full:]], self._buffered - full
        return shards

    def finish(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """The last, shorter shard; the tail that fills no row is dropped."""
        rows = self._buffered // self.row_len
        if not rows:
            return []
        return [
            (
                np.concatenate(self._tokens)[: rows * self.row_len].reshape(rows, self.row_len),
                np.concatenate(self._doc_ids)[: rows * self.row_len].reshape(rows, self.row_len),
            )
        ]


def pack_rows(
    documents: Iterable[pa.ListArray], seq_len: int, eos_id: int, rows_per_shard: int
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Shards of packed rows from batches of tokenized documents: (tokens, doc_ids), each
    (rows, seq_len + 1) int32. Every document is closed by `eos_id`, which belongs to it;
    doc_ids count documents from 0 in input order (modulo 2**31). Only the last shard may be shorter, and
    the tail that fills no row is dropped. Pure: batch boundaries do not change the result."""
    packer = RowPacker(seq_len, eos_id, rows_per_shard)
    for batch in documents:
        yield from packer.add(batch)
    yield from packer.finish()


def _tokenizer(cfg: PrepareConfig, parts: list[Partition]) -> Tokenizer:
    """The tokenizer, trained first for bpe:VOCAB; any but byte-level is saved as the dataset's
    tokenizer.json, so the dataset carries what it was tokenized with."""
    vocab_size = bpe_vocab_size(cfg.tokenizer)
    if vocab_size is not None:
        log.info("training a BPE of %d ids on %s", vocab_size, cfg.input)
        tokenizer = train_bpe(_texts(cfg, parts), vocab_size)
    else:
        tokenizer = get_tokenizer(cfg.tokenizer, cfg.storage)
    if isinstance(tokenizer, HFTokenizer):
        uri, data = storage.join(cfg.output, TOKENIZER), tokenizer.json.encode()
        if storage.read_bytes(uri, cfg.storage) != data:
            retract_manifest(cfg.output, cfg.storage)  # it names the tokenizer.json by sha256
            storage.write_bytes(uri, data, cfg.storage)
    return tokenizer


def _texts(cfg: PrepareConfig, parts: list[Partition]) -> Iterator[str]:
    """Every document of the input in order, read here: what a BPE is trained on."""
    fs, _ = storage.filesystem(cfg.input, cfg.storage)
    for part in parts:
        with storage.errors(part.name, cfg.storage):
            for texts, _, _ in records.read(
                fs, part, cfg.text_field, cfg.skip_bad_records, max_bytes=cfg.max_record_bytes
            ):
                yield from texts


def _validate(cfg: PrepareConfig) -> None:
    for key in ("seq_len", "rows_per_shard", "rows_per_group"):
        if getattr(cfg, key) < 1:
            raise DataError(f"{key}: must be positive, got {getattr(cfg, key)}")
    if cfg.executor not in EXECUTORS:
        raise DataError(f"executor: {cfg.executor!r} is none of {', '.join(EXECUTORS)}")
    for key in ("partition_bytes", "max_record_bytes"):
        if getattr(cfg, key) < 1:
            raise DataError(f"{key}: must be positive, got {getattr(cfg, key)}")
    if cfg.val_fraction is not None and not 0 <= cfg.val_fraction < 1:
        raise DataError(f"val_fraction: must be at least 0 and below 1, got {cfg.val_fraction}")
    if cfg.rows_per_shard * (cfg.seq_len + 1) >= 2**31:
        # Parquet list offsets are int32: a shard column holds fewer than 2**31 ids.
        raise DataError(
            f"rows_per_shard: {cfg.rows_per_shard} rows of {cfg.seq_len + 1} ids exceed 2**31 ids per shard"
        )
