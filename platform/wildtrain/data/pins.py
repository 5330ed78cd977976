"""What a run's data order depends on, pinned in its run record.

The rows of step s are a pure function of the seed, the global batch, the sequence length,
the datasets with their weights and manifests, and the shards left out (`data.order`). A
resubmission that changed any of them would resume at the restored step in another order:
rows trained twice, rows never seen, and a loss curve that no longer means what it says. So
the driver refuses it, naming the keys, unless `data.allow_order_change` says the user means
it; the new order then starts at the restored step, recorded as an event.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Optional

from wildtrain.config import DataConfig, TrainConfig
from wildtrain.data.dataset import OpenedData


@dataclass(frozen=True)
class OrderPins:
    seed: int
    global_batch_size: int
    seq_len: int
    datasets: tuple[tuple[str, float, str], ...]  # (uri, weight, sha256 of its manifest.json)
    skipped_shards: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            key: list(map(list, value)) if key == "datasets" else list(value) if isinstance(value, tuple) else value
            for key, value in asdict(self).items()
        }

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "OrderPins":
        return cls(
            raw["seed"],
            raw["global_batch_size"],
            raw["seq_len"],
            tuple(tuple(d) for d in raw["datasets"]),
            tuple(raw["skipped_shards"]),
        )


def order_pins(data: DataConfig, train: TrainConfig, opened: OpenedData) -> OrderPins:
    """The order's pins of the datasets `opened` from `data`, drawn with `train`'s seed and
    global batch."""
    datasets = tuple(
        (d.root, float(spec.weight), sha)
        for d, spec, sha in zip(opened.datasets, data.datasets, opened.manifest_sha256)
    )
    return OrderPins(train.seed, train.global_batch_size, data.seq_len, datasets, tuple(sorted(opened.skipped_shards)))


def order_changes(pinned: Optional[OrderPins], now: OrderPins) -> list[str]:
    """What changed since the run record pinned the order, one line per config key; none
    for a run with nothing pinned yet (a new run, or one recorded before pins existed)."""
    if pinned is None:
        return []
    changes = [
        f"{key}: {old!r} -> {new!r}"
        for key, old, new in (
            ("train.seed", pinned.seed, now.seed),
            ("train.global_batch_size", pinned.global_batch_size, now.global_batch_size),
            ("data.seq_len", pinned.seq_len, now.seq_len),
        )
        if old != new
    ]
    # A dataset is its manifest, wherever it lies: a copy on another store (a run moved to
    # another cluster reads its own copy) is the same order.
    if [d[1] for d in pinned.datasets] != [d[1] for d in now.datasets]:
        changes.append(f"data.datasets: {_describe(pinned.datasets)} -> {_describe(now.datasets)}")
    else:
        changes += [
            f"data.datasets.{i}.uri: {new[0]}/manifest.json differs from the one the run started with"
            f"{'' if old[0] == new[0] else f' at {old[0]}'} (sha256 {old[2][:12]}… -> {new[2][:12]}…)"
            for i, (old, new) in enumerate(zip(pinned.datasets, now.datasets))
            if old[2] != new[2]
        ]
    if pinned.skipped_shards != now.skipped_shards:
        changes.append(
            f"data.skip_bad_shards: shards left out {list(pinned.skipped_shards)} -> {list(now.skipped_shards)}"
        )
    return changes


def _describe(datasets: tuple[tuple[str, float, str], ...]) -> str:
    return "[" + ", ".join(f"{uri} (weight {weight:g})" for uri, weight, _ in datasets) + "]"
