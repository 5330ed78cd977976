"""The documents of a corpus of raw files, split into partitions that tasks read on their own.

A partition is a whole file, or a byte range of a large uncompressed JSONL or Parquet file:
a record (a Parquet row group) belongs to the range its first byte lies in, so the ranges of
a file together read each record once. Formats: JSONL (`.jsonl`, `.json`, plain or `.gz`/`.zst`-compressed), text
files (`.txt`, one document each), Parquet, and Hugging Face `datasets` saved to disk (the
Arrow stream files `data-*.arrow` of `save_to_disk`).

A record that is not UTF-8, holds a lone surrogate, is not JSON, lacks the text field or is
longer than `max_bytes`, and a Parquet or Arrow file that cannot be read or whose text column
is not text, is a `BadRecord`, named by file and line (or row) in one line. With `skip` it
is counted instead. Every reader streams its file in bounded memory: a line is held only up
to `max_bytes`, and a text file longer than that is refused unread.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, replace
from pathlib import PurePosixPath
from typing import Iterator, Optional, Union

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from wildtrain.data.manifest import DataError

# Name ending -> (kind, compression).
FORMATS = {
    ".jsonl": ("json", None),
    ".json": ("json", None),
    ".jsonl.gz": ("json", "gzip"),
    ".json.gz": ("json", "gzip"),
    ".jsonl.zst": ("json", "zstd"),
    ".json.zst": ("json", "zstd"),
    ".txt": ("text", None),
    ".parquet": ("parquet", None),
    ".arrow": ("arrow", None),
}
# What `datasets.save_to_disk` writes beside its Arrow files: descriptions, not documents.
HF_METADATA = {"state.json", "dataset_info.json", "dataset_dict.json"}
CHUNK = 8 << 20  # bytes read at once from a JSONL file
# The longest record read as one document: its text, its ids and the tokenizer's working
# copies of them must fit a task's memory many times over.
MAX_RECORD_BYTES = 64 << 20
SURROGATE = re.compile("[\ud800-\udfff]")  # what a JSON \u escape can hold that UTF-8 cannot


class BadRecord(DataError):
    """One record that cannot be read as a document; the message names its file and line or row."""


@dataclass(frozen=True)
class Partition:
    """Bytes `start`..`stop` of `path` (the whole file unless a large plain JSONL or Parquet file)."""

    path: str  # on the input's filesystem
    name: str  # as the user wrote it (with its scheme): what messages and the manifest say
    kind: str  # json | text | parquet | arrow
    compression: Optional[str]
    start: int
    stop: int
    size: int  # of the whole file

    @property
    def bytes(self) -> int:
        return self.stop - self.start


def kind_of(path: str) -> Optional[tuple[str, Optional[str]]]:
    name = PurePosixPath(path).name
    for ending in sorted(FORMATS, key=len, reverse=True):
        if name.endswith(ending):
            return FORMATS[ending]
    return None


def documents(paths: list[str], sizes: list[int]) -> list[tuple[str, int, str, Optional[str]]]:
    """(path, size, kind, compression) of the input files that hold documents, in order:
    files of no known format, and the metadata `datasets.save_to_disk` keeps beside its
    Arrow files, are no input."""
    arrow_dirs = {PurePosixPath(p).parent for p in paths if kind_of(p) == ("arrow", None)}

    def metadata(path: PurePosixPath) -> bool:
        return path.name == "dataset_dict.json" or (path.name in HF_METADATA and path.parent in arrow_dirs)

    return [
        (path, size, *kind)
        for path, size in zip(paths, sizes)
        if (kind := kind_of(path)) is not None and not metadata(PurePosixPath(path))
    ]


def split(files: list[tuple[str, int, str, Optional[str]]], partition_bytes: int, scheme: str = "") -> list[Partition]:
    """The partitions of `files` (see `documents`), in input order: a plain JSONL or a
    Parquet file in ranges of `partition_bytes`, any other file whole. Pure."""
    parts = []
    for path, size, kind, compression in files:
        ranges = [(0, size)]
        if kind in ("json", "parquet") and compression is None and size > partition_bytes:
            ranges = [(start, min(start + partition_bytes, size)) for start in range(0, size, partition_bytes)]
        parts += [Partition(path, scheme + path, kind, compression, start, stop, size) for start, stop in ranges]
    return parts


def read(
    fs: pafs.FileSystem,
    part: Partition,
    text_field: str,
    skip: bool,
    batch: int = 1024,
    max_bytes: int = MAX_RECORD_BYTES,
) -> Iterator[tuple[list[str], int, int]]:
    """(texts, bad records, bytes read) per batch of about `batch` records of `part`, in
    order. Empty and null texts are no documents and no bad records. Raises `BadRecord`
    unless `skip`."""
    reader = {"json": _json, "text": _text, "parquet": _parquet, "arrow": _arrow}[part.kind]
    texts, bad, at = [], 0, part.start
    for text, position in reader(fs, part, text_field, max_bytes):
        if isinstance(text, Bad):
            if not skip:
                raise _named(fs, part, text)
            bad += text.records
        elif text:
            texts.append(text)
        if len(texts) >= batch:
            yield texts, bad, position - at
            texts, bad, at = [], 0, position
    yield texts, bad, part.stop - at


def digest(fs: pafs.FileSystem, part: Partition) -> str:
    """The sha256 of the partition's bytes, read in bounded chunks: what tells an input edited
    in place, at any size, from the one a stored part record was prepared from."""
    sha = hashlib.sha256()
    with fs.open_input_file(part.path) as f:
        f.seek(part.start)
        for start in range(part.start, part.stop, CHUNK):
            sha.update(f.read(min(CHUNK, part.stop - start)))
    return sha.hexdigest()


@dataclass(frozen=True)
class Bad:
    """A record that is no document, located but not yet named: naming a line of a later
    range means counting the lines before it, which only a record that stops the run is worth."""

    why: str
    line: Optional[int] = None  # 1-based
    offset: Optional[int] = None  # where the line starts in an uncompressed file, when `line` is not known
    row: Optional[int] = None
    records: int = 1  # the records it stands for: a column that is not text stands for all its rows


def _named(fs: pafs.FileSystem, part: Partition, bad: Bad) -> BadRecord:
    if bad.row is not None:
        where = f":row {bad.row}"
    elif bad.line is not None or bad.offset is not None:
        where = f":line {bad.line if bad.line is not None else _line_number(fs, part, bad.offset or 0)}"
    else:
        where = ""  # the whole file
    return BadRecord(f"{part.name}{where}: {bad.why} (--skip-bad-records skips and counts such records)")


def _too_long(length: int, max_bytes: int) -> str:
    return f"{length:,} bytes, longer than the longest record read ({max_bytes:,}: --max-record-mb)"


def _lines(fs: pafs.FileSystem, part: Partition, max_bytes: int) -> Iterator[tuple[int, int, Optional[bytes]]]:
    """(offset, length, line without its newline) of each line that starts in the partition;
    the line is None when longer than `max_bytes`, which is counted through and never held."""
    if part.compression:
        stream = fs.open_input_stream(part.path, compression=part.compression)
        offset = 0
    else:
        stream = fs.open_input_file(part.path)
        # A line starts in the range when the byte before it is a newline: the one at
        # `start - 1` belongs to the previous partition, which reads that line whole.
        offset = max(part.start - 1, 0)
        stream.seek(offset)
    with stream:
        pieces: list[bytes] = []  # of the line being read, each byte copied once when it ends
        length, position, first = 0, offset, part.start > 0 and not part.compression
        while True:
            # A small range reads little past its end: just enough to finish its last line.
            size = CHUNK if part.compression else min(CHUNK, max(part.stop - position, length, 1 << 16))
            chunk = stream.read(size)
            position += len(chunk)
            at = 0
            while True:
                # At the end of the file, a last line without its newline ends there.
                end = chunk.find(b"\n", at) if chunk else (0 if length else -1)
                if end < 0:
                    break
                length += end - at
                line = None if length > max_bytes else b"".join([*pieces, chunk[at:end]])
                if first:
                    first = False  # the tail of a line begun before the range, or the newline before it
                elif offset >= part.stop and not part.compression:
                    return
                else:
                    yield offset, length, line
                offset += length + 1
                pieces, length, at = [], 0, end + 1
            if not chunk:
                return
            length += len(chunk) - at
            if length <= max_bytes:
                pieces.append(chunk[at:])
            else:
                pieces = []


def _line_number(fs: pafs.FileSystem, part: Partition, offset: int) -> int:
    """The 1-based line at byte `offset` of an uncompressed file: counted only when a
    record stops the run, so that reading a range never reads the file before it."""
    lines = 1
    with fs.open_input_file(part.path) as f:
        for start in range(0, offset, CHUNK):
            lines += f.read(min(CHUNK, offset - start)).count(b"\n")
    return lines


def _json(fs: pafs.FileSystem, part: Partition, text_field: str, max_bytes: int) -> Iterator[tuple[object, int]]:
    for number, (offset, length, line) in enumerate(_lines(fs, part, max_bytes), start=1):
        # A compressed file's offsets are of its decompressed bytes: it counts as read at its end.
        end = part.start if part.compression else offset + length + 1
        if line is not None and not line.strip():
            continue
        text = Bad(_too_long(length, max_bytes)) if line is None else _json_text(line, text_field)
        if isinstance(text, Bad):
            where = {"line": number} if part.start == 0 or part.compression else {"offset": offset}
            text = replace(text, **where)
        yield text, end


def _json_text(line: bytes, text_field: str) -> Union[str, None, Bad]:
    """The text of a JSONL line (None: a null one), or why it holds none, not yet located."""
    try:
        record = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as e:
        return Bad(f"not UTF-8 (byte {e.start + 1})")
    except json.JSONDecodeError as e:
        return Bad(f"not JSON ({e.msg}: column {e.colno})")
    except (ValueError, RecursionError) as e:  # an integer of too many digits, arrays nested too deeply
        return Bad(f"not JSON ({type(e).__name__}: {' '.join(str(e).split())})")
    if not isinstance(record, dict) or text_field not in record:
        return Bad(f"no field {text_field!r}")
    text = record[text_field]
    if not isinstance(text, (str, type(None))):
        return Bad(f"field {text_field!r} is {type(text).__name__}, not text")
    # Only a \u escape makes a surrogate: the text of any other line is UTF-8 already.
    if text and b"\\u" in line and (surrogate := SURROGATE.search(text)):
        code = f"\\u{ord(surrogate.group()):04x}"
        return Bad(f"field {text_field!r} holds a lone surrogate {code} (character {surrogate.start() + 1})")
    return text


def _text(fs: pafs.FileSystem, part: Partition, text_field: str, max_bytes: int) -> Iterator[tuple[object, int]]:
    if part.size > max_bytes:
        yield Bad(f"a text file is one document: {_too_long(part.size, max_bytes)}"), part.stop
        return
    with fs.open_input_stream(part.path, compression=None) as f:
        data = f.read()
    try:
        yield data.decode("utf-8"), part.stop
    except UnicodeDecodeError as e:
        line, column = data.count(b"\n", 0, e.start) + 1, e.start - data.rfind(b"\n", 0, e.start)
        yield Bad(f"not UTF-8 (byte {column})", line=line), part.stop


def _not_text(part: Partition, schema: pa.Schema, text_field: str) -> Optional[str]:
    """Why the file's `text_field` column holds no text, if it does not."""
    if text_field not in schema.names:
        return f"no column {text_field!r} (columns: {', '.join(schema.names)}; --text-field names another)"
    kind = schema.field(text_field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        return f"column {text_field!r} is {kind}, not text"
    return None


def _rows(
    batches: Iterator[pa.RecordBatch], part: Partition, text_field: str, max_bytes: int, row: int = 0
) -> Iterator[tuple[object, int]]:
    """The texts of column `text_field`, from the file's row `row` on; a partition's bytes
    count as read once all its rows are."""
    for batch in batches:
        column = batch.column(text_field)
        lengths = pc.binary_length(column)
        long = pc.indices_nonzero(pc.fill_null(pc.greater(lengths, max_bytes), False)).to_pylist()
        if long:
            column = pc.if_else(pc.is_in(pa.array(range(len(column))), pa.array(long)), None, column)
        try:
            texts = column.to_pylist()
        except UnicodeDecodeError:  # Parquet does not check that its strings are UTF-8
            texts = []
            for i in range(len(column)):
                try:
                    texts.append(column[i].as_py())
                except UnicodeDecodeError as e:
                    texts.append(Bad(f"{text_field!r} is not UTF-8 (byte {e.start + 1})", row=row + i))
        for i in long:
            texts[i] = Bad(f"{text_field!r} is {_too_long(lengths[i].as_py(), max_bytes)}", row=row + i)
        for text in texts:
            yield text, part.start
        row += len(column)


def _parquet(fs: pafs.FileSystem, part: Partition, text_field: str, max_bytes: int) -> Iterator[tuple[object, int]]:
    """The row groups that start in the partition's byte range (all of a whole file's). A file
    that is no Parquet is one bad record, of its first range."""
    with fs.open_input_file(part.path) as f:
        try:
            parquet = pq.ParquetFile(f)
        except pa.ArrowInvalid as e:  # empty, truncated, or no Parquet at all
            if part.start == 0:
                yield Bad(f"not a readable Parquet file ({' '.join(str(e).split())})"), part.stop
            return
        meta = parquet.metadata
        groups = [i for i in range(meta.num_row_groups) if part.start <= _group_start(meta.row_group(i)) < part.stop]
        if not groups:
            return
        why = _not_text(part, parquet.schema_arrow, text_field)
        if why is not None:
            yield Bad(why, records=sum(meta.row_group(i).num_rows for i in groups)), part.stop
            return
        first_row = sum(meta.row_group(i).num_rows for i in range(groups[0]))
        try:
            yield from _rows(
                parquet.iter_batches(columns=[text_field], row_groups=groups), part, text_field, max_bytes, first_row
            )
        except pa.ArrowInvalid as e:
            yield Bad(f"not a readable Parquet file ({' '.join(str(e).split())})"), part.stop


def _group_start(group: pq.RowGroupMetaData) -> int:
    column = group.column(0)
    return column.dictionary_page_offset if column.has_dictionary_page else column.data_page_offset


def _arrow(fs: pafs.FileSystem, part: Partition, text_field: str, max_bytes: int) -> Iterator[tuple[object, int]]:
    with fs.open_input_file(part.path) as f:
        try:
            try:
                reader = pa.ipc.open_stream(f)
            except pa.ArrowInvalid:
                f.seek(0)
                reader = pa.ipc.open_file(f)
        except pa.ArrowInvalid as e:  # empty, truncated, or no Arrow at all
            yield Bad(f"not a readable Arrow file ({' '.join(str(e).split())})"), part.stop
            return
        batches = (
            iter(reader)
            if isinstance(reader, pa.ipc.RecordBatchStreamReader)
            else (reader.get_batch(i) for i in range(reader.num_record_batches))
        )
        why = _not_text(part, reader.schema, text_field)
        if why is not None:
            yield Bad(why, records=sum(len(batch) for batch in batches)), part.stop
            return
        try:
            yield from _rows(batches, part, text_field, max_bytes)
        except pa.ArrowInvalid as e:
            yield Bad(f"not a readable Arrow file ({' '.join(str(e).split())})"), part.stop
        except OSError:
            if f.tell() < f.size():
                raise  # a read that failed, for the caller to name as such
            yield Bad("truncated: it ends inside a record batch"), part.stop
