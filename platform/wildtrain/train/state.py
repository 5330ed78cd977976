"""Everything a restarted worker needs to continue exactly where the run left off.

The data position is not stored: it is a pure function of the step (see data/order.py).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass


@dataclass
class TrainState:
    step: int = 0
    tokens_seen: int = 0
    # The data-parallel size the checkpoint was saved at; restoring at another size reshards.
    world_size: int = 0
    # The early-stop rule's lowest loss so far (train/divergence.py): kept, so a restart
    # judges its losses against the run's best, not only its own.
    best_loss: float = math.inf

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "TrainState":
        return cls(**json.loads(text))
