"""Checkpoints in a store: upload, part records, atomic commit, fetch and verification.

Rank 0 writes a checkpoint's manifest (see `format`) after every rank's part record is in
and every listed file is in the store with its size, in one atomic write
(`storage.write_atomic`): a crash at any point before leaves a folder without a manifest,
which a restore never picks. Every file is hashed while it is uploaded or downloaded, so
that copying and checksumming read each byte once.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import pyarrow.fs as pafs

from wildtrain import storage
from wildtrain.checkpoint.format import (
    MANIFEST,
    PARTS_DIR,
    CheckpointManifest,
    FileEntry,
    ManifestError,
    files_for_rank,
)
from wildtrain.config import StorageConfig

# How often a commit whose parts are all in asks `held_by` again (commit_when_complete).
HELD_POLL_S = 0.1
CHUNK_BYTES = 8 << 20  # large enough for object-store throughput, small enough to notice a deadline


class CommitError(RuntimeError):
    """A checkpoint that cannot be committed; the message names the checkpoint and what is missing."""


@dataclass(frozen=True)
class Store:
    """A pyarrow filesystem and the folder in it that holds the checkpoints."""

    fs: pafs.FileSystem
    root: str
    uri: str  # for messages

    @classmethod
    def from_uri(cls, uri: str, config: Optional[StorageConfig] = None) -> "Store":
        fs, root = storage.filesystem(uri, config)
        return cls(fs, root.rstrip("/"), storage.resolve(uri))

    def path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def describe(self, *parts: str) -> str:
        return "/".join([self.uri.rstrip("/"), *parts])


StoreLike = Union[Store, str]


def as_store(store: StoreLike) -> Store:
    return store if isinstance(store, Store) else Store.from_uri(store)


class DeadlineExceeded(TimeoutError):
    pass


def check_deadline(deadline: Optional[float], doing: str) -> None:
    if deadline is not None and time.monotonic() > deadline:
        raise DeadlineExceeded(f"timed out {doing}")


def _hash_through(
    reader, write: Optional[Callable[[bytes], Any]], deadline: Optional[float], doing: str
) -> tuple[int, str]:
    """Stream `reader` in chunks into `write` (if any) and hash the same chunks, so that
    copying and checksumming read each byte once."""
    digest = hashlib.sha256()
    size = 0
    while True:
        check_deadline(deadline, doing)
        chunk = reader.read(CHUNK_BYTES)
        if not chunk:
            return size, digest.hexdigest()
        digest.update(chunk)
        size += len(chunk)
        if write is not None:
            write(chunk)


def _read_text(store: Store, path: str) -> Optional[str]:
    try:
        with store.fs.open_input_stream(path) as f:
            return f.read().decode()
    except FileNotFoundError:
        return None


# ---------------------------------------------------------------- saving


def upload(
    local_dir: str,
    store: StoreLike,
    name: str,
    *,
    deadline: Optional[float] = None,
    verify: bool = True,
    on_progress: Callable[[str], None] = lambda doing: None,
) -> tuple[FileEntry, ...]:
    """Copy every file under `local_dir` to `<store>/<name>/`, hashing while reading; then
    check each uploaded file's size and, with `verify`, read it back and compare its sha256."""
    store = as_store(store)
    base = Path(local_dir)
    entries = []
    for local in sorted(p for p in base.rglob("*") if p.is_file()):
        rel = local.relative_to(base).as_posix()
        remote = store.path(name, rel)
        doing = f"uploading {local} to {store.describe(name, rel)}"
        on_progress(doing)
        if storage.has_folders(store.fs):
            store.fs.create_dir(remote.rsplit("/", 1)[0], recursive=True)
        with open(local, "rb") as src, store.fs.open_output_stream(remote) as out:
            size, sha = _hash_through(src, out.write, deadline, doing)
        entries.append(FileEntry(rel, size, sha))
    on_progress(f"verifying the upload to {store.describe(name)}")
    problems = verify_files(store, name, entries, deadline=deadline, checksums=verify).problems
    if problems:
        raise CommitError(f"upload to {store.describe(name)} failed verification: " + "; ".join(problems))
    return tuple(entries)


def write_part(store: StoreLike, name: str, rank: int, files: Sequence[FileEntry], failed: str = "") -> None:
    """Record that `rank` uploaded `files`, every one verified, into checkpoint `name`; or,
    with `failed`, that it could not, and why: rank 0 then gives up on this save at once
    instead of waiting out its deadline for a part that will never come."""
    store = as_store(store)
    record = json.dumps({"rank": rank, "files": [asdict(f) for f in files], "failed": failed}).encode()
    storage.write_atomic(store.fs, store.path(name, PARTS_DIR, f"rank_{rank:05d}.json"), record)


class PartFailed(CommitError):
    """Another rank recorded that its part of the checkpoint could not be stored."""


@dataclass(frozen=True)
class Parts:
    """What the part records of one checkpoint say so far."""

    missing: tuple[int, ...]  # ranks with no record yet
    failed: tuple[str, ...]  # "rank r: why", for ranks that recorded a failure
    files: tuple[FileEntry, ...]  # every rank's files, once none is missing or failed


# A part record as read, by file name, with the size and modification time it was listed with.
PartCache = dict[str, tuple[tuple[int, Any], tuple[list[FileEntry], str]]]


def poll_parts(store: StoreLike, name: str, world_size: int, cache: Optional[PartCache] = None) -> Parts:
    """The part records of checkpoint `name` as they stand now. With `cache` (kept by the
    caller across polls of one checkpoint), a record is read again only when the listing
    shows it with another size or time, so that waiting for N parts reads each about once."""
    store = as_store(store)
    cache = {} if cache is None else cache
    infos = store.fs.get_file_info(pafs.FileSelector(store.path(name, PARTS_DIR), allow_not_found=True))
    present = {info.base_name: (info.size, info.mtime) for info in infos if info.base_name.endswith(".json")}
    records: dict[int, tuple[list[FileEntry], str]] = {}
    for rank in range(world_size):
        record = f"rank_{rank:05d}.json"
        if record not in present:
            continue
        if record in cache and cache[record][0] == present[record]:
            records[rank] = cache[record][1]
            continue
        where = store.describe(name, PARTS_DIR, record)
        text = _read_text(store, store.path(name, PARTS_DIR, record))
        try:
            raw = json.loads(text or "")
            records[rank] = ([FileEntry(**f) for f in raw["files"]], raw.get("failed", ""))
        except (ValueError, TypeError, KeyError) as e:
            raise ManifestError(f"{where}: not a part record: {e}") from None
        cache[record] = (present[record], records[rank])
    missing = tuple(r for r in range(world_size) if r not in records)
    failed = tuple(f"rank {rank}: {why}" for rank, (_, why) in sorted(records.items()) if why)
    if missing or failed:
        return Parts(missing, failed, ())
    owner: dict[str, tuple[int, FileEntry]] = {}
    for rank, (files, _) in sorted(records.items()):
        for entry in files:
            if entry.path in owner and owner[entry.path][1] != entry:
                raise CommitError(
                    f"{store.describe(name, entry.path)}: ranks {owner[entry.path][0]} and {rank} "
                    "uploaded different contents"
                )
            owner[entry.path] = (rank, entry)
    return Parts((), (), tuple(entry for _, entry in sorted(owner.values(), key=lambda item: item[1].path)))


class Cancelled(DeadlineExceeded):
    """Waiting for a checkpoint's parts was called off before its deadline."""


def commit_when_complete(
    targets: Sequence[tuple[Store, float]],
    name: str,
    world_size: int,
    commit: Callable[[Store, tuple[FileEntry, ...]], Any],
    *,
    held_by: Callable[[], Optional[str]] = lambda: None,
    wait: Callable[[float], Any] = time.sleep,
    on_progress: Callable[[str], None] = lambda doing: None,
) -> dict[str, Exception]:
    """Call `commit(store, files)` for each of `targets` (a store and its deadline) once every
    rank's part record of checkpoint `name` is in that store. All stores are polled together,
    with a growing interval (object stores notify nobody), so that a store that is down holds
    up none of the others. A store is given up when a rank recorded a failure there
    (`PartFailed`), the records disagree (`CommitError`), its deadline passes
    (`DeadlineExceeded`) or `commit` raises; a request that failed (`OSError`) may work at the
    next poll, so until the deadline it is tried again. While `held_by()` names something
    else a commit waits for, it waits: a store whose parts are all in is not polled again,
    and `held_by` is asked every `HELD_POLL_S` (it is local, and its wait ends by itself)
    while no request to a store pending has just failed.
    When `wait(interval)` returns true, as `threading.Event.wait` does once set, every store
    still pending is given up (`Cancelled`). Returns the errors by store URI; the stores
    without one were committed."""
    pending = {store.uri: (store, deadline) for store, deadline in targets}
    read: dict[str, PartCache] = {uri: {} for uri in pending}  # the part records read so far, by store URI
    complete: dict[str, tuple[FileEntry, ...]] = {}  # by store URI: every part in, as read
    failing: set[str] = set()  # the stores whose last request failed: polled with the backoff again
    errors: dict[str, Exception] = {}
    interval = 0.05
    while pending:
        for uri, (store, deadline) in list(pending.items()):
            failing.discard(uri)
            try:
                if uri not in complete:
                    parts = poll_parts(store, name, world_size, read[uri])
                    if parts.failed:
                        raise PartFailed(f"{store.describe(name)}: " + "; ".join(parts.failed))
                    if not parts.missing:
                        complete[uri] = parts.files
                waiting = (
                    held_by()
                    if uri in complete
                    else f"waiting for ranks {list(parts.missing)} of "
                    f"{world_size} to upload checkpoint {store.describe(name)}"
                )
                if waiting:
                    on_progress(waiting)
                    check_deadline(deadline, waiting)
                    continue
                commit(store, complete[uri])
            except Exception as e:
                if isinstance(e, OSError) and not isinstance(e, DeadlineExceeded) and time.monotonic() < deadline:
                    failing.add(uri)
                    continue
                errors[uri] = e
            del pending[uri]
        polling_stores = any(uri not in complete or uri in failing for uri in pending)
        if pending and wait(interval if polling_stores else HELD_POLL_S):
            errors |= {
                uri: Cancelled(f"cancelled waiting to commit {store.describe(name)}")
                for uri, (store, _) in pending.items()
            }
            break
        if polling_stores:
            interval = min(2.0, interval * 2)
    return errors


def commit(
    store: StoreLike,
    name: str,
    *,
    step: int,
    tag: str,
    world_size: int,
    zero_stage: int,
    files: Sequence[FileEntry],
    data_position: Mapping[str, Any],
    config_hash: str,
) -> CheckpointManifest:
    """Write the manifest of checkpoint `name`, last and atomically, after checking that every
    file in `files` is in the store with its size. From then on the checkpoint exists."""
    store = as_store(store)
    if not files:
        raise CommitError(f"checkpoint {store.describe(name)} (step {step}) has no files to commit")
    problems = verify_files(store, name, files, checksums=False).problems
    if problems:
        raise CommitError(f"not committing {store.describe(name)} (step {step}): " + "; ".join(problems))
    manifest = CheckpointManifest(
        step=step,
        tag=tag,
        world_size=world_size,
        zero_stage=zero_stage,
        files=tuple(sorted(files, key=lambda f: f.path)),
        data_position=dict(data_position),
        config_hash=config_hash,
        created=time.time(),
    )
    storage.write_atomic(store.fs, store.path(name, MANIFEST), manifest.to_json().encode())
    return manifest


def read_manifest(store: StoreLike, name: str) -> Optional[CheckpointManifest]:
    """The manifest of checkpoint `name`; None if it was never committed."""
    store = as_store(store)
    text = _read_text(store, store.path(name, MANIFEST))
    return None if text is None else CheckpointManifest.from_json(text, store.describe(name, MANIFEST))


# ---------------------------------------------------------------- verifying


@dataclass(frozen=True)
class Verification:
    problems: tuple[str, ...]
    bytes_read: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_files(
    store: StoreLike, name: str, files: Sequence[FileEntry], *, deadline: Optional[float] = None, checksums: bool = True
) -> Verification:
    """Each file's presence and size (one metadata request for all), and with `checksums`
    its sha256, streamed, in place."""
    store = as_store(store)
    infos = store.fs.get_file_info([store.path(name, f.path) for f in files])
    problems = []
    bytes_read = 0
    for entry, info in zip(files, infos):
        where = store.describe(name, entry.path)
        if info.type != pafs.FileType.File:
            problems.append(f"{where}: missing")
        elif info.size != entry.bytes:
            problems.append(f"{where}: {info.size} bytes, the manifest says {entry.bytes}")
        elif checksums:
            with store.fs.open_input_stream(store.path(name, entry.path)) as f:
                size, sha = _hash_through(f, None, deadline, f"verifying {where}")
            bytes_read += size
            if sha != entry.sha256:
                problems.append(f"{where}: sha256 {sha[:12]}…, the manifest says {entry.sha256[:12]}…")
    return Verification(tuple(problems), bytes_read)


def verify(
    store: StoreLike,
    name: str,
    manifest: CheckpointManifest,
    *,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    deadline: Optional[float] = None,
) -> Verification:
    """Verify a committed checkpoint in place: all its files, or only those `rank` of
    `world_size` would read (see `files_for_rank`)."""
    files = manifest.files if rank is None else files_for_rank(manifest, rank, world_size or manifest.world_size)
    return verify_files(store, name, files, deadline=deadline)


def fetch(
    store: StoreLike, name: str, files: Sequence[FileEntry], local_dir: str, *, deadline: Optional[float] = None
) -> Verification:
    """Download `files` of checkpoint `name` into `local_dir`, hashing on the way, so that
    each byte is read from the store once and checked against the manifest."""
    store = as_store(store)
    problems = []
    bytes_read = 0
    for entry in files:
        where = store.describe(name, entry.path)
        target = Path(local_dir, entry.path)
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            with store.fs.open_input_stream(store.path(name, entry.path)) as src, open(target, "wb") as out:
                size, sha = _hash_through(src, out.write, deadline, f"downloading {where}")
        except FileNotFoundError:
            problems.append(f"{where}: missing")
            continue
        bytes_read += size
        if size != entry.bytes:
            problems.append(f"{where}: {size} bytes, the manifest says {entry.bytes}")
        elif sha != entry.sha256:
            problems.append(f"{where}: sha256 {sha[:12]}…, the manifest says {entry.sha256[:12]}…")
    return Verification(tuple(problems), bytes_read)
