"""The documents of a corpus of raw files, split into partitions that tasks read on their own.

A partition is a whole file, or a byte range of a large uncompressed JSONL or Parquet file:
a record (a Parquet row group) belongs to the range its first byte lies in, so the ranges of
a file together read each record once. Formats: JSONL (`.jsonl`, `.json`, plain or `.gz`/`.zst`-compressed), text
files (`.txt`, one document each), Parquet, and Hugging Face `datasets` saved to disk (the
Arrow stream files `data-*.arrow` of `save_to_disk`).

A record that is not UTF-8, not JSON or lacks the text field is a `BadRecord`, named by
file and line (or Parquet/Arrow row) in one line. With `skip` it is counted instead.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Iterator, Optional

import pyarrow as pa
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
    size: int  # of the whole file: a file that changed size is read again

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
    fs: pafs.FileSystem, part: Partition, text_field: str, skip: bool, batch: int = 1024
) -> Iterator[tuple[list[str], int, int]]:
    """(texts, bad records, bytes read) per batch of about `batch` records of `part`, in
    order. Empty and null texts are no documents and no bad records. Raises `BadRecord`
    unless `skip`."""
    reader = {"json": _json, "text": _text, "parquet": _parquet, "arrow": _arrow}[part.kind]
    texts, bad, at = [], 0, part.start
    for text, position in reader(fs, part, text_field):
        if isinstance(text, BadRecord):
            if not skip:
                raise text
            bad += 1
        elif text:
            texts.append(text)
        if len(texts) >= batch:
            yield texts, bad, position - at
            texts, bad, at = [], 0, position
    yield texts, bad, part.stop - at


def _bad(part: Partition, where: str, why: str) -> BadRecord:
    return BadRecord(f"{part.name}:{where}: {why} (--skip-bad-records skips and counts such records)")


def _lines(fs: pafs.FileSystem, part: Partition) -> Iterator[tuple[int, bytes]]:
    """(offset, line without its newline) of each line that starts in the partition."""
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
        rest, first = b"", part.start > 0 and not part.compression
        while True:
            # A small range reads little past its end: just enough to finish its last line.
            chunk = stream.read(CHUNK if part.compression else min(CHUNK, max(part.stop - offset, 1 << 16)))
            lines = (rest + chunk).split(b"\n")
            rest = lines.pop() if chunk else b""
            for line in lines:
                if first:
                    first = False  # the tail of a line begun before the range, or the newline before it
                elif offset >= part.stop and not part.compression:
                    return
                else:
                    yield offset, line
                offset += len(line) + 1
            if not chunk:
                return


def _line_number(fs: pafs.FileSystem, part: Partition, offset: int) -> int:
    """The 1-based line at byte `offset` of an uncompressed file: counted only when a
    record is bad, so that reading a range never reads the file before it."""
    lines = 1
    with fs.open_input_file(part.path) as f:
        for start in range(0, offset, CHUNK):
            lines += f.read(min(CHUNK, offset - start)).count(b"\n")
    return lines


def _json(fs: pafs.FileSystem, part: Partition, text_field: str) -> Iterator[tuple[object, int]]:
    for number, (offset, line) in enumerate(_lines(fs, part), start=1):
        if not line.strip():
            continue
        # A compressed file's offsets are of its decompressed bytes: it counts as read at its end.
        end = part.start if part.compression else offset + len(line) + 1
        try:
            record = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError as e:
            why = f"not UTF-8 (byte {e.start + 1})"
        except json.JSONDecodeError as e:
            why = f"not JSON ({e.msg}: column {e.colno})"
        else:
            if not isinstance(record, dict) or text_field not in record:
                why = f"no field {text_field!r}"
            elif not isinstance(record[text_field], (str, type(None))):
                why = f"field {text_field!r} is {type(record[text_field]).__name__}, not text"
            else:
                yield record[text_field], end
                continue
        line_no = number if part.start == 0 or part.compression else _line_number(fs, part, offset)
        yield _bad(part, f"line {line_no}", why), end


def _text(fs: pafs.FileSystem, part: Partition, text_field: str) -> Iterator[tuple[object, int]]:
    with fs.open_input_stream(part.path, compression=None) as f:
        data = f.read()
    try:
        yield data.decode("utf-8"), part.stop
    except UnicodeDecodeError as e:
        line, column = data.count(b"\n", 0, e.start) + 1, e.start - data.rfind(b"\n", 0, e.start)
        yield _bad(part, f"line {line}", f"not UTF-8 (byte {column})"), part.stop


def _columns(part: Partition, schema: pa.Schema, text_field: str) -> None:
    if text_field not in schema.names:
        raise DataError(f"text_field: no field {text_field!r} in {part.name} (fields: {', '.join(schema.names)})")
    kind = schema.field(text_field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise DataError(f"text_field: {text_field!r} in {part.name} is {kind}, not text")


def _rows(
    batches: Iterator[pa.RecordBatch], part: Partition, text_field: str, row: int = 0
) -> Iterator[tuple[object, int]]:
    """The texts of column `text_field`, from the file's row `row` on; a partition's bytes
    count as read once all its rows are."""
    for batch in batches:
        column = batch.column(text_field)
        try:
            texts = column.to_pylist()
        except UnicodeDecodeError:  # Parquet does not check that its strings are UTF-8
            texts = []
            for i in range(len(column)):
                try:
                    texts.append(column[i].as_py())
                except UnicodeDecodeError as e:
                    texts.append(_bad(part, f"row {row + i}", f"{text_field!r} is not UTF-8 (byte {e.start + 1})"))
        for text in texts:
            yield text, part.start
        row += len(column)


def _parquet(fs: pafs.FileSystem, part: Partition, text_field: str) -> Iterator[tuple[object, int]]:
    """The row groups that start in the partition's byte range (all of a whole file's)."""
    with fs.open_input_file(part.path) as f:
        parquet = pq.ParquetFile(f)
        _columns(part, parquet.schema_arrow, text_field)
        meta = parquet.metadata
        groups = [i for i in range(meta.num_row_groups) if part.start <= _group_start(meta.row_group(i)) < part.stop]
        if groups:
            first_row = sum(meta.row_group(i).num_rows for i in range(groups[0]))
            yield from _rows(parquet.iter_batches(columns=[text_field], row_groups=groups), part, text_field, first_row)


def _group_start(group: pq.RowGroupMetaData) -> int:
    column = group.column(0)
    return column.dictionary_page_offset if column.has_dictionary_page else column.data_page_offset


def _arrow(fs: pafs.FileSystem, part: Partition, text_field: str) -> Iterator[tuple[object, int]]:
    with fs.open_input_file(part.path) as f:
        try:
            reader = pa.ipc.open_stream(f)
        except pa.ArrowInvalid:
            f.seek(0)
            reader = pa.ipc.open_file(f)
        _columns(part, reader.schema, text_field)
        yield from _rows(
            iter(reader)
            if isinstance(reader, pa.ipc.RecordBatchStreamReader)
            else (reader.get_batch(i) for i in range(reader.num_record_batches)),
            part,
            text_field,
        )
