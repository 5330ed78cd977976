"""Resharding in any store: a committed checkpoint converted to DeepSpeed's universal format
once, and the result committed beside it with a manifest of its own.

    <store>/step_000000100-3f9a1c/            the checkpoint as saved (every rank's ZeRO partition)
    <store>/step_000000100-3f9a1c.u5e2b07d1/  its universal copy: client_state.json,
                                              <tag>_universal/..., manifest.json (written last)

A group at a new world size then downloads the universal copy only, not the partitions it
was made from: for the 7b preset, each rank used to download the whole checkpoint (about
94 GB) and convert it into /tmp itself (about 80 GB more). One process converts, in
`checkpoint.staging_dir`: rank 0 inside a restart, or the controller ahead of a resize.

The copy's name carries the converter's token, so that two conversions of one checkpoint
running at once (the controller's, and a restart's) never write into one folder; a reader
takes any committed copy. The copy is no restore candidate by itself (its name is not a
checkpoint name), and retention deletes it with its checkpoint.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

import pyarrow.fs as pafs

from wildtrain.checkpoint import STATE_FILE
from wildtrain.checkpoint.format import CheckpointManifest, new_attempt_token
from wildtrain.checkpoint.store import CommitError, StoreLike, as_store, commit, fetch, read_manifest, upload


def copies_of(store: StoreLike, name: str) -> list[str]:
    """The folders of the universal copies of checkpoint `name`, committed or not."""
    store = as_store(store)
    infos = store.fs.get_file_info(pafs.FileSelector(store.root, allow_not_found=True))
    return sorted(
        info.base_name
        for info in infos
        if info.type == pafs.FileType.Directory and info.base_name.startswith(f"{name}.u")
    )


def find_universal(store: StoreLike, name: str) -> Optional[tuple[str, CheckpointManifest]]:
    """A committed universal copy of checkpoint `name`: its folder and manifest."""
    for copy in copies_of(store, name):
        manifest = read_manifest(store, copy)
        if manifest is not None:
            return copy, manifest
    return None


def convert_in_store(
    store: StoreLike,
    name: str,
    manifest: CheckpointManifest,
    staging_dir: str,
    *,
    deadline: Optional[float] = None,
    in_process: bool = False,
) -> tuple[str, CheckpointManifest]:
    """The universal copy of committed checkpoint `name`: found, or made now (downloaded and
    verified into `staging_dir`, converted there, uploaded and committed); its folder and
    manifest. Raises `CommitError` when the checkpoint's files do not verify. `in_process`:
    see `universal.convert`."""
    store = as_store(store)
    found = find_universal(store, name)
    if found is not None:
        return found
    Path(staging_dir).mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f"{name}-universal-", dir=staging_dir))
    try:
        original = staging / "original"
        fetched = fetch(store, name, manifest.files, str(original), deadline=deadline)
        if fetched.problems:
            raise CommitError(f"cannot convert {store.describe(name)}: " + "; ".join(fetched.problems))
        # Imported here: it imports torch, which Ray Train's controller (converting ahead of a
        # resize) would otherwise import at every run's start.
        from wildtrain.checkpoint import universal

        utag = universal.convert(str(original), manifest.tag, in_process=in_process)
        # What a universal load reads, and nothing of the partitions it was made from.
        copy = staging / "copy"
        copy.mkdir()
        os.rename(original / utag, copy / utag)
        if (original / STATE_FILE).is_file():
            os.rename(original / STATE_FILE, copy / STATE_FILE)
        copy_name = f"{name}.u{new_attempt_token()}"
        files = upload(str(copy), store, copy_name, deadline=deadline)
        return copy_name, commit(
            store,
            copy_name,
            step=manifest.step,
            tag=utag,
            world_size=manifest.world_size,
            zero_stage=manifest.zero_stage,
            files=files,
            data_position=manifest.data_position,
            config_hash=manifest.config_hash,
        )
    finally:
        shutil.rmtree(staging, ignore_errors=True)
