"""What the driver hands every worker of a run: made by the driver, handed on by the
controller's joiners (`elastic.joiners`) to the workers they start, read by the workers'
loop (`train`). Ray pickles it by reference, so every process imports this module."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from wildtrain import storage
from wildtrain.config import Config
from wildtrain.data.dataset import OpenedData


@dataclass(frozen=True)
class LoopInputs:
    """What the driver hands every worker: the run's config, its opened datasets, what
    one worker holds on its node (to look for room for another), and where the driver's
    s3:// URIs went."""

    cfg: Config
    data: OpenedData
    worker_resources: dict[str, float]
    storage_view: storage.StorageView
    # The driver's rendezvous (host, port) with elastic.in_process, else None.
    rendezvous: Optional[tuple[str, int]] = None
