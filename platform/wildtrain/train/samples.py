"""The sample ids of every global batch, for checking what a run trained on (data.record_samples)."""

from __future__ import annotations

import json

import numpy as np

from wildtrain import storage
from wildtrain.config import StorageConfig
from wildtrain.layout import RunLayout
from wildtrain.train import collectives


class SampleRecorder:
    """Writes each global batch's sample ids to the run's samples/ folder (rank 0, gathered
    from all ranks in rank order); a step redone after a restore overwrites its file, so the
    folder holds the batches of the run's final lineage."""

    def __init__(self, layout: RunLayout, config: StorageConfig, rank: int) -> None:
        self.layout = layout
        self.rank = rank
        self.storage = config

    def record(self, step: int, ids: np.ndarray) -> None:
        gathered = collectives.all_gather_object(ids.tolist())
        if self.rank == 0:
            record = {"step": step, "world_size": len(gathered), "sample_ids": [i for rank in gathered for i in rank]}
            storage.write_text(self.layout.sample_file(step), json.dumps(record), self.storage)
