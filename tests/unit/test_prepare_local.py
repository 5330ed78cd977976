"""`prepare` on local files with its local executor (partitions one after another in this
process; tests/integration/test_prepare.py runs them as Ray tasks against SeaweedFS): bad
records are named in one line or skipped and counted, compressed and Arrow inputs read as
plain JSONL does, byte ranges of a file read each record once, and a killed run resumes to
byte-identical output."""

from __future__ import annotations

import gzip
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from tests.conftest import REPO
from wildtrain.data import records
from wildtrain.data.manifest import DataError, read_manifest, verify
from wildtrain.data.prepare import PrepareConfig, RowPacker, prepare
from wildtrain.data.progress import Progress, progress_line

TEXTS = [json.loads(line)["text"] for line in (REPO / "tests/assets/tiny_corpus.jsonl").read_text().splitlines()]
SETTINGS = {"seq_len": 64, "rows_per_shard": 100, "rows_per_group": 50, "executor": "local"}


def write_jsonl(path: Path, texts: list[str], extra: str = "") -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts) + extra)
    return path


def corpus(folder: Path, files: int = 3, bad_line: str = "") -> Path:
    """The tiny corpus in `files` JSONL files; `bad_line` appended to the second."""
    folder.mkdir()
    for i in range(files):
        write_jsonl(folder / f"part-{i}.jsonl", TEXTS[i::files], bad_line if i == 1 else "")
    return folder


@pytest.mark.parametrize(
    "line, why",
    [
        ("{not json\n", r"not JSON \(Expecting property name enclosed in double quotes: column 2\)"),
        ('{"body": "x"}\n', r"no field 'text'"),
        ('{"text": 7}\n', r"field 'text' is int, not text"),
        ('["text"]\n', r"no field 'text'"),
    ],
)
def test_a_bad_record_stops_in_one_line_naming_file_and_line_or_is_skipped_and_counted(tmp_path, line, why):
    folder = corpus(tmp_path / "in", bad_line=line)
    bad_file = folder / "part-1.jsonl"
    line_no = len(TEXTS[1::3]) + 1
    with pytest.raises(DataError, match=rf"^{bad_file}:line {line_no}: {why} \(--skip-bad-records") as failure:
        prepare(PrepareConfig(input=str(folder), output=str(tmp_path / "out"), **SETTINGS))
    assert "\n" not in str(failure.value)
    result = prepare(PrepareConfig(input=str(folder), output=str(tmp_path / "out"), skip_bad_records=True, **SETTINGS))
    assert result.manifest.bad_records == {str(bad_file): 1}
    assert read_manifest(str(tmp_path / "out")).bad_records == {str(bad_file): 1}


def test_bytes_that_are_not_utf8_are_named_by_line(tmp_path):
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "a.jsonl").write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(DataError, match=rf"^{folder}/a.jsonl:line 2: not UTF-8 \(byte 14\)"):
        prepare(PrepareConfig(input=str(folder), output=str(tmp_path / "out"), **SETTINGS))
    (folder / "a.jsonl").unlink()
    (folder / "b.txt").write_bytes(b"one\ntwo \xff\n")
    with pytest.raises(DataError, match=rf"^{folder}/b.txt:line 2: not UTF-8 \(byte 5\)"):
        prepare(PrepareConfig(input=str(folder), output=str(tmp_path / "out"), **SETTINGS))


def test_compressed_and_arrow_inputs_give_the_shards_plain_jsonl_gives(tmp_path):
    # A share given: the default one of a small input grows with its stored (compressed) size.
    settings = {**SETTINGS, "val_fraction": 0.05}
    plain = prepare(
        PrepareConfig(input=str(write_jsonl(tmp_path / "c.jsonl", TEXTS)), output=str(tmp_path / "plain"), **settings)
    ).manifest
    data = (tmp_path / "c.jsonl").read_bytes()
    (tmp_path / "gz").mkdir()
    (tmp_path / "gz/c.jsonl.gz").write_bytes(gzip.compress(data))
    (tmp_path / "zst").mkdir()
    with pa.CompressedOutputStream(str(tmp_path / "zst/c.jsonl.zst"), "zstd") as f:
        f.write(data)
    import datasets

    datasets.Dataset.from_dict({"id": list(range(len(TEXTS))), "text": TEXTS}).save_to_disk(str(tmp_path / "hf"))
    assert {p.name for p in (tmp_path / "hf").iterdir()} >= {"state.json", "dataset_info.json"}
    for kind in ("gz", "zst", "hf"):
        manifest = prepare(
            PrepareConfig(input=str(tmp_path / kind), output=str(tmp_path / f"out-{kind}"), **settings)
        ).manifest
        assert [s.sha256 for s in manifest.shards + manifest.validation] == [
            s.sha256 for s in plain.shards + plain.validation
        ], kind


def test_a_parquet_row_that_is_not_utf8_is_named_by_row(tmp_path):
    texts = pa.array([b"good text", b"bad \xff text"], pa.binary()).cast(pa.string(), safe=False)
    pq.write_table(pa.table({"text": texts}), tmp_path / "t.parquet")
    with pytest.raises(DataError, match=rf"^{tmp_path}/t.parquet:row 1: 'text' is not UTF-8"):
        prepare(PrepareConfig(input=str(tmp_path / "t.parquet"), output=str(tmp_path / "out"), **SETTINGS))


def test_byte_ranges_of_a_file_read_every_record_once(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", TEXTS, extra='\n{"text": "last, no newline"}')
    size = path.stat().st_size
    fs = pafs.LocalFileSystem()
    whole = [
        t
        for texts, _, _ in records.read(fs, records.split([(str(path), size, "json", None)], size)[0], "text", False)
        for t in texts
    ]
    assert whole == TEXTS + ["last, no newline"]
    for partition_bytes in (50, 4096, size - 1):  # ranges with no record's start in them, too
        parts = records.split([(str(path), size, "json", None)], partition_bytes)
        assert sum(p.bytes for p in parts) == size
        read = [(t, n) for p in parts for texts, _, n in records.read(fs, p, "text", False, batch=7) for t in texts]
        assert [t for t, _ in read] == whole, partition_bytes


def test_byte_ranges_of_a_parquet_file_read_every_row_group_once(tmp_path):
    path = tmp_path / "c.parquet"
    pq.write_table(pa.table({"text": TEXTS}), path, row_group_size=100)
    size = path.stat().st_size
    fs = pafs.LocalFileSystem()
    for partition_bytes in (1000, 20_000, size):
        parts = records.split([(str(path), size, "parquet", None)], partition_bytes)
        read = [t for p in parts for texts, _, _ in records.read(fs, p, "text", False) for t in texts]
        assert read == TEXTS, partition_bytes
    assert len(records.split([(str(path), size, "parquet", None)], 20_000)) > 1


def test_a_bad_record_in_a_later_range_is_named_by_its_line_in_the_file(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", TEXTS, extra="oops\n")
    with pytest.raises(DataError, match=rf"^{path}:line {len(TEXTS) + 1}: not JSON"):
        prepare(PrepareConfig(input=str(path), output=str(tmp_path / "out"), partition_bytes=10_000, **SETTINGS))


def test_datasets_metadata_beside_arrow_files_is_no_input():
    paths = [
        "d/train/data-00000-of-00001.arrow",
        "d/train/state.json",
        "d/train/dataset_info.json",
        "d/dataset_dict.json",
        "e/state.json",
    ]
    assert [f[0] for f in records.documents(paths, [1] * 5)] == [paths[0], "e/state.json"]


def test_doc_ids_stay_distinct_within_rows_past_2_to_the_31_documents():
    packer = RowPacker(seq_len=7, eos_id=0, rows_per_shard=100, first_doc=2**31 - 3)
    documents = pa.array([[1, 2, 3]] * 8, pa.list_(pa.int32()))  # 4 ids each with its end id
    ((_, doc_ids),) = [*packer.add(documents), *packer.finish()]
    assert doc_ids.dtype == np.int32 and doc_ids.min() >= 0
    flat = doc_ids.ravel()
    assert flat[:12].tolist() == [2**31 - 3] * 4 + [2**31 - 2] * 4 + [2**31 - 1] * 4
    assert flat[12:16].tolist() == [0] * 4  # the 2**31st document wraps: still unlike its neighbours
    for row in doc_ids:
        starts = np.flatnonzero(np.diff(row, prepend=row[0] - 1))
        assert len(starts) == len(set(row.tolist()))  # each document one run, none equal to another


def test_progress_line_says_bytes_documents_rate_eta_and_shards():
    line = progress_line(
        done=250_000_000,
        total=1_000_000_000,
        documents=12_345,
        tokens=5_000_000,
        tokenized=250_000_000,
        shards=7,
        parts_done=1,
        parts=4,
        elapsed=10.0,
    )
    assert line == (
        "prepare: 250.0 MB of 1.0 GB (25%), 12,345 documents, 500,000 tokens/s, ETA 30 s, "
        "7 shards written, 1/4 partitions"
    )


def test_progress_off_a_terminal_prints_plain_lines():
    out = io.StringIO()
    progress = Progress(100, 1, every=0.0, stream=out)
    progress.advance(50, 10, 1000, 2)
    progress.finish()
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and all(line.startswith("prepare: ") and "\r" not in line for line in lines)
    assert "50 B of 100 B (50%), 10 documents" in lines[-1] and "2 shards written, 0/1 partitions" in lines[-1]


KILLABLE = """
import sys
from wildtrain.data.prepare import PrepareConfig, prepare
prepare(PrepareConfig(input=sys.argv[1], output=sys.argv[2], seq_len=64, rows_per_shard=20, rows_per_group=10,
                      executor="local", val_fraction=0.1))
"""


def test_a_killed_prepare_reruns_to_the_bytes_of_an_uninterrupted_one(tmp_path):
    folder = corpus(tmp_path / "in", files=8)
    settings = dict(seq_len=64, rows_per_shard=20, rows_per_group=10, executor="local", val_fraction=0.1)
    whole = tmp_path / "whole"
    prepare(PrepareConfig(input=str(folder), output=str(whole), **settings))
    killed = tmp_path / "killed"
    env = {**os.environ, "PYTHONPATH": str(REPO / "platform")}
    process = subprocess.Popen(
        [sys.executable, "-c", KILLABLE, str(folder), str(killed)], env=env, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 60
    while not (killed / "parts/00000.json").exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not (killed / "manifest.json").exists(), "finished before the kill: make the corpus larger"
    assert (killed / "parts/00000.json").exists()
    resumed = prepare(PrepareConfig(input=str(folder), output=str(killed), **settings))
    assert not any(p.startswith("shard-00000-") for p in resumed.written)  # a finished partition is not read again
    assert resumed.parts[0].read is False  # found stored and verified

    def files(root: Path) -> dict[str, bytes]:
        # A write the kill cut short leaves its temporary file, never a partial shard.
        return {
            str(p.relative_to(root)): p.read_bytes()
            for p in sorted(root.rglob("*"))
            if p.is_file() and ".tmp-" not in p.name
        }

    assert files(killed) == files(whole)
    verify(str(killed), read_manifest(str(killed)))
