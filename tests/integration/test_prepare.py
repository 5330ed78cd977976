"""`prepare` against a real SeaweedFS store and a real Ray cluster: the tiny corpus becomes
verified shards, a rerun writes nothing, an interrupted run resumes to identical output, and
bad data or an unreachable store fail with one line naming the shard, file or endpoint."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import threading
import time

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from tests.conftest import REPO
from wildtrain import services, storage
from wildtrain.config import StorageConfig
from wildtrain.data.manifest import DataError, Manifest, Shard, read_manifest, verify, write_manifest
from wildtrain.data.prepare import PrepareConfig, prepare
from wildtrain.data.tokenizer import get_tokenizer

pytestmark = pytest.mark.integration

CORPUS = REPO / "tests/assets/tiny_corpus.jsonl"
SEQ_LEN = 128
SETTINGS = {"seq_len": SEQ_LEN, "rows_per_shard": 500, "rows_per_group": 128, "val_fraction": 0}


@pytest.fixture(scope="module")
def bucket(object_store, ray_cluster) -> str:
    """The session store's bucket, with the standard AWS_* variables pointing at it."""
    with pytest.MonkeyPatch.context() as patch:
        for key, value in object_store.env().items():
            patch.setenv(key, value)
        yield f"s3://{object_store.bucket}"


@pytest.fixture(scope="module")
def prepared(bucket):
    """The tiny corpus, prepared once; tests that damage it leave it as they found it."""
    cfg = PrepareConfig(input=str(CORPUS), output=f"{bucket}/tiny", **SETTINGS)
    return cfg, prepare(cfg)


def expected_rows() -> tuple[list[int], list[int]]:
    """The packed stream written out by hand: each document's UTF-8 bytes and then EOS (256)."""
    tokens, doc_ids = [], []
    texts = [json.loads(line)["text"] for line in CORPUS.read_text().splitlines()]
    for doc, text in enumerate(t for t in texts if t):
        ids = [*text.encode(), 256]
        tokens += ids
        doc_ids += [doc] * len(ids)
    usable = len(tokens) // (SEQ_LEN + 1) * (SEQ_LEN + 1)
    return tokens[:usable], doc_ids[:usable]


def stored(uri: str) -> dict[str, tuple[int, object]]:
    """Size and modification time of every object under `uri`."""
    fs, path = storage.filesystem(uri)
    return {i.path: (i.size, i.mtime) for i in fs.get_file_info(pafs.FileSelector(path, recursive=True))}


def test_tiny_corpus_becomes_verified_shards_of_whole_documents(prepared):
    cfg, result = prepared
    manifest = read_manifest(cfg.output)
    assert manifest == result.manifest
    assert result.written == [f"shard-00000-{i:05d}.parquet" for i in range(5)] and result.unchanged == []
    verify(cfg.output, manifest)
    fs, root = storage.filesystem(cfg.output)
    tables = [pq.read_table(f"{root}/{shard.path}", filesystem=fs) for shard in manifest.shards]
    assert [t.num_rows for t in tables] == [shard.rows for shard in manifest.shards] == [500, 500, 500, 500, 44]
    assert {len(row) for t in tables for row in t.column("tokens").to_pylist()} == {SEQ_LEN + 1}
    tokens = [i for t in tables for row in t.column("tokens").to_pylist() for i in row]
    doc_ids = [i for t in tables for row in t.column("doc_ids").to_pylist() for i in row]
    assert (tokens, doc_ids) == expected_rows()
    assert manifest.tokens == len(tokens) and manifest.tokenizer == get_tokenizer("byte").describe()


def test_rerun_writes_nothing(prepared):
    cfg, first = prepared
    before = stored(cfg.output)
    again = prepare(cfg)
    assert again.written == [] and again.unchanged == [s.path for s in first.manifest.shards]
    assert again.manifest == first.manifest
    assert stored(cfg.output) == before


def test_interrupted_run_resumes_to_identical_output(prepared):
    cfg, first = prepared
    manifest_uri = storage.join(cfg.output, "manifest.json")
    manifest_bytes = storage.read_bytes(manifest_uri)
    fs, root = storage.filesystem(cfg.output)
    # What a run killed while writing leaves: a shard missing and no manifest yet.
    fs.delete_file(f"{root}/shard-00000-00002.parquet")
    fs.delete_file(f"{root}/manifest.json")
    with pytest.raises(DataError, match="no manifest"):
        read_manifest(cfg.output)
    resumed = prepare(cfg)
    assert resumed.written == ["shard-00000-00002.parquet"]
    assert resumed.manifest == first.manifest and storage.read_bytes(manifest_uri) == manifest_bytes
    verify(cfg.output, resumed.manifest)


def test_corrupt_shard_is_named_and_a_rerun_repairs_it(prepared):
    cfg, first = prepared
    uri = storage.join(cfg.output, "shard-00000-00001.parquet")
    data = bytearray(storage.read_bytes(uri))
    data[8] ^= 0xFF
    storage.write_bytes(uri, bytes(data))
    with pytest.raises(DataError, match=r"^shard shard-00000-00001.parquet: sha256 does not match"):
        verify(cfg.output, first.manifest)
    assert prepare(cfg).written == ["shard-00000-00001.parquet"]
    verify(cfg.output, first.manifest)


def test_parquet_input_gives_the_same_shards_as_jsonl(prepared, bucket, tmp_path):
    _, first = prepared
    texts = [json.loads(line)["text"] for line in CORPUS.read_text().splitlines()]
    pq.write_table(
        pa.table({"title": [str(i) for i in range(len(texts))], "text": texts}),
        tmp_path / "corpus.parquet",
        row_group_size=300,
    )
    again = prepare(PrepareConfig(input=str(tmp_path), output=f"{bucket}/from-parquet", **SETTINGS))
    assert [s.sha256 for s in again.manifest.shards] == [s.sha256 for s in first.manifest.shards]


def test_text_files_are_one_document_each_with_a_trained_bpe(bucket, tmp_path):
    """Each file is a partition of its own: its shards start with its first document, numbered 0."""
    texts = [json.loads(line)["text"] for line in CORPUS.read_text().splitlines()]
    for i in range(3):
        (tmp_path / f"book-{i}.txt").write_text(" ".join(texts[i::3]))
    output = f"{bucket}/bpe"
    result = prepare(
        PrepareConfig(
            input=str(tmp_path),
            output=output,
            seq_len=64,
            tokenizer="bpe:400",
            rows_per_shard=100,
            rows_per_group=50,
            val_fraction=0,
        )
    )
    manifest = result.manifest
    assert manifest.tokenizer["kind"] == "bpe" and manifest.tokenizer["vocab_size"] == 400
    verify(output, manifest)  # includes tokenizer.json against its sha256
    tokenizer = get_tokenizer(storage.join(output, "tokenizer.json"))
    fs, root = storage.filesystem(output)
    tables = [pq.read_table(f"{root}/{shard.path}", filesystem=fs) for shard in manifest.shards]
    for book in range(3):
        shards = [i for i, s in enumerate(manifest.shards) if s.path.startswith(f"shard-{book:05d}-")]
        book_tokens = [i for t in shards for row in tables[t].column("tokens").to_pylist() for i in row]
        book_docs = {i for t in shards for row in tables[t].column("doc_ids").to_pylist() for i in row}
        ids = tokenizer.encode(" ".join(texts[book::3])) + [tokenizer.eos_id]
        # Its tail that fills no row of seq_len + 1 ids is dropped.
        assert book_tokens == ids[: len(ids) // 65 * 65] and book_docs == {0}


def test_a_shard_with_the_wrong_schema_is_named(bucket):
    root = f"{bucket}/wrong-schema"
    sink = pa.BufferOutputStream()
    pq.write_table(pa.table({"text": ["not tokens"]}), sink)
    data = sink.getvalue().to_pybytes()
    storage.write_bytes(storage.join(root, "shard-00000.parquet"), data)
    shard = Shard(
        "shard-00000.parquet",
        rows=1,
        tokens=4,
        bytes=len(data),
        sha256=hashlib.sha256(data).hexdigest(),
        row_groups=[1],
    )
    write_manifest(
        root, Manifest(seq_len=3, tokenizer={"kind": "byte"}, source="test", shards=[shard], rows=1, tokens=4)
    )
    with pytest.raises(DataError, match=r"^shard shard-00000.parquet: schema is text: string, expected tokens"):
        verify(root, read_manifest(root))


@pytest.mark.parametrize(
    "content, message",
    [
        ("", r"^input: .*empty.jsonl holds no documents"),
        (
            '{"text": ""}\n{"text": "short"}\n',
            r"^input: .*empty.jsonl holds no text that fills one row of seq_len \+ 1 = 129",
        ),
        ('{"body": "x"}\n', r"^/.*empty.jsonl:line 1: no field 'text' \(--skip-bad-records skips"),
    ],
)
def test_empty_corpus_or_missing_field_is_one_clear_error(bucket, tmp_path, content, message):
    (tmp_path / "empty.jsonl").write_text(content)
    with pytest.raises(DataError, match=message):
        prepare(PrepareConfig(input=str(tmp_path / "empty.jsonl"), output=f"{bucket}/empty", **SETTINGS))


def test_cli_reports_a_missing_input_in_one_line(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "data_pipelines/prepare.py",
            "--input",
            str(tmp_path / "nope"),
            "--output",
            str(tmp_path / "out"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [f"prepare: input: {tmp_path / 'nope'} does not exist"]


def test_cli_names_a_malformed_line_in_one_line_and_skips_it_when_told(ray_cluster, tmp_path):
    """On the test cluster's tasks, as `make demo` runs it: the error is the task's own line,
    not Ray's wrapper; with --skip-bad-records the count is printed and in the manifest."""
    texts = [json.loads(line)["text"] for line in CORPUS.read_text().splitlines()]
    folder = tmp_path / "in"
    folder.mkdir()
    for i in range(2):
        (folder / f"part-{i}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[i::2]))
    with open(folder / "part-1.jsonl", "a") as f:
        f.write('{"text": "cut off\n')
    command = [sys.executable, "data_pipelines/prepare.py", "--input", str(folder), "--output", str(tmp_path / "out")]
    env = {**os.environ, "RAY_ADDRESS": ray_cluster.address}
    failed = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert failed.returncode == 1, failed.stderr
    assert "Traceback" not in failed.stderr
    named = [line for line in failed.stderr.splitlines() if "part-1.jsonl" in line]
    assert named == [
        f"prepare: {folder}/part-1.jsonl:line {len(texts[1::2]) + 1}: not JSON (Unterminated string "
        "starting at: column 10) (--skip-bad-records skips and counts such records)"
    ], failed.stderr
    done = subprocess.run(
        command + ["--skip-bad-records"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith(", 1 bad records skipped in 1 files")
    assert [line for line in done.stderr.splitlines() if line.startswith("prepare: ")][-1].endswith(
        "2/2 partitions"
    )  # the progress line, off a terminal: at its end at least
    assert read_manifest(str(tmp_path / "out")).bad_records == {f"{folder}/part-1.jsonl": 1}


@pytest.fixture
def hang_up_server():
    """A TCP server that accepts and at once closes every connection, counting them:
    a store that is there but never answers."""
    server = socket.create_server((services.HOST, 0))
    attempts = []

    def serve():
        while True:
            try:
                connection, _ = server.accept()
            except OSError:
                return
            attempts.append(time.monotonic())
            connection.close()

    threading.Thread(target=serve, daemon=True).start()
    yield f"http://{services.HOST}:{server.getsockname()[1]}", attempts
    server.close()


def test_unanswering_store_is_retried_a_bounded_number_of_times(hang_up_server, monkeypatch):
    endpoint, attempts = hang_up_server
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test-access")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test-secret-never-shown")
    with pytest.raises(storage.StorageError) as failure:
        storage.read_text("s3://bucket/run/record.json", StorageConfig(endpoint=endpoint, max_attempts=3))
    assert len(attempts) == 3
    message = str(failure.value)
    assert message.startswith(f"s3://bucket/run/record.json (endpoint {endpoint}): ")
    assert "test-secret-never-shown" not in message and "\n" not in message


def test_unreachable_store_fails_prepare_fast_naming_the_endpoint(monkeypatch):
    endpoint = f"http://{services.HOST}:{services.free_port()}"  # nothing listens there
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test-secret-never-shown")
    started = time.monotonic()
    with pytest.raises(storage.StorageError, match=rf"^s3://bucket/ds \(endpoint {endpoint}\): .*NETWORK_CONNECTION"):
        prepare(
            PrepareConfig(
                input=str(CORPUS), output="s3://bucket/ds", storage=StorageConfig(endpoint=endpoint, max_attempts=2)
            )
        )
    assert time.monotonic() - started < 10


def _documents(output: str, shards: list[Shard]) -> list[str]:
    """The whole documents of `shards` (byte-level ids, each closed by the end id 256)."""
    fs, root = storage.filesystem(output)
    ids = [
        pq.read_table(fs.open_input_file(f"{root}/{shard.path}")).column("tokens").combine_chunks().flatten().to_numpy()
        for shard in shards
    ]
    stream = bytes()
    documents = []
    for token in (int(t) for part in ids for t in part):
        if token == 256:
            documents.append(stream.decode("utf-8"))
            stream = bytes()
        elif token < 256:
            stream += bytes([token])
    return documents


def test_held_out_documents_become_validation_shards_chosen_by_their_text(bucket):
    from wildtrain.data.prepare import held_out

    output = f"{bucket}/held-out"
    cfg = PrepareConfig(input=str(CORPUS), output=output, **{**SETTINGS, "val_fraction": 0.1})
    result = prepare(cfg)
    manifest = result.manifest
    assert manifest.validation and all(s.path.startswith("validation-") for s in manifest.validation)
    verify(output, manifest)
    texts = [json.loads(line)["text"] for line in CORPUS.read_text().splitlines()]
    expected = {t for t in texts if held_out(t, 0.1)}
    validation = _documents(output, manifest.validation)
    training = _documents(output, manifest.shards)
    # The first document of each is whole; a row cut off at the tail of either is dropped.
    assert set(validation) <= expected and len(validation) >= len(expected) - 2
    assert not expected & set(training)
    assert prepare(cfg).written == []  # the same documents held out again
