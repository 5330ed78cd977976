"""What the driver hands Ray Train: the function every worker runs and its inputs. The driver
pickles both by reference, so it imports this module and not train/loop.py, whose imports (the
engine, the model, torch._dynamo: 1.3 s of the driver's start here) only a worker needs."""

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


def worker_main(inputs: LoopInputs) -> None:
    """Every worker's training function: `train.loop.train_loop`, imported where it runs."""
    from wildtrain.train.loop import train_loop

    train_loop(inputs)
