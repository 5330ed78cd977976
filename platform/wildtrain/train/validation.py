"""Validation during training: the loss and bits per byte of the whole validation set
(`data.validation`), per dataset and overall, at `eval.every` steps and the last.

Every objective is scored the same way, so runs of different objectives compare: next-token
loss over every token, with causal attention that never crosses a document (the model's
`document` mask, whatever `model.attention` trains with). Bits per byte divide the loss by
the UTF-8 bytes the scored tokens spell, so runs of different tokenizers compare too.

The numbers do not depend on the world size or on restarts: each rank scores a contiguous
share of the rows (`data.validation.rank_share`), and the sums of loss, tokens and bytes
are reduced over the ranks, never per-rank means. Every rank runs the same number of forward
passes (ranks with fewer rows score a padding batch they then drop), because under ZeRO-3
each forward pass gathers the parameters in collectives that every rank must join.
"""

from __future__ import annotations

import math
from typing import Iterator, Optional

import numpy as np
import torch
import torch.nn.functional as F

from wildtrain.config import EvalConfig, StorageConfig
from wildtrain.data.dataset import OpenedData
from wildtrain.data.validation import ValidationSet, rank_share, read_share
from wildtrain.train import collectives
from wildtrain.train.schedule import At, every


def due(at: At, evaluation: EvalConfig) -> bool:
    """Validation runs every `eval.every` steps (0: never) and at the run's last step."""
    return at.last or every(at.step, evaluation.every)


def batch_counts(sets: list[ValidationSet], world_size: int, micro_batch: int) -> list[int]:
    """Forward passes each rank needs for its share, in rank order: per set, its rows of
    the share in micro-batches of at most `micro_batch`. Pure."""
    counts = []
    for rank in range(world_size):
        per_set = np.zeros(len(sets), dtype=np.int64)
        for r in rank_share(sets, rank, world_size):
            per_set[r.set] += r.stop - r.start
        counts.append(int(sum(math.ceil(n / micro_batch) for n in per_set)))
    return counts


def metrics(names: list[str], sums: np.ndarray) -> dict[str, float]:
    """`val/loss`, `val/bpb` and `val/<name>/loss`, `val/<name>/bpb` from per-set sums of
    (loss in nats, tokens, bytes). Pure."""

    def scores(nll: float, tokens: float, nbytes: float) -> tuple[float, float]:
        return nll / max(tokens, 1.0), nll / math.log(2) / max(nbytes, 1.0)

    out: dict[str, float] = {}
    for name, (nll, tokens, nbytes) in zip(names, sums.tolist()):
        out[f"val/{name}/loss"], out[f"val/{name}/bpb"] = scores(nll, tokens, nbytes)
    out["val/loss"], out["val/bpb"] = scores(*sums.sum(axis=0).tolist())
    return out


class Validator:
    """One rank's part of every validation of an attempt: its rows are read at the first."""

    def __init__(
        self,
        data: OpenedData,
        seq_len: int,
        micro_batch: int,
        config: StorageConfig,
        rank: int,
        world_size: int,
        device: torch.device,
    ) -> None:
        """`data`'s validation sets of rows of `seq_len` (data.seq_len), read with `config` and
        scored `micro_batch` rows at a time (eval.micro_batch_size, else train's)."""
        self.seq_len, self.config = seq_len, config
        self.sets = data.validation
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.micro_batch = micro_batch
        self.passes = max(batch_counts(self.sets, world_size, self.micro_batch))
        # A copy: the table reaches a worker read-only (Ray hands numpy arrays over without a
        # copy), and torch.from_numpy warned of that on every worker of every run.
        self.token_bytes = torch.tensor(data.token_bytes, device=device)
        self._rows: Optional[list[tuple[int, np.ndarray, np.ndarray]]] = None

    def evaluate(self, engine) -> dict[str, float]:
        """The validation metrics at the engine's current weights (a collective)."""
        sums = torch.zeros(len(self.sets), 3, dtype=torch.float64, device=self.device)
        engine.eval()
        try:
            with torch.no_grad():
                for index, tokens, doc_ids in self._batches():
                    inputs, targets = tokens[:, :-1], tokens[:, 1:]
                    logits = engine(inputs, doc_ids=doc_ids[:, :-1], attention="document")
                    if index is None:
                        continue  # a padding pass: this rank's rows are done
                    nll = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum")
                    sums[index, 0] += nll.double()
                    sums[index, 1] += targets.numel()
                    sums[index, 2] += self.token_bytes[targets].sum().double()
        finally:
            engine.train()
        collectives.sum_(sums)
        return metrics([s.name for s in self.sets], sums.cpu().numpy())

    def _batches(self) -> Iterator[tuple[Optional[int], torch.Tensor, torch.Tensor]]:
        """(set index or None for padding, tokens, doc_ids) on the device, `self.passes` of them."""
        if self._rows is None:
            share = rank_share(self.sets, self.rank, self.world_size)
            self._rows = read_share(self.sets, share, self.seq_len, self.config)
        done = 0
        for index in range(len(self.sets)):
            parts = [(t, d) for i, t, d in self._rows if i == index]
            if not parts:
                continue
            tokens, doc_ids = (torch.from_numpy(np.concatenate(column)).long() for column in zip(*parts))
            for start in range(0, len(tokens), self.micro_batch):
                done += 1
                yield (
                    index,
                    tokens[start : start + self.micro_batch].to(self.device),
                    doc_ids[start : start + self.micro_batch].to(self.device),
                )
        padding = torch.zeros(1, self.seq_len + 1, dtype=torch.long, device=self.device)
        for _ in range(self.passes - done):
            yield None, padding, padding
