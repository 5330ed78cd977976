"""Committed checkpoints in a store: upload, manifest, atomic commit, verification, restore.

A store is a folder given by URI (a local path, s3://, gs://; see `wildtrain.storage`).
Each checkpoint is one subfolder, named by `checkpoint_name(step, attempt)`:

    <store>/step_000000100-3f9a1c/
        latest, client_state.json, <tag>/...   the files of every rank: one DeepSpeed folder
        _parts/rank_00000.json ...             each rank's uploaded files, sizes and sha256
        manifest.json                          written last: the checkpoint exists from here on

A checkpoint is committed when, and only when, its `manifest.json` exists. Rank 0 writes
it after every rank's part record is in and every listed file is in the store with its
size; it is written under a temporary name and moved into place (a rename on a local
path; on object stores a single PUT/copy, which readers see whole or not at all). A crash
at any point before leaves a folder without a manifest, which `choose_restore` never
picks. Restore trusts nothing else: every file it reads is hashed on the way and
compared with the manifest, so a file that was truncated, rotted or deleted after the
commit makes the restore fall back to the previous good checkpoint, in this store or a
replica, and the decision lists what it skipped and why.

Names carry the attempt (a token every rank of one worker group shares) so that a step
saved again after a fallback never writes into the folder, or reads the part records, of
the earlier attempt's save of that step.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import pyarrow.fs as pafs

from wildtrain import storage
from wildtrain.config import StorageConfig

MANIFEST = "manifest.json"
PARTS_DIR = "_parts"
FORMAT = 1
CHUNK_BYTES = 8 << 20  # large enough for object-store throughput, small enough to notice a deadline
_NAME = re.compile(r"^step_(\d+)-([0-9A-Za-z]+)$")
# DeepSpeed's per-rank ZeRO files (optimizer partitions; ZeRO-3 model partitions too).
_RANK_FILE = re.compile(r"(?:^|/)(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_\d+_")


class ManifestError(ValueError):
    """A manifest or part record that cannot be read; the message names its path."""


class CommitError(RuntimeError):
    """A checkpoint that cannot be committed; the message names the checkpoint and what is missing."""


class NoGoodCheckpoint(RuntimeError):
    """Committed checkpoints exist, but none passed verification."""


@dataclass(frozen=True)
class FileEntry:
    path: str  # relative to the checkpoint's folder, '/'-separated
    bytes: int
    sha256: str


@dataclass(frozen=True)
class CheckpointManifest:
    step: int
    tag: str  # DeepSpeed's tag: the subfolder that holds the engine's files
    world_size: int
    zero_stage: int
    files: tuple[FileEntry, ...]
    data_position: dict
    config_hash: str
    created: float  # seconds since the epoch, when committed
    format: int = FORMAT

    @property
    def total_bytes(self) -> int:
        return sum(f.bytes for f in self.files)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, where: str) -> "CheckpointManifest":
        try:
            raw = json.loads(text)
            if raw.get("format") != FORMAT:
                raise ManifestError(f"{where}: manifest format {raw.get('format')!r}, this version reads {FORMAT}")
            raw["files"] = tuple(FileEntry(**f) for f in raw["files"])
            return cls(**raw)
        except ManifestError:
            raise
        except (ValueError, TypeError, KeyError) as e:
            raise ManifestError(f"{where}: not a checkpoint manifest: {e}") from None


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


def checkpoint_name(step: int, attempt: str) -> str:
    if not re.fullmatch(r"[0-9A-Za-z]+", attempt):
        raise ValueError(f"attempt token {attempt!r}: letters and digits only")
    return f"step_{step:09d}-{attempt}"


def step_of(name: str) -> Optional[int]:
    """The step in a checkpoint folder's name; None for folders this module did not name."""
    match = _NAME.match(name)
    return int(match[1]) if match else None


def new_attempt_token() -> str:
    """A token for one worker group; rank 0 draws it and every rank must use the same one."""
    return secrets.token_hex(4)


class DeadlineExceeded(TimeoutError):
    pass


def check_deadline(deadline: Optional[float], doing: str) -> None:
    if deadline is not None and time.monotonic() > deadline:
        raise DeadlineExceeded(f"timed out {doing}")


def _hash_through(reader, write: Optional[Callable[[bytes], Any]], deadline: Optional[float],
                  doing: str) -> tuple[int, str]:
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


def _write_atomic(store: Store, path: str, data: bytes) -> None:
    """Readers see all of `path` or none of it: written under a private name, then moved."""
    tmp = f"{path}.tmp-{secrets.token_hex(4)}"
    with store.fs.open_output_stream(tmp) as out:
        out.write(data)
    store.fs.move(tmp, path)


def _read_text(store: Store, path: str) -> Optional[str]:
    try:
        with store.fs.open_input_stream(path) as f:
            return f.read().decode()
    except FileNotFoundError:
        return None


# ---------------------------------------------------------------- saving


def upload(local_dir: str, store: StoreLike, name: str, *, deadline: Optional[float] = None,
           verify: bool = True, on_progress: Callable[[str], None] = lambda doing: None) -> tuple[FileEntry, ...]:
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
    store.fs.create_dir(store.path(name, PARTS_DIR), recursive=True)
    _write_atomic(store, store.path(name, PARTS_DIR, f"rank_{rank:05d}.json"), record)


class PartFailed(CommitError):
    """Another rank recorded that its part of the checkpoint could not be stored."""


@dataclass(frozen=True)
class Parts:
    """What the part records of one checkpoint say so far."""

    missing: tuple[int, ...]  # ranks with no record yet
    failed: tuple[str, ...]  # "rank r: why", for ranks that recorded a failure
    files: tuple[FileEntry, ...]  # every rank's files, once none is missing or failed


def poll_parts(store: StoreLike, name: str, world_size: int) -> Parts:
    """The part records of checkpoint `name` as they stand now."""
    store = as_store(store)
    infos = store.fs.get_file_info(pafs.FileSelector(store.path(name, PARTS_DIR), allow_not_found=True))
    present = {info.base_name for info in infos if info.base_name.endswith(".json")}
    records: dict[int, tuple[list[FileEntry], str]] = {}
    for rank in range(world_size):
        if f"rank_{rank:05d}.json" not in present:
            continue
        where = store.describe(name, PARTS_DIR, f"rank_{rank:05d}.json")
        text = _read_text(store, store.path(name, PARTS_DIR, f"rank_{rank:05d}.json"))
        try:
            raw = json.loads(text or "")
            records[rank] = ([FileEntry(**f) for f in raw["files"]], raw.get("failed", ""))
        except (ValueError, TypeError, KeyError) as e:
            raise ManifestError(f"{where}: not a part record: {e}") from None
    missing = tuple(r for r in range(world_size) if r not in records)
    failed = tuple(f"rank {rank}: {why}" for rank, (_, why) in sorted(records.items()) if why)
    if missing or failed:
        return Parts(missing, failed, ())
    owner: dict[str, tuple[int, FileEntry]] = {}
    for rank, (files, _) in sorted(records.items()):
        for entry in files:
            if entry.path in owner and owner[entry.path][1] != entry:
                raise CommitError(f"{store.describe(name, entry.path)}: ranks {owner[entry.path][0]} and {rank} "
                                  "uploaded different contents")
            owner[entry.path] = (rank, entry)
    return Parts((), (), tuple(entry for _, entry in sorted(owner.values(), key=lambda item: item[1].path)))


def collect_parts(store: StoreLike, name: str, world_size: int, *, deadline: Optional[float],
                  wait: Callable[[float], Any] = time.sleep) -> tuple[FileEntry, ...]:
    """Every rank's files, once all `world_size` part records are in; polls the store with a
    growing interval (object stores notify nobody), and gives up at `deadline`, when a rank
    recorded a failure (`PartFailed`), or when `wait` (given the interval) returns true, as
    `threading.Event.wait` does once set."""
    store = as_store(store)
    interval = 0.05
    while True:
        parts = poll_parts(store, name, world_size)
        if parts.failed:
            raise PartFailed(f"{store.describe(name)}: " + "; ".join(parts.failed))
        if not parts.missing:
            return parts.files
        if deadline is not None and time.monotonic() + interval > deadline:
            raise DeadlineExceeded(
                f"timed out waiting for ranks {list(parts.missing)} of {world_size} to upload checkpoint "
                f"{store.describe(name)}"
            )
        if wait(interval):
            raise DeadlineExceeded(
                f"cancelled waiting for ranks {list(parts.missing)} to upload checkpoint {store.describe(name)}")
        interval = min(2.0, interval * 2)


def commit(store: StoreLike, name: str, *, step: int, tag: str, world_size: int, zero_stage: int,
           files: Sequence[FileEntry], data_position: Mapping[str, Any], config_hash: str) -> CheckpointManifest:
    """Write the manifest of checkpoint `name`, last and atomically, after checking that every
    file in `files` is in the store with its size. From then on the checkpoint exists."""
    store = as_store(store)
    if not files:
        raise CommitError(f"checkpoint {store.describe(name)} (step {step}) has no files to commit")
    problems = verify_files(store, name, files, checksums=False).problems
    if problems:
        raise CommitError(f"not committing {store.describe(name)} (step {step}): " + "; ".join(problems))
    manifest = CheckpointManifest(
        step=step, tag=tag, world_size=world_size, zero_stage=zero_stage,
        files=tuple(sorted(files, key=lambda f: f.path)), data_position=dict(data_position),
        config_hash=config_hash, created=time.time(),
    )
    _write_atomic(store, store.path(name, MANIFEST), manifest.to_json().encode())
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


def verify_files(store: StoreLike, name: str, files: Sequence[FileEntry], *, deadline: Optional[float] = None,
                 checksums: bool = True) -> Verification:
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


def verify(store: StoreLike, name: str, manifest: CheckpointManifest, *, rank: Optional[int] = None,
           world_size: Optional[int] = None, deadline: Optional[float] = None) -> Verification:
    """Verify a committed checkpoint in place: all its files, or only those `rank` of
    `world_size` would read (see `files_for_rank`)."""
    files = manifest.files if rank is None else files_for_rank(manifest, rank, world_size or manifest.world_size)
    return verify_files(store, name, files, deadline=deadline)


def needs_universal(manifest: CheckpointManifest, world_size: int) -> bool:
    """ZeRO partitions the optimizer state per rank: another world size needs the universal
    format. Stage 0 keeps whole states, which load at any size, and cannot be converted."""
    return manifest.world_size != world_size and manifest.zero_stage > 0


def files_for_rank(manifest: CheckpointManifest, rank: int, world_size: int) -> tuple[FileEntry, ...]:
    """The files a rank reads to restore: at the saved world size, its own ZeRO partition
    and the shared files, not the other ranks' partitions (DeepSpeed reads only its own);
    at another world size every file, because converting to the universal format reads all."""
    if world_size != manifest.world_size:
        return manifest.files

    def other_rank(entry: FileEntry) -> bool:
        match = _RANK_FILE.search(entry.path)
        return match is not None and int(match[1]) != rank

    return tuple(f for f in manifest.files if not other_rank(f))


def fetch(store: StoreLike, name: str, files: Sequence[FileEntry], local_dir: str, *,
          deadline: Optional[float] = None) -> Verification:
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


# ---------------------------------------------------------------- choosing what to restore


@dataclass(frozen=True)
class Candidate:
    store: str  # the store's URI
    store_index: int  # 0: the primary; replicas after it
    name: str
    step: Optional[int]
    manifest: Optional[CheckpointManifest]  # None: never committed
    problem: Optional[str] = None  # a manifest that exists but cannot be read

    @property
    def key(self) -> tuple[str, str]:
        return (self.store, self.name)

    @property
    def created(self) -> float:
        return self.manifest.created if self.manifest else 0.0


@dataclass(frozen=True)
class Skipped:
    store: str
    name: str
    step: Optional[int]
    reason: str


@dataclass(frozen=True)
class RestoreDecision:
    """Either `restore` (a verified good checkpoint) or `verify_next` (the newest candidate
    whose verification is not known yet) or neither (nothing left to try), with the newer
    candidates passed over on the way."""

    restore: Optional[Candidate]
    verify_next: Optional[Candidate]
    skipped: tuple[Skipped, ...]


def choose_restore(candidates: Sequence[Candidate],
                   verified: Mapping[tuple[str, str], Optional[str]]) -> RestoreDecision:
    """Walk the candidates from the newest (by step; a step saved twice, by its newest
    commit; the same checkpoint in several stores, primary first) and stop at the first one
    that is verified good or not verified yet. `verified` maps a candidate's key to None
    (good) or what was wrong with it."""
    committed_at: dict[str, float] = {}
    for c in candidates:
        committed_at[c.name] = max(committed_at.get(c.name, 0.0), c.created)
    ordered = sorted(candidates, key=lambda c: (
        -(c.step if c.step is not None else -1), -committed_at[c.name], c.name, c.store_index))
    skipped = []
    for c in ordered:
        if c.problem is not None:
            skipped.append(Skipped(c.store, c.name, c.step, c.problem))
        elif c.manifest is None:
            skipped.append(Skipped(c.store, c.name, c.step, "not committed (no manifest)"))
        elif c.key not in verified:
            return RestoreDecision(None, c, tuple(skipped))
        elif verified[c.key] is None:
            return RestoreDecision(c, None, tuple(skipped))
        else:
            skipped.append(Skipped(c.store, c.name, c.step, verified[c.key]))
    return RestoreDecision(None, None, tuple(skipped))


def list_candidates(stores: Sequence[StoreLike]) -> list[Candidate]:
    """Every checkpoint folder in `stores`, committed or not."""
    found = []
    for index, store in enumerate(map(as_store, stores)):
        infos = store.fs.get_file_info(pafs.FileSelector(store.root, allow_not_found=True))
        for info in infos:
            if info.type != pafs.FileType.Directory or step_of(info.base_name) is None:
                continue
            name = info.base_name
            try:
                manifest, problem = read_manifest(store, name), None
            except ManifestError as e:
                manifest, problem = None, str(e)
            found.append(Candidate(store.uri, index, name, step_of(name), manifest, problem))
    return found


def newest_committed(stores: Sequence[StoreLike]) -> Optional[Candidate]:
    """The committed checkpoint a restore would try first (not verified yet)."""
    return choose_restore(list_candidates(stores), verified={}).verify_next


@dataclass(frozen=True)
class Restored:
    candidate: Candidate
    manifest: CheckpointManifest
    folder: str  # a local DeepSpeed folder: `latest`, client_state.json, <tag>/
    skipped: tuple[Skipped, ...]
    bytes_read: int
    seconds: float


def restore(stores: Sequence[StoreLike], local_dir: str, *, rank: int, world_size: int,
            agree: Callable[[bool], bool] = lambda ok: ok,
            listing: Callable[[Callable[[], list[Candidate]]], list[Candidate]] = lambda list_them: list_them(),
            universal_copy: Optional[Callable[[Store, Candidate], tuple[str, CheckpointManifest]]] = None,
            deadline: Optional[float] = None) -> Optional[Restored]:
    """Download the newest checkpoint whose files all verify into `local_dir/<name>`
    (`local_dir` private to this rank), falling back past bad ones. Each rank downloads
    only what it reads (`files_for_rank`). All ranks must restore the same checkpoint, so
    with several ranks, `listing` runs the listing it is given on rank 0 only and hands its
    result to every rank (listings of an eventually consistent store can differ between
    ranks, and a rank that saw nothing would build a fresh engine while the others wait in
    a collective); and `agree` turns this rank's verdict on a candidate into the group's
    (an all-reduce of the minimum; all ranks call it equally often). A checkpoint saved at
    another world size is read from its universal copy, which `universal_copy` finds or
    makes (`reshard.convert_in_store`; a collective too), when given; otherwise every file
    is downloaded. None: the stores hold no committed checkpoint."""
    started = time.perf_counter()
    candidates = listing(lambda: list_candidates(stores))
    store_by_uri = {s.uri: s for s in map(as_store, stores)}
    verified: dict[tuple[str, str], Optional[str]] = {}
    bytes_read = 0
    while True:
        decision = choose_restore(candidates, verified)
        chosen = decision.restore
        if chosen is not None:
            return Restored(chosen, chosen.manifest, str(Path(local_dir, chosen.name)), decision.skipped,
                            bytes_read, time.perf_counter() - started)
        if decision.verify_next is None:
            if any(c.manifest is not None for c in candidates):
                raise NoGoodCheckpoint(
                    "no committed checkpoint passed verification: "
                    + "; ".join(f"{s.store}/{s.name}: {s.reason}" for s in decision.skipped)
                )
            return None
        c = decision.verify_next
        folder = Path(local_dir, c.name)
        shutil.rmtree(folder, ignore_errors=True)
        store = store_by_uri[c.store]
        try:
            source, files = c.name, files_for_rank(c.manifest, rank, world_size)
            if universal_copy is not None and needs_universal(c.manifest, world_size):
                source, copy = universal_copy(store, c)
                files = copy.files
            result = fetch(store, source, files, str(folder), deadline=deadline)
            problem = "; ".join(result.problems) or None
            bytes_read += result.bytes_read
        except (OSError, CommitError) as e:  # OSError includes a missed deadline
            problem = f"{c.store}/{c.name}: {e}"
        if not agree(problem is None):
            problem = problem or "another rank's files failed verification"
        verified[c.key] = problem
        if problem is not None:
            shutil.rmtree(folder, ignore_errors=True)
