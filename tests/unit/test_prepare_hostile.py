"""`prepare` on hostile input, with its local executor: every record or file that holds no
document is named in one line (file and line or row) or, with --skip-bad-records, skipped and
counted; a file is read in one pass in bounded memory however long its lines; a rerun that
stops on the way never leaves a manifest naming shards it rewrote; an input edited in place
is read again; and a share of the documents is held out for validation unless told not to."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

import wildtrain.data.prepare as prepare_module
from tests.conftest import REPO
from wildtrain.data import records
from wildtrain.data.dataset import OpenedData
from wildtrain.data.manifest import DataError, read_manifest, verify
from wildtrain.data.prepare import PrepareConfig, prepare, val_share
from wildtrain.data.validation import ValidationSet

TEXTS = [json.loads(line)["text"] for line in (REPO / "tests/assets/tiny_corpus.jsonl").read_text().splitlines()]
SETTINGS = {"seq_len": 64, "rows_per_shard": 100, "rows_per_group": 50, "executor": "local"}
GOOD = "".join(json.dumps({"text": t}) + "\n" for t in TEXTS[:20])


def parquet_bytes(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, row_group_size=10)
    return sink.getvalue().to_pybytes()


def arrow_bytes(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=10)
    return sink.getvalue().to_pybytes()


TABLE = pa.table({"text": TEXTS[:40]})
# name -> (bytes, where and why in the one line, records counted with --skip-bad-records)
HOSTILE = {
    "surrogate.jsonl": (
        (GOOD + '{"text": "broken emoji \\ud83d here"}\n').encode(),
        r":line 21: field 'text' holds a lone surrogate \\ud83d \(character 14\)",
        1,
    ),
    "nul.jsonl": (
        GOOD.encode() + b'{"text": "a raw \x00 byte"}\n',
        r":line 21: not JSON \(Invalid control character",
        1,
    ),
    "latin1.jsonl": (GOOD.encode() + b'{"text": "caf\xe9"}\n', r":line 21: not UTF-8 \(byte 14\)", 1),
    "deep.jsonl": (GOOD.encode() + b"[" * 100_000 + b"\n", r":line 21: not JSON \(RecursionError", 1),
    "empty.parquet": (b"", r": not a readable Parquet file \(Parquet file size is 0 bytes\)", 1),
    "truncated.parquet": (parquet_bytes(TABLE)[:-100], r": not a readable Parquet file \(Parquet magic bytes", 1),
    "null.parquet": (parquet_bytes(pa.table({"text": [None] * 7})), r": column 'text' is null, not text", 7),
    "number.parquet": (parquet_bytes(pa.table({"text": list(range(5))})), r": column 'text' is int64, not text", 5),
    "empty.arrow": (b"", r": not a readable Arrow file", 1),
    "truncated.arrow": (arrow_bytes(TABLE)[:-300], r": truncated: it ends inside a record batch", 1),
}


def good_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "a-good.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    return folder


@pytest.mark.parametrize("name", HOSTILE)
def test_a_hostile_input_is_named_in_one_line_or_skipped_and_counted(tmp_path, name):
    data, why, count = HOSTILE[name]
    folder = good_folder(tmp_path)
    (folder / name).write_bytes(data)
    with pytest.raises(DataError, match=rf"^{folder / name}{why}") as failure:
        prepare(PrepareConfig(input=str(folder), output=str(tmp_path / "out"), **SETTINGS))
    assert "\n" not in str(failure.value)
    result = prepare(PrepareConfig(input=str(folder), output=str(tmp_path / "out"), skip_bad_records=True, **SETTINGS))
    assert result.manifest.bad_records == {str(folder / name): count}


def test_nul_characters_and_empty_files_are_text_and_no_documents(tmp_path):
    """A NUL the JSON escapes, or one in a text file, is a character like any other; an empty
    file holds no documents and is no bad record."""
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "escaped.jsonl").write_text(json.dumps({"text": "nul \u0000 inside"}) + "\n")
    (folder / "raw.txt").write_bytes(b"a raw \x00 byte")
    (folder / "empty.jsonl").write_bytes(b"")
    (folder / "empty.txt").write_bytes(b"")
    paths = sorted(str(p) for p in folder.iterdir())
    files = records.documents(paths, [os.path.getsize(p) for p in paths])
    fs = pafs.LocalFileSystem()
    texts = [
        t for part in records.split(files, 1 << 20) for ts, _, _ in records.read(fs, part, "text", False) for t in ts
    ]
    assert texts == ["nul \x00 inside", "a raw \x00 byte"]
    (folder / "escaped.jsonl").unlink()
    (folder / "raw.txt").unlink()
    with pytest.raises(DataError, match=rf"^input: {folder} holds no documents$"):
        prepare(PrepareConfig(input=str(folder), output=str(tmp_path / "out"), **SETTINGS))


class CountingFileSystem:
    """The local filesystem, counting the files opened and the bytes read: passes over a file."""

    def __init__(self) -> None:
        self.opened, self.read = 0, 0

    def open_input_file(self, path: str) -> "Counted":
        self.opened += 1
        return Counted(self, pa.OSFile(path))


class Counted:
    def __init__(self, fs: CountingFileSystem, f) -> None:
        self.fs, self.f = fs, f

    def seek(self, offset: int) -> None:
        self.f.seek(offset)

    def read(self, size: int = -1) -> bytes:
        data = self.f.read(size)
        self.fs.read += len(data)
        return data

    def __enter__(self) -> "Counted":
        return self

    def __exit__(self, *_) -> None:
        self.f.close()


def test_skipping_bad_records_reads_each_range_once(tmp_path):
    """Skipped records are counted, never named: no range reads the file before it to number their lines."""
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\noops\n" for t in TEXTS))
    size = path.stat().st_size
    parts = records.split([(str(path), size, "json", None)], 10_000)
    assert len(parts) > 20
    fs = CountingFileSystem()
    read = [(len(texts), bad) for part in parts for texts, bad, _ in records.read(fs, part, "text", True)]
    assert sum(n for n, _ in read) == sum(b for _, b in read) == len(TEXTS)
    assert fs.opened == len(parts)
    assert fs.read < size + len(parts) * (1 << 16)  # each range reads at most a small read past its end


def test_a_line_is_streamed_in_bounded_memory_and_one_too_long_is_counted_never_held(tmp_path):
    chunk = records.CHUNK
    path = tmp_path / "long.jsonl"
    longest = 3 * chunk  # a line longer than any read
    with open(path, "w") as f:
        f.write(json.dumps({"text": "x" * (longest - 20)}) + "\n")  # just under the limit
        f.write(json.dumps({"text": "y" * (8 * chunk)}) + "\n")  # over it
        f.write(json.dumps({"text": "last"}) + "\n")
    size = path.stat().st_size
    (part,) = records.split([(str(path), size, "json", None)], size)
    fs = pafs.LocalFileSystem()
    tracemalloc.start()
    try:
        batches = list(records.read(fs, part, "text", True, max_bytes=longest))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    texts = [t for texts, _, _ in batches for t in texts]
    assert [len(t) for t in texts] == [longest - 20, 4] and sum(bad for _, bad, _ in batches) == 1
    # The kept line held a few times over (its pieces, their join, its text), the long one never.
    assert peak < 5 * longest
    too_long = len(json.dumps({"text": "y" * (8 * chunk)}))
    with pytest.raises(DataError, match=rf"^{path}:line 2: {too_long:,} bytes, longer than the longest record read"):
        list(records.read(fs, part, "text", False, max_bytes=longest))


def test_a_text_file_longer_than_a_record_is_refused_unread(tmp_path):
    path = tmp_path / "big.txt"
    path.write_bytes(b"word " * 1000)
    size = path.stat().st_size
    (part,) = records.split([(str(path), size, "text", None)], size)
    fs = CountingFileSystem()
    with pytest.raises(DataError, match=rf"^{path}: a text file is one document: 5,000 bytes, longer than"):
        list(records.read(fs, part, "text", False, max_bytes=4096))
    assert list(records.read(fs, part, "text", True, max_bytes=4096)) == [([], 1, size)]
    assert fs.opened == 0


def test_a_rerun_that_stops_on_the_way_leaves_no_manifest_naming_shards_it_rewrote(tmp_path, monkeypatch):
    folder = good_folder(tmp_path)
    out = tmp_path / "out"
    prepare(PrepareConfig(input=str(folder), output=str(out), **{**SETTINGS, "rows_per_shard": 20}))
    encode, calls = prepare_module.encode_shard, []

    def stops_at_the_fifth(*args, **kwargs):
        calls.append(args[0])
        if len(calls) == 5:
            raise RuntimeError("the machine went away")
        return encode(*args, **kwargs)

    monkeypatch.setattr(prepare_module, "encode_shard", stops_at_the_fifth)
    other = PrepareConfig(input=str(folder), output=str(out), **{**SETTINGS, "rows_per_shard": 20, "seq_len": 32})
    with pytest.raises(RuntimeError):
        prepare(other)
    if (out / "manifest.json").exists():
        verify(str(out), read_manifest(str(out)))  # every shard it names, as it names it
    monkeypatch.setattr(prepare_module, "encode_shard", encode)
    prepare(other)
    verify(str(out), read_manifest(str(out)))


def test_an_input_edited_in_place_at_the_same_size_and_time_is_read_again(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    cfg = PrepareConfig(input=str(path), output=str(tmp_path / "out"), **SETTINGS)
    first = prepare(cfg)
    assert prepare(cfg).parts[0].read is False
    stat = path.stat()
    data = path.read_bytes()
    at = data.index(b"a")
    path.write_bytes(data[:at] + b"b" + data[at + 1 :])
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    again = prepare(cfg)
    assert again.parts[0].read is True
    assert [s.sha256 for s in again.manifest.shards] != [s.sha256 for s in first.manifest.shards]


def test_a_share_is_held_out_by_default_and_none_at_val_fraction_0(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    held = prepare(PrepareConfig(input=str(corpus), output=str(tmp_path / "held"), **SETTINGS))
    assert held.manifest.validation and held.held_out >= 1 and held.val_share == 0.005
    none = prepare(PrepareConfig(input=str(corpus), output=str(tmp_path / "none"), val_fraction=0, **SETTINGS))
    assert none.manifest.validation == [] and none.held_out == 0 and none.val_share == 0
    assert none.manifest.rows > held.manifest.rows
    # A small input holds out a few rows' worth, not 0.5% of little.
    small = tmp_path / "small.jsonl"
    small.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS[:100]))
    few = prepare(PrepareConfig(input=str(small), output=str(tmp_path / "few"), **SETTINGS))
    assert few.val_share > 0.005 and sum(s.rows for s in few.manifest.validation) >= 1


def test_the_default_validation_share_has_a_floor_of_a_few_rows_and_a_cap_and_a_given_one_is_kept():
    assert val_share(None, 10**9, 1024) == 0.005
    assert val_share(None, 100_000, 127) == 8 * 128 / 100_000
    assert val_share(None, 1000, 127) == 0.05
    assert val_share(0.001, 1000, 127) == 0.001
    assert val_share(0.0, 1000, 127) == 0.0


def test_the_default_share_of_an_input_of_a_few_documents_may_fill_no_row_and_says_so(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS[:3]))
    result = prepare(PrepareConfig(input=str(path), output=str(tmp_path / "out"), **{**SETTINGS, "seq_len": 16}))
    assert result.manifest.validation == [] and result.val_share == 0.05
    with pytest.raises(DataError, match=r"^val_fraction: 0.05 of .* held out too little text to fill one row"):
        prepare(
            PrepareConfig(
                input=str(path), output=str(tmp_path / "out"), val_fraction=0.05, **{**SETTINGS, "seq_len": 16}
            )
        )


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO / "platform")}
    command = [sys.executable, str(REPO / "data_pipelines/prepare.py"), "--executor", "local", "--seq-len", "16"]
    return subprocess.run([*command, *args], env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("name", ["surrogate.jsonl", "empty.parquet", "truncated.arrow", "number.parquet"])
def test_the_command_names_a_hostile_input_in_one_line_without_a_traceback(tmp_path, name):
    (tmp_path / name).write_bytes(HOSTILE[name][0])
    done = run_cli("--input", str(tmp_path / name), "--output", str(tmp_path / "out"))
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.splitlines()[-1].startswith(f"prepare: {tmp_path / name}:"), done.stderr


def test_the_command_skips_and_counts_every_hostile_input_and_says_what_it_held_out(tmp_path):
    folder = good_folder(tmp_path)
    for name, (data, _, _) in HOSTILE.items():
        (folder / name).write_bytes(data)
    done = run_cli("--input", str(folder), "--output", str(tmp_path / "out"), "--skip-bad-records")
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    bad = sum(count for _, _, count in HOSTILE.values())
    assert f"{bad} bad records skipped in {len(HOSTILE)} files" in done.stdout
    assert "documents held out for validation (a share of 0.005) in" in done.stdout


def test_a_run_whose_data_holds_no_validation_rows_has_a_line_to_say_so():
    assert OpenedData([], 1, {}).no_validation.startswith("no validation set: ")
    assert OpenedData([], 1, {}, validation=[ValidationSet("tiny", "/data/tiny", ())]).no_validation is None
