"""The checkpoint format: the layout of a checkpoint in a store, its manifest, its name.

A store is a folder given by URI (a local path, s3://, gs://; see `wildtrain.storage`).
Each checkpoint is one subfolder, named by `checkpoint_name(step, attempt)`:

    <store>/step_000000100-3f9a1c/
        latest, client_state.json, <tag>/...   the files of every rank: one DeepSpeed folder
        _parts/rank_00000.json ...             each rank's uploaded files, sizes and sha256
        manifest.json                          written last: the checkpoint exists from here on

A checkpoint is committed when, and only when, its `manifest.json` exists (see `store` for
how it gets there, `restore` for how it is read back).

Names carry the attempt (a token every rank of one worker group shares) so that a step
saved again after a fallback never writes into the folder, or reads the part records, of
the earlier attempt's save of that step.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import asdict, dataclass
from typing import Optional

MANIFEST = "manifest.json"
PARTS_DIR = "_parts"
FORMAT = 1
_NAME = re.compile(r"^step_(\d+)-([0-9A-Za-z]+)$")
# DeepSpeed's per-rank ZeRO files (optimizer partitions; ZeRO-3 model partitions too).
_RANK_FILE = re.compile(r"(?:^|/)(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_\d+_")


class ManifestError(ValueError):
    """A manifest or part record that cannot be read; the message names its path."""


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
