"""Checkpoint commit and retention at N ranks (issue 60, table 3), against a real SeaweedFS
S3 store started by this script (`services.start_object_store`, on a free port, in a temp
dir, stopped at the end).

Each of N simulated ranks stages its small part (its ZeRO partition file; rank 0 also the
model states, `latest` and `client_state.json`), uploads it with `checkpoint.store.upload`
(read back and checked, as `checkpoint.verify_upload` does by default) and writes its part
record (`write_part`), from a pool of threads, while rank 0 waits in `commit_when_complete`
and commits, as `save_work` does. Every request goes through a counting HTTP proxy in front
of the store, so the counts are the S3 requests pyarrow really sends (directory markers,
listings and read-backs included), by kind and by key prefix. Measured per N:

- the requests of one checkpoint (all ranks and rank 0's commit), writes and reads, and how
  many fall under the checkpoint's own folder (one prefix);
- rank 0's part-record reads and listings while it waits for the parts;
- rank 0's commit once every part is in (`commit_when_complete`'s first poll finds all, then
  `commit`): its time against the store directly, and its requests through the proxy;
- retention (`apply_retention`, keep_last=2) after the third checkpoint of N parts: its time
  and requests.

Usage: PYTHONPATH=platform .venv/bin/python bench/scale/checkpoint.py [--ranks 8 32 128 512 1024]
    [--delayed-open]
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

import pyarrow.fs as pafs

from wildtrain import services, storage
from wildtrain.checkpoint.format import PARTS_DIR, checkpoint_name
from wildtrain.checkpoint.retention import RetentionPolicy, apply_retention
from wildtrain.checkpoint.store import Store, commit, commit_when_complete, upload, write_part
from wildtrain.config import StorageConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from growth import growth_line, markdown  # noqa: E402

BUCKET = "scale-bench"
ROOT = f"{BUCKET}/run/checkpoints"
PART_BYTES = 4096
TAG = "global_step100"
RANK_THREADS = 8  # simulated ranks uploading at once
WRITES = {"PUT", "POST", "DELETE", "UploadPart", "CreateMultipartUpload", "CompleteMultipartUpload", "DeleteObjects"}
HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade"}


@dataclass
class Requests:
    """The S3 requests seen by the proxies: (who sent it, kind, key) each."""

    seen: list[tuple[str, str, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, source: str, kind: str, key: str) -> None:
        with self.lock:
            self.seen.append((source, kind, key))

    def mark(self) -> int:
        with self.lock:
            return len(self.seen)

    def since(self, mark: int, source: str) -> list[tuple[str, str]]:
        with self.lock:
            return [(kind, key) for who, kind, key in self.seen[mark:] if who == source]


def s3_kind(method: str, path: str) -> tuple[str, str]:
    """The S3 action of a request and the key (or listed prefix) it names."""
    url = urlsplit(path)
    query = parse_qs(url.query, keep_blank_values=True)
    key = unquote(url.path).lstrip("/")
    if method == "GET" and ("list-type" in query or "prefix" in query or "delimiter" in query):
        return "LIST", f"{key}/{query.get('prefix', [''])[0]}"
    if method == "POST" and "delete" in query:
        return "DeleteObjects", key
    if method == "POST" and "uploads" in query:
        return "CreateMultipartUpload", key
    if method == "POST" and "uploadId" in query:
        return "CompleteMultipartUpload", key
    if method == "PUT" and "partNumber" in query:
        return "UploadPart", key
    return method, key


def counting_proxy(upstream: str, requests: Requests, source: str) -> ThreadingHTTPServer:
    """An HTTP proxy on a free port that forwards each request unchanged (its Host header
    too, which the signature covers) to `upstream` and records it as sent by `source`."""
    target = urlsplit(upstream)
    local = threading.local()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def _body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                raw = b""
                while True:
                    line = self.rfile.readline()
                    raw += line
                    size = int(line.split(b";")[0].strip(), 16)
                    if size == 0:
                        while True:  # trailers, then the blank line
                            trailer = self.rfile.readline()
                            raw += trailer
                            if trailer in (b"\r\n", b"\n", b""):
                                return raw
                    raw += self.rfile.read(size + 2)
            return self.rfile.read(int(self.headers.get("Content-Length", 0) or 0))

        def _forward(self) -> None:
            body = self._body()
            requests.add(source, *s3_kind(self.command, self.path))
            connection = getattr(local, "connection", None)
            if connection is None:
                connection = local.connection = http.client.HTTPConnection(target.hostname, target.port, timeout=120)
            try:
                connection.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
                for name, value in self.headers.items():
                    if name.lower() not in HOP_BY_HOP or name.lower() == "transfer-encoding":
                        connection.putheader(name, value)
                connection.endheaders(body or None)
                response = connection.getresponse()
                data = response.read()
            except (OSError, http.client.HTTPException):
                local.connection = None
                raise
            self.send_response(response.status, response.reason)
            for name, value in response.getheaders():
                if name.lower() not in HOP_BY_HOP and not (name.lower() == "content-length" and self.command != "HEAD"):
                    self.send_header(name, value)
            if self.command != "HEAD":
                self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

    server = ThreadingHTTPServer((services.HOST, services.free_port()), Handler)
    server.daemon_threads = True
    server.handle_error = lambda request, address: None  # a client that hung up: its request is counted
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def s3_store(endpoint: str, keys: tuple[str, str], root: str, delayed_open: bool) -> Store:
    fs = storage.s3_filesystem(endpoint, *keys, StorageConfig.region, max_attempts=3)
    if delayed_open:  # what wildtrain's client would be with pyarrow's allow_delayed_open
        url = urlsplit(endpoint)
        fs = pafs.S3FileSystem(
            access_key=keys[0],
            secret_key=keys[1],
            endpoint_override=url.netloc,
            scheme=url.scheme,
            region=StorageConfig.region,
            retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=3),
            allow_delayed_open=True,
        )
    return Store(fs, root, f"s3://{root}")


def stage_rank(base: Path, rank: int) -> str:
    """A rank's small part, as DeepSpeed lays it out under the checkpoint's folder."""
    folder = base / f"rank_{rank:05d}"
    files = {f"{TAG}/zero_pp_rank_{rank}_mp_rank_00_optim_states.pt": bytes([rank % 256]) * PART_BYTES}
    if rank == 0:
        files |= {
            f"{TAG}/mp_rank_00_model_states.pt": b"m" * PART_BYTES,
            "latest": TAG.encode(),
            "client_state.json": json.dumps({"step": 100}).encode(),
        }
    for rel, data in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(data)
    return str(folder)


def commit_step(name: str, step: int, world: int):
    def commit_in(store: Store, files) -> None:
        commit(
            store,
            name,
            step=step,
            tag=TAG,
            world_size=world,
            zero_stage=1,
            files=files,
            data_position={"epoch": 0, "step": step},
            config_hash="c0ffee",
        )

    return commit_in


@dataclass(frozen=True)
class Saved:
    rank_requests: list[tuple[str, str]]  # every rank's upload and part record
    rank_zero_requests: list[tuple[str, str]]  # rank 0's wait for the parts and its commit
    upload_s: float


@dataclass(frozen=True)
class Stores:
    ranks: Store  # through the proxy that counts as "ranks"
    rank_zero: Store  # through the proxy that counts as "rank 0"
    direct: Store  # the store itself, for times

    def under(self, folder: str) -> "Stores":
        """The same stores rooted at `folder` of the bench's root: SeaweedFS goes on listing a
        deleted checkpoint's folder, so each N gets its own, for retention to list its own only."""
        return Stores(
            *(
                Store(s.fs, f"{ROOT}/{folder}", f"s3://{ROOT}/{folder}")
                for s in (self.ranks, self.rank_zero, self.direct)
            )
        )


def save_checkpoint(stores: Stores, name: str, step: int, world: int, staged: list[str], requests: Requests) -> Saved:
    """Every rank uploads and records its part while rank 0 waits and commits, as `save_work`
    does (rank 0's wait and commit through its own proxy, so its requests are told apart)."""
    errors: dict = {}

    def rank_zero() -> None:
        errors.update(
            commit_when_complete(
                [(stores.rank_zero, time.monotonic() + 600)], name, world, commit_step(name, step, world)
            )
        )

    def one_rank(rank: int) -> None:
        write_part(stores.ranks, name, rank, upload(staged[rank], stores.ranks, name))

    mark = requests.mark()
    waiter = threading.Thread(target=rank_zero)
    started = time.perf_counter()
    waiter.start()
    with ThreadPoolExecutor(RANK_THREADS) as pool:
        list(pool.map(one_rank, range(world)))
    upload_s = time.perf_counter() - started
    waiter.join()
    if errors:
        raise RuntimeError(errors)
    return Saved(requests.since(mark, "ranks"), requests.since(mark, "rank 0"), upload_s)


def commit_once_in(store: Store, name: str, step: int, world: int) -> float:
    started = time.perf_counter()
    errors = commit_when_complete([(store, time.monotonic() + 600)], name, world, commit_step(name, step, world))
    if errors:
        raise RuntimeError(errors)
    return time.perf_counter() - started


def writes_reads(seen: list[tuple[str, str]]) -> tuple[int, int]:
    writes = sum(1 for kind, _ in seen if kind in WRITES)
    return writes, len(seen) - writes


def kinds(seen: list[tuple[str, str]]) -> str:
    return ", ".join(f"{n:,} {k}" for k, n in sorted(Counter(kind for kind, _ in seen).items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 32, 128, 512, 1024])
    parser.add_argument(
        "--delayed-open", action="store_true", help="pyarrow's allow_delayed_open: a small object in one PUT"
    )
    args = parser.parse_args()
    requests = Requests()
    with tempfile.TemporaryDirectory(prefix="scale-ckpt-") as tmp:
        object_store = services.start_object_store(Path(tmp, "store"), services.free_port(), BUCKET)
        proxies = [counting_proxy(object_store.endpoint, requests, source) for source in ("ranks", "rank 0")]
        try:
            keys = (object_store.access_key, object_store.secret_key)
            through = [
                s3_store(f"http://{services.HOST}:{p.server_address[1]}", keys, ROOT, args.delayed_open)
                for p in proxies
            ]
            direct = s3_store(object_store.endpoint, keys, ROOT, args.delayed_open)
            run(args.ranks, Path(tmp), Stores(*through, direct), requests)
        finally:
            for proxy in proxies:
                proxy.shutdown()
            services.stop_process(object_store.pid)


def run(ranks: list[int], tmp: Path, all_stores: Stores, requests: Requests) -> None:
    rows, kind_rows, commit_times, waits, retention_times, per_checkpoint = [], [], [], [], [], []
    for world in ranks:
        stores = all_stores.under(f"n{world}")
        staged = [stage_rank(tmp / f"staging_{world}", rank) for rank in range(world)]
        names = [checkpoint_name(step, f"n{world}") for step in (100, 200, 300)]
        saved = [
            save_checkpoint(stores, name, step, world, staged, requests) for name, step in zip(names, (100, 200, 300))
        ]
        first = saved[0]
        one_checkpoint = first.rank_requests + first.rank_zero_requests
        writes, reads = writes_reads(one_checkpoint)
        folder = stores.ranks.path(names[0]) + "/"
        in_folder = sum(1 for _, key in one_checkpoint if key.startswith(folder))
        parts = stores.ranks.path(names[0], PARTS_DIR) + "/"
        part_reads = sum(1 for kind, key in first.rank_zero_requests if kind == "GET" and key.startswith(parts))
        part_lists = sum(1 for kind, key in first.rank_zero_requests if kind == "LIST" and key.startswith(parts))

        # Rank 0's commit once every part is in: timed against the store, counted through a proxy.
        commit_s = min(commit_once_in(stores.direct, names[0], 100, world) for _ in range(3))
        mark = requests.mark()
        commit_once_in(stores.rank_zero, names[0], 100, world)
        commit_requests = requests.since(mark, "rank 0")

        # Retention after the third checkpoint, as rank 0 applies it after a commit: the first goes.
        mark = requests.mark()
        started = time.perf_counter()
        plan = apply_retention(stores.rank_zero, RetentionPolicy(keep_last=2), good=set())
        retention_s = time.perf_counter() - started
        retention_requests = requests.since(mark, "rank 0")
        if plan.delete != (names[0],):
            raise RuntimeError(f"retention deleted {plan.delete}, expected {names[0]}")
        apply_retention(stores.direct, RetentionPolicy(keep_last=0), good=set())  # an empty store for the next N

        commit_times.append(commit_s)
        waits.append(part_reads)
        retention_times.append(retention_s)
        per_checkpoint.append(len(one_checkpoint))
        rows.append(
            [
                f"{world:,}",
                f"{len(one_checkpoint):,} ({writes:,} w / {reads:,} r)",
                f"{len(one_checkpoint) / world:.1f}",
                f"{in_folder:,}",
                f"{first.upload_s:.1f} s",
                f"{part_reads:,} GET + {part_lists:,} LIST",
                f"{commit_s * 1000:.0f} ms",
                kinds(commit_requests),
                f"{retention_s * 1000:.0f} ms",
                kinds(retention_requests),
            ]
        )
        kind_rows.append([f"{world:,}", kinds(first.rank_requests), kinds(first.rank_zero_requests)])
        print(" | ".join(rows[-1]), flush=True)
    print()
    print(
        markdown(
            [
                "ranks",
                "requests of one checkpoint",
                "per rank",
                "under the checkpoint's folder",
                f"ranks' upload wall time ({RANK_THREADS} at once)",
                "rank 0's part-record reads while waiting",
                "commit once all parts are in",
                "its requests",
                "retention (keep_last=2, after the 3rd)",
                "its requests",
            ],
            rows,
        )
    )
    print()
    print(markdown(["ranks", "the ranks' requests", "rank 0's wait and commit"], kind_rows))
    print(growth_line("requests of one checkpoint", ranks, per_checkpoint))
    print(growth_line("rank 0's part-record reads while waiting", ranks, waits))
    print(growth_line("commit once all parts are in", ranks, commit_times))
    print(growth_line("retention", ranks, retention_times))


if __name__ == "__main__":
    main()
