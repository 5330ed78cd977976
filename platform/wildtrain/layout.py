"""Where a run keeps what it writes: one folder per run under `run.storage` (a local path
or an object-store URI), shared by the driver, the workers and the controller.

    <run.storage>/<run.name>/
        wildtrain_run.json     the run record: its MLflow run, config hash, data order pins,
                               and for exports its model and tokenizer (`run_record`)
        lease.json             which driver trains the run now, until when (wildtrain.lease)
        checkpoints/           committed checkpoints (unless checkpoint.store names another)
        hangs/<time>-rank<r>.txt   the hang watchdog's stacks, attached to MLflow by the controller
        samples/step_<n>.json  each global batch's sample ids (data.record_samples)
        chaos_failed           written by the chaos.fail_rank drill when it fires: it fires once
        tracking/              MLflow records not yet sent (always on a local disk)
"""

from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from wildtrain import storage
from wildtrain.checkpoint.store import Store
from wildtrain.config import CheckpointConfig, ModelConfig, RunSectionConfig, StorageConfig

_HANG_DUMP = re.compile(r"-rank(\d+)\.txt$")


@dataclass(frozen=True)
class RunLayout:
    root: str  # <run.storage>/<run.name>, resolved
    checkpoint_uris: tuple[str, ...]  # primary first, then the replica
    tracking: Path

    @classmethod
    def of(cls, run: RunSectionConfig, checkpoint: CheckpointConfig) -> "RunLayout":
        root = storage.join(storage.resolve(run.storage), run.name)
        primary = checkpoint.store or storage.join(root, "checkpoints")
        # Unsent records go to a local disk even when the run's folder is in an object
        # store: they must survive the MLflow outage they wait out, not add a dependency.
        local_runs = root if "://" not in root else storage.join(storage.resolve(RunSectionConfig.storage), run.name)
        return cls(
            root,
            (primary,) + ((checkpoint.replica,) if checkpoint.replica else ()),
            Path(local_runs) / "tracking",
        )

    @property
    def record(self) -> str:
        return storage.join(self.root, "wildtrain_run.json")

    @property
    def lease(self) -> str:
        return storage.join(self.root, "lease.json")

    @property
    def hangs(self) -> str:
        return storage.join(self.root, "hangs")

    @property
    def samples(self) -> str:
        return storage.join(self.root, "samples")

    @property
    def chaos_failed(self) -> str:
        return storage.join(self.root, "chaos_failed")

    def sample_file(self, step: int) -> str:
        return storage.join(self.samples, f"step_{step:08d}.json")


def checkpoint_stores(layout: RunLayout, config: StorageConfig) -> list[Store]:
    """The checkpoint stores of the run, primary first, reached with the run's storage config."""
    return [Store.from_uri(uri, config) for uri in layout.checkpoint_uris]


def hang_dump_name(rank: int) -> str:
    return f"{time.strftime('%Y%m%d-%H%M%S')}-rank{rank}.txt"


def rank_of_hang_dump(name: str) -> int | None:
    found = _HANG_DUMP.search(name)
    return int(found.group(1)) if found else None


def run_record(model: ModelConfig, tokenizer: dict) -> dict:
    """What the driver adds to the run record for exports (`export.run_info` reads it): the
    model and the tokenizer."""
    return {"model": asdict(model), "tokenizer": tokenizer}
