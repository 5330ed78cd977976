"""What one partition's task of `prepare` makes: its part record (`parts/PPPPP.json`: what it
was prepared from and what it holds) and its result, which the driver's progress line counts."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from wildtrain.data.manifest import Shard


@dataclass
class Part:
    """A partition's part record: what it was prepared from (`key`) and what it holds."""

    key: dict
    shards: list[Shard]
    validation: list[Shard]
    documents: int
    bad_records: int
    tokens: int  # ids tokenized, end-of-document ids included, before the tail is dropped
    held_out: int  # of `documents`, for validation

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str) -> "Part":
        data = json.loads(text)
        return cls(
            **{
                **data,
                "shards": [Shard(**s) for s in data["shards"]],
                "validation": [Shard(**s) for s in data["validation"]],
            }
        )


@dataclass
class PartResult:
    index: int
    part: Part
    written: list[str]
    unchanged: list[str]
    read: bool  # tokenized by this run, rather than found stored and verified
    cpu_s: float  # the task's CPU time, tokenizer threads included
