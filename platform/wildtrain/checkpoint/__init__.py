"""DeepSpeed checkpoints with an opaque client state, in one folder per checkpoint.

Every rank calls `save` into a folder of its own (captured into host memory by
`async_save.AsyncSaver`, which uploads it to the checkpoint store and commits it with a
manifest, see `store`): rank 0 contributes the model states, the `latest` tag file and the
client state; every rank its own ZeRO optimizer partition. This module knows nothing of
what the client state means.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from wildtrain import storage

STATE_FILE = "client_state.json"


def save(engine, directory: str, tag: str, client_state: str, rank: int) -> None:
    """Write this rank's part of the checkpoint `tag` into `directory` (a collective)."""
    engine.save_checkpoint(directory, tag=tag)
    if rank == 0:
        storage.write_text(str(Path(directory) / STATE_FILE), client_state)


def read_client_state(directory: str) -> Optional[str]:
    path = Path(directory) / STATE_FILE
    return path.read_text() if path.is_file() else None


def load(engine, directory: str, tag: str) -> None:
    """Load model, optimizer and LR-schedule states of checkpoint `tag` in `directory`."""
    load_path, _ = engine.load_checkpoint(directory, tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True)
    if load_path is None:
        raise RuntimeError(f"DeepSpeed found no checkpoint {tag!r} in {directory}")
