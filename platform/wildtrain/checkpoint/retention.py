"""Which checkpoints to delete: keep the newest `keep_last`, every step that is a multiple
of `keep_every` for good, and never the last good checkpoint.

"Good" means verified: uploaded and read back by this attempt's saver, or restored from.
A checkpoint that is merely committed may have rotted since, so it is not counted on to
replace the only one known to be good.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Sequence

from wildtrain.checkpoint.format import MANIFEST, ManifestError
from wildtrain.checkpoint.reshard import copies_of
from wildtrain.checkpoint.restore import Candidate, list_candidates
from wildtrain.checkpoint.store import Store, StoreLike, as_store, read_manifest


@dataclass(frozen=True)
class RetentionPolicy:
    keep_last: int = 3
    keep_every: int = 0  # 0: no permanent checkpoints

    def __post_init__(self) -> None:
        if self.keep_last < 0 or self.keep_every < 0:
            raise ValueError(
                f"retention: keep_last and keep_every must be >= 0, got {self.keep_last} and {self.keep_every}"
            )


def to_delete(committed_steps: Sequence[int], keep_last: int, keep_every: int, good: Collection[int]) -> list[int]:
    """The committed steps to delete, oldest first. Kept: the newest `keep_last`, every
    multiple of `keep_every` (if > 0), and, when none of those is good, the newest good one."""
    steps = sorted(set(committed_steps))
    keep = set(steps[-keep_last:]) if keep_last > 0 else set()
    if keep_every > 0:
        keep |= {s for s in steps if s % keep_every == 0}
    good_steps = [s for s in steps if s in good]
    if good_steps and not keep.intersection(good_steps):
        keep.add(good_steps[-1])
    return [s for s in steps if s not in keep]


@dataclass(frozen=True)
class RetentionPlan:
    delete: tuple[str, ...]  # checkpoint folder names
    reasons: tuple[str, ...]  # one per name, for the log
    # Of `delete`, the folders seen without a manifest: deleted only if a second read finds
    # none either, since an eventually consistent store may answer 404 for one that exists.
    uncommitted: tuple[str, ...] = ()


def plan_retention(candidates: Sequence[Candidate], policy: RetentionPolicy, good: Collection[str]) -> RetentionPlan:
    """The checkpoints of one store to delete.

    Per step only one committed checkpoint counts (a step saved again by a later attempt):
    a good one if any, else the newest; the others are superseded. Folders without a
    manifest are leftovers of failed saves once a newer step is committed (the save in
    flight is always newer than every commit). Folders with an unreadable manifest are
    left alone: they may be another version's."""
    committed = [c for c in candidates if c.manifest is not None]
    best: dict[int, Candidate] = {}
    for c in sorted(committed, key=lambda c: (c.name in good, c.created)):
        best[c.manifest.step] = c  # the last one sorted wins: good first, then newest
    delete: list[tuple[str, str]] = [
        (c.name, f"superseded by {best[c.manifest.step].name}") for c in committed if best[c.manifest.step] is not c
    ]
    good_steps = {step for step, c in best.items() if c.name in good}
    for step in to_delete(list(best), policy.keep_last, policy.keep_every, good_steps):
        delete.append((best[step].name, f"retention (keep_last={policy.keep_last}, keep_every={policy.keep_every})"))
    uncommitted = []
    if best:
        newest = max(best)
        uncommitted = [
            (c.name, f"never committed, older than step {newest}")
            for c in candidates
            if c.manifest is None and c.problem is None and c.step is not None and c.step < newest
        ]
    delete += uncommitted
    return RetentionPlan(
        tuple(name for name, _ in delete), tuple(reason for _, reason in delete), tuple(name for name, _ in uncommitted)
    )


def delete_checkpoint(store: StoreLike, name: str) -> None:
    """The checkpoint and its universal copies (`reshard`). Each manifest goes first, so a
    checkpoint stops existing at once and a crash midway leaves an uncommitted folder, never
    a committed one with files missing."""
    store = as_store(store)
    for folder in [*copies_of(store, name), name]:
        manifest = store.path(folder, MANIFEST)
        if store.fs.get_file_info(manifest).is_file:
            store.fs.delete_file(manifest)
        try:
            store.fs.delete_dir(store.path(folder))
        except FileNotFoundError:
            pass  # SeaweedFS goes on listing a folder whose objects are all deleted, and refuses to delete it


def apply_retention(store: StoreLike, policy: RetentionPolicy, good: Collection[str]) -> RetentionPlan:
    """Delete, in `store`, what `plan_retention` says, except a folder seen uncommitted that
    a second read does not confirm; returns the plan carried out. A read that fails keeps
    the folder: only a folder known to be uncommitted may go."""
    store = as_store(store)
    plan = plan_retention(list_candidates([store]), policy, good)
    confirmed = [
        (name, why)
        for name, why in zip(plan.delete, plan.reasons)
        if name not in plan.uncommitted or _confirmed_uncommitted(store, name)
    ]
    for name, _ in confirmed:
        delete_checkpoint(store, name)
    return RetentionPlan(
        tuple(name for name, _ in confirmed),
        tuple(why for _, why in confirmed),
        tuple(name for name, _ in confirmed if name in plan.uncommitted),
    )


def _confirmed_uncommitted(store: Store, name: str) -> bool:
    try:
        return read_manifest(store, name) is None
    except (OSError, ManifestError):
        return False
