"""The background half of an asynchronous save (see `async_save`): the staging write, the upload
to each store, verification, this rank's part record, and on rank 0 the commit and retention.

It runs in the saver's process or thread alike (`save_process`, or a thread of the saver):
everything it needs from the saver comes in a `SaveJob` and `SaveSettings`, everything it
tells the saver goes through a `Link` or comes back in the `SaveResult`.
"""

from __future__ import annotations

import errno
import shutil
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Protocol, Sequence

import torch

from wildtrain.checkpoint.format import FileEntry, ManifestError
from wildtrain.checkpoint.retention import RetentionPolicy, apply_retention
from wildtrain.checkpoint.save_policy import DiskFull, Failure, SaveOutcome, Status
from wildtrain.checkpoint.store import (
    CHUNK_BYTES,
    Cancelled,
    CommitError,
    DeadlineExceeded,
    PartFailed,
    Store,
    check_deadline,
    commit,
    commit_when_complete,
    upload,
    write_part,
)


@dataclass(frozen=True)
class CheckpointMeta:
    """What the manifest records besides the files; the same on every rank."""

    step: int
    tag: str  # DeepSpeed's tag (the engine files' subfolder)
    world_size: int
    zero_stage: int
    data_position: dict = field(default_factory=dict)
    config_hash: str = ""


def disk_free(path: str) -> Optional[int]:
    """Free bytes on the local filesystem that holds (or would hold) `path`; None for URIs."""
    if "://" in path:
        return None
    existing = Path(path)
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    return shutil.disk_usage(existing).free


@dataclass(frozen=True)
class SaveSettings:
    """The saver's settings the background half needs; the same for every save."""

    stores: tuple[Store, ...]
    rank: int
    world_size: int
    timeout_s: float
    verify_upload: bool
    retention: Optional[RetentionPolicy]
    disk_free: Callable[[str], Optional[int]]


@dataclass(frozen=True)
class SaveJob:
    meta: CheckpointMeta
    name: str
    folder: Path
    pending: tuple[tuple[str, Any], ...]  # (path in folder, host copy or bytes)
    bytes_needed: int  # the host copies' size
    stall_s: float
    good: frozenset[tuple[str, str]]  # (store URI, name) that retention never deletes all of


@dataclass(frozen=True)
class SaveResult:
    outcome: SaveOutcome
    last_bytes: Optional[int]  # what the next save will need on the staging disk; None: as before
    good: frozenset[tuple[str, str]]
    last_commit: Optional[str]  # rank 0: where this save was committed first


class Link(Protocol):
    """What the background half tells the saver, and asks of it, while a save runs."""

    def doing(self, what: str) -> None: ...

    def deadline(self, at: float) -> None:
        """A new deadline (`time.monotonic()`) bounds what follows, until the next one."""

    def report_collected(self, step: int) -> bool: ...

    def wait(self, seconds: float) -> bool:
        """Wait; true once the saver is closing (so that waits for other ranks end)."""


class DiskFullError(OSError):
    def __init__(self, full: DiskFull) -> None:
        super().__init__(errno.ENOSPC, str(full))
        self.disk_full = full


def _is_no_space(error: BaseException) -> bool:
    return isinstance(error, OSError) and (error.errno == errno.ENOSPC or "No space left on device" in str(error))


def describe(error: BaseException) -> str:
    """The error and where it came from: a bug here should be findable from the metrics log."""
    frames = traceback.extract_tb(error.__traceback__)
    where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    return f"{type(error).__name__}: {error}{where}"


def run_save(settings: SaveSettings, job: SaveJob, link: Link) -> SaveResult:
    """One save's background half; never raises (a bug ends as a failed outcome)."""
    try:
        return _Save(settings, job, link).run()
    except Exception as e:  # a bug here must neither stop training nor leave the saver busy for good
        return SaveResult(
            SaveOutcome(job.meta.step, job.name, "failed", describe(e), "error", job.stall_s), None, job.good, None
        )


class _Save:
    def __init__(self, settings: SaveSettings, job: SaveJob, link: Link) -> None:
        self.s, self.job, self.link = settings, job, link
        self.good = set(job.good)
        self.last_bytes: Optional[int] = None
        self.last_commit: Optional[str] = None
        self.notes: list[str] = []  # deletions by retention, problems that did not fail the save

    def _deadline(self) -> float:
        at = time.monotonic() + self.s.timeout_s
        self.link.deadline(at)
        return at

    def run(self) -> SaveResult:
        started = time.perf_counter()
        job, meta = self.job, self.job.meta

        def outcome(status: Status, reason: str = "", failure: Failure = "", **extra) -> SaveResult:
            return SaveResult(
                SaveOutcome(
                    meta.step, job.name, status, reason, failure, job.stall_s, time.perf_counter() - started, **extra
                ),
                self.last_bytes,
                frozenset(self.good),
                self.last_commit,
            )

        try:
            self._write_staging(self._deadline())
        except Exception as e:  # a checkpoint that cannot be written must not stop training
            if isinstance(e, DiskFullError):
                failed = outcome("failed", str(e.disk_full), "disk_full", disk_full=e.disk_full)
            elif isinstance(e, DeadlineExceeded):
                failed = outcome("failed", f"step {meta.step}: {e}", "timeout")
            else:
                failed = outcome("failed", f"writing step {meta.step} to {job.folder}: {describe(e)}", "error")
            self._tell_rank_zero([(store, self._deadline()) for store in self.s.stores], failed.outcome.reason)
            return failed
        size = sum(p.stat().st_size for p in job.folder.rglob("*") if p.is_file())
        self.last_bytes = size

        # This rank's part in every store first, each store with its own deadline, so that a
        # store that is down costs the others nothing.
        uploaded: list[tuple[Store, float]] = []
        errors: dict[str, tuple[Failure, str, Optional[DiskFull]]] = {}
        for store in self.s.stores:
            deadline = self._deadline()
            try:
                files = upload(
                    str(job.folder),
                    store,
                    job.name,
                    deadline=deadline,
                    verify=self.s.verify_upload,
                    on_progress=self.link.doing,
                )
                self.link.doing(f"recording rank {self.s.rank}'s part in {store.describe(job.name)}")
                write_part(store, job.name, self.s.rank, files)
                uploaded.append((store, deadline))
            except Exception as e:
                errors[store.uri] = self._failure(e, store.describe(job.name), size)
        if self.s.rank != 0:
            self._tell_rank_zero(
                [(s, self._deadline()) for s in self.s.stores if s.uri in errors],
                "; ".join(message for _, message, _ in errors.values()),
            )
            stored = [store.uri for store, _ in uploaded]
        else:
            stored = self._commit_everywhere(uploaded, errors, size)
        failure: Failure = next((kind for kind, _, _ in errors.values() if kind), "")
        full = next((full for _, _, full in errors.values() if full), None)
        status: Status = "saved" if not errors else "partial" if stored else "failed"
        # The stores in the order given: the primary's failure, if it failed, names the save's.
        reason = "; ".join(errors[s.uri][1] for s in self.s.stores if s.uri in errors)
        return outcome(
            status,
            reason,
            failure,
            bytes=size,
            stored=tuple(s.uri for s in self.s.stores if s.uri in stored),
            notes=tuple(self.notes),
            disk_full=full,
        )

    def _write_staging(self, deadline: float) -> None:
        job = self.job
        free = self.s.disk_free(str(job.folder))
        if free is not None and free < job.bytes_needed:
            self.last_bytes = job.bytes_needed  # so that admission skips saves until the disk has room
            raise DiskFullError(DiskFull(str(job.folder), job.bytes_needed, free))
        for rel, obj in job.pending:
            check_deadline(deadline, f"writing {job.folder / rel}")
            path = job.folder / rel
            self.link.doing(f"writing {path}")
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                if isinstance(obj, bytes):
                    path.write_bytes(obj)
                else:
                    torch.save(obj, path)
            except Exception as e:
                # torch's writer reports a full disk as a RuntimeError without an errno, so
                # a failed write on a disk that is now (nearly) full counts as a full disk.
                free = self.s.disk_free(str(path))
                if _is_no_space(e) or (free is not None and free < CHUNK_BYTES):
                    raise DiskFullError(DiskFull(str(path), job.bytes_needed, free)) from e
                raise

    def _failure(self, error: Exception, where: str, size: int) -> tuple[Failure, str, Optional[DiskFull]]:
        if _is_no_space(error):
            full = DiskFull(where, size, self.s.disk_free(where))
            return "disk_full", str(full), full
        if isinstance(error, Cancelled):
            return "timeout", str(error), None
        if isinstance(error, DeadlineExceeded):
            return "timeout", f"{error} (timeout_s={self.s.timeout_s})", None
        if isinstance(error, PartFailed):
            return "storage", str(error), None
        if isinstance(error, (CommitError, ManifestError)):
            return "verify", str(error), None
        if isinstance(error, OSError):
            return "storage", f"{where}: {error}", None
        return "error", f"{where}: {describe(error)}", None

    def _tell_rank_zero(self, stores: Sequence[tuple[Store, float]], reason: str) -> None:
        """Record in each store that this rank's part failed, so rank 0 stops waiting for it.
        The store may be the one that is down: keep trying (with backoff) until the record
        is in, the store's deadline passes, or the saver closes. Meanwhile this save stays in
        flight, and later saves are skipped, as they would fail against a store that is down."""
        if self.s.rank == 0:
            return  # rank 0 commits; nobody waits for its part
        for store, deadline in stores:
            interval = 1.0
            while True:
                self.link.doing(f"recording in {store.describe(self.job.name)} that rank {self.s.rank}'s part failed")
                try:
                    write_part(store, self.job.name, self.s.rank, (), failed=reason or "failed")
                    break
                except OSError:
                    if time.monotonic() + interval > deadline or self.link.wait(interval):
                        break
                    # Short: once the store is back, rank 0 should hear of the failure at once.
                    interval = min(interval * 2, 5.0)

    def _commit_everywhere(
        self,
        uploaded: Sequence[tuple[Store, float]],
        errors: dict[str, tuple[Failure, str, Optional[DiskFull]]],
        size: int,
    ) -> list[str]:
        """Rank 0: commit the checkpoint in each store where every rank's part is in (see
        `commit_when_complete`), then apply retention there. A commit also waits until the
        controller has the step's report (see `AsyncSaver.release`)."""
        meta, name, stored = self.job.meta, self.job.name, []

        def commit_in(store: Store, files: tuple[FileEntry, ...]) -> None:
            commit(
                store,
                name,
                step=meta.step,
                tag=meta.tag,
                world_size=meta.world_size,
                zero_stage=meta.zero_stage,
                files=files,
                data_position=meta.data_position,
                config_hash=meta.config_hash,
            )
            stored.append(store.uri)
            if len(stored) == 1:  # the first store committed: the primary, if it works
                self.last_commit = store.describe(name)
            self.notes.extend(self._after_commit(store))

        def held_by() -> Optional[str]:
            collected = self.link.report_collected(meta.step)
            return None if collected else f"waiting for the report of step {meta.step} to be collected"

        failed = commit_when_complete(
            uploaded,
            name,
            self.s.world_size,
            commit_in,
            held_by=held_by,
            wait=self.link.wait,
            on_progress=self.link.doing,
        )
        describe_in = {store.uri: store.describe(name) for store, _ in uploaded}
        errors |= {uri: self._failure(error, describe_in[uri], size) for uri, error in failed.items()}
        return stored

    def _after_commit(self, store: Store) -> list[str]:
        if self.s.verify_upload:
            self.good.add((store.uri, self.job.name))
        if self.s.retention is None:
            return []
        self.link.doing(f"applying retention in {store.uri}")
        try:
            plan = apply_retention(store, self.s.retention, {name for uri, name in self.good if uri == store.uri})
            return [f"deleted {store.describe(name)}: {why}" for name, why in zip(plan.delete, plan.reasons)]
        except OSError as e:  # the checkpoint is committed; deletion is retried after the next one
            return [f"retention in {store.uri} failed: {e}"]
