"""Which checkpoint to restore, and restoring it: the newest whose files all verify.

Restore trusts nothing but a committed manifest: every file it reads is hashed on the way
and compared with the manifest, so a file that was truncated, rotted or deleted after the
commit makes the restore fall back to the previous good checkpoint, in this store or a
replica, and the decision lists what it skipped and why. The choice itself
(`choose_restore`) is a pure function of the candidates and what is known of them.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

import pyarrow.fs as pafs

from wildtrain.checkpoint.format import CheckpointManifest, ManifestError, files_for_rank, needs_universal, step_of
from wildtrain.checkpoint.store import CommitError, Store, StoreLike, as_store, fetch, read_manifest


class NoGoodCheckpoint(RuntimeError):
    """Committed checkpoints exist, but none passed verification."""


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


def choose_restore(
    candidates: Sequence[Candidate], verified: Mapping[tuple[str, str], Optional[str]]
) -> RestoreDecision:
    """Walk the candidates from the newest (by step; a step saved twice, by its newest
    commit; the same checkpoint in several stores, primary first) and stop at the first one
    that is verified good or not verified yet. `verified` maps a candidate's key to None
    (good) or what was wrong with it."""
    committed_at: dict[str, float] = {}
    for c in candidates:
        committed_at[c.name] = max(committed_at.get(c.name, 0.0), c.created)
    ordered = sorted(
        candidates,
        key=lambda c: (-(c.step if c.step is not None else -1), -committed_at[c.name], c.name, c.store_index),
    )
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


def restore(
    stores: Sequence[StoreLike],
    local_dir: str,
    *,
    rank: int,
    world_size: int,
    agree: Callable[[bool], bool] = lambda ok: ok,
    listing: Callable[[Callable[[], list[Candidate]]], list[Candidate]] = lambda list_them: list_them(),
    universal_copy: Optional[Callable[[Store, Candidate], tuple[str, CheckpointManifest]]] = None,
    deadline: Optional[float] = None,
) -> Optional[Restored]:
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
            return Restored(
                chosen,
                chosen.manifest,
                str(Path(local_dir, chosen.name)),
                decision.skipped,
                bytes_read,
                time.perf_counter() - started,
            )
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
