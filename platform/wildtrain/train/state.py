"""Everything a restarted worker needs to continue exactly where the run left off."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from wildtrain.data.dataset import DataPosition


@dataclass
class TrainState:
    step: int = 0
    tokens_seen: int = 0
    data: DataPosition = field(default_factory=DataPosition)
    # The data-parallel size the checkpoint was saved at; restoring at another size reshards.
    world_size: int = 0

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "TrainState":
        raw = json.loads(text)
        return cls(**{**raw, "data": DataPosition(**raw["data"])})
