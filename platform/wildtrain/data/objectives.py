"""What the model learns from a packed row (`train.objective`), as a pure function of
(seed, step, sample id, the row's tokens and doc_ids): a restart at any world size rebuilds
exactly the examples it lost, so exactly-once data and same-losses-across-resizes hold for
every objective.

Rows keep their length: each document of a row (a run of equal doc_ids, cut at the row's
ends) becomes one example of the same length, in place, so batching, the data order and
resharding are untouched:

- causal: the document itself; loss on every position (the plain LM).
- prefix_lm: [mode] + inputs + targets, the targets a random suffix.
- ul2: per document, one denoiser drawn from the mixture. A `span` denoiser (R, X) gives
  [mode] + the document with each corrupted span replaced by a sentinel (the inputs), then
  each sentinel followed by its span (the targets), from as much of the document as fits;
  a `prefix` denoiser (S) is prefix_lm's.

Inputs attend bidirectionally under `model.attention=prefix_lm`; the loss is on the
targets only. A document too short for its denoiser is kept as text with no loss. The
model sees `FIELDS` per position (tokens, their next-token targets, the loss mask, doc_ids,
rotary positions and the prefix flags), stacked as (rows, len(FIELDS), seq_len) int32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from wildtrain.config import ModelConfig, ObjectiveConfig, TrainConfig
from wildtrain.data.manifest import DataError
from wildtrain.data.tokenizer import MODE_TOKENS

FIELDS = ("tokens", "targets", "loss_mask", "doc_ids", "positions", "prefix")
# Mixed into every row's seed, so the corruption draws nothing in common with other uses of train.seed.
_STREAM = 0x554C32


@dataclass(frozen=True)
class Denoiser:
    name: str
    kind: str  # span | prefix
    mean_span: float
    corruption: float
    weight: float
    mode: Optional[int]  # the mode token's id


@dataclass(frozen=True)
class Example:
    """One document's example: `tokens` and, per token, whether it is an input (prefix)
    and whether it is a target (loss on)."""

    tokens: np.ndarray
    prefix: np.ndarray
    target: np.ndarray


@dataclass(frozen=True)
class Objective:
    kind: str  # causal | prefix_lm | ul2
    denoisers: tuple[Denoiser, ...]
    sentinels: tuple[int, ...]
    eos_id: int
    seed: int
    # Rotary positions restart at every document (document-based attention masks).
    per_document_positions: bool

    @classmethod
    def of(cls, objective: ObjectiveConfig, train: TrainConfig, model: ModelConfig, tokenizer: dict) -> "Objective":
        """The run's objective (`train.objective`, configured by `objective`, its seed
        `train.seed`, its positions per document unless `model.attention` is causal), with its
        reserved ids from the dataset's tokenizer (the manifest's record of it); `DataError`
        naming the key when the dataset lacks them."""
        kind = train.objective
        if kind == "causal":
            denoisers = ()
        elif kind == "prefix_lm":
            denoisers = (Denoiser("S", "prefix", 0.0, objective.prefix_target, 1.0, None),)
        else:
            modes = tokenizer.get("modes", {})
            denoisers = []
            for i, d in enumerate(objective.denoisers):
                if d.mode is not None and d.mode not in modes:
                    raise DataError(
                        f"objective.denoisers.{i}.mode: {d.mode} is not a reserved token of the dataset's "
                        f"tokenizer (it reserves {', '.join(modes) or 'none'}); datasets prepared by this version "
                        f"of data_pipelines/prepare.py reserve {', '.join(MODE_TOKENS)}"
                    )
                denoisers.append(
                    Denoiser(
                        d.name, d.kind, d.mean_span, d.corruption, d.weight, None if d.mode is None else modes[d.mode]
                    )
                )
            denoisers = tuple(denoisers)
        sentinels = tuple(tokenizer.get("sentinels", ()))
        if any(d.kind == "span" for d in denoisers) and not sentinels:
            raise DataError(
                "train.objective: ul2's span denoisers need sentinel ids, and the dataset's manifest "
                "records none; prepare the dataset again with this version of data_pipelines/prepare.py "
                "(or give its tokenizer.json <extra_id_N> tokens)"
            )
        return cls(kind, denoisers, sentinels, tokenizer["eos_id"], train.seed, model.attention != "causal")

    @property
    def plain(self) -> bool:
        """Causal over whole rows: the model needs the tokens alone, as rows of seq_len + 1."""
        return self.kind == "causal" and not self.per_document_positions

    def rows(self, step: int, sample_ids: np.ndarray, tokens: np.ndarray, doc_ids: Optional[np.ndarray]) -> np.ndarray:
        """The model's input for one step's rows ((rows, seq_len + 1) tokens and doc_ids):
        the tokens themselves when `plain` (no doc_ids needed), else (rows, len(FIELDS),
        seq_len) int32."""
        if self.plain:
            return tokens
        return np.stack([self.row(step, int(i), t, d) for i, t, d in zip(sample_ids, tokens, doc_ids)])

    def row(self, step: int, sample_id: int, tokens: np.ndarray, doc_ids: np.ndarray) -> np.ndarray:
        """(len(FIELDS), seq_len) for one row of seq_len + 1 tokens."""
        starts = np.flatnonzero(np.diff(doc_ids, prepend=doc_ids[0] - 1))
        bounds = [*starts.tolist(), len(tokens)]
        if self.kind == "causal":
            seq, prefix, target = tokens, np.zeros(len(tokens), bool), np.ones(len(tokens), bool)
        else:
            rng = np.random.default_rng([self.seed, step, sample_id, _STREAM])
            examples = [self.example(tokens[a:b], rng) for a, b in zip(bounds[:-1], bounds[1:])]
            seq, prefix, target = (
                np.concatenate(parts) for parts in zip(*((e.tokens, e.prefix, e.target) for e in examples))
            )
        length = len(tokens) - 1
        if self.per_document_positions:
            positions = np.arange(length) - np.repeat(starts, np.diff(bounds))[:length]
        else:
            positions = np.arange(length)
        return np.stack([seq[:-1], seq[1:], target[1:], doc_ids[:-1], positions, prefix[:-1]]).astype(np.int32)

    def example(self, document: np.ndarray, rng: np.random.Generator) -> Example:
        """`document`'s example under a denoiser drawn from the mixture, of its length."""
        weights = np.array([d.weight for d in self.denoisers])
        denoiser = self.denoisers[rng.choice(len(weights), p=weights / weights.sum())]
        made = (span_example if denoiser.kind == "span" else prefix_example)(
            document, denoiser, self.sentinels, self.eos_id, rng
        )
        if made is None:
            return Example(document, np.zeros(len(document), bool), np.zeros(len(document), bool))
        return made


def span_example(
    document: np.ndarray, d: Denoiser, sentinels: tuple[int, ...], eos_id: int, rng: np.random.Generator
) -> Optional[Example]:
    """T5-style span corruption of the longest start of `document` whose example fits in
    its length: [mode] + kept text with a sentinel per span + (sentinel + span) per span,
    padded with end-of-document ids (no loss) to the length; None if too short. The
    number of corrupted tokens and of spans are rounded at random, so their means over
    many examples are the configured corruption and mean span."""
    mode = [] if d.mode is None else [d.mode]
    length = len(document)
    u_noise, u_spans = rng.random(2)
    n = length - len(mode)
    while n >= 2:
        noise = int(np.clip(np.floor(n * d.corruption + u_noise), 1, n - 1))
        spans = int(np.clip(np.floor(noise / d.mean_span + u_spans), 1, min(noise, n - noise)))
        over = len(mode) + n + 2 * spans - length
        if over <= 0:
            break
        n -= over
    else:
        return None
    noise_lengths = _segments(noise, spans, rng)
    kept_lengths = _segments(n - noise, spans, rng)
    inputs, targets = list(mode), []
    at = 0
    for k, (kept, corrupted) in enumerate(zip(kept_lengths, noise_lengths)):
        sentinel = sentinels[k % len(sentinels)]
        inputs += [*document[at : at + kept], sentinel]
        targets += [sentinel, *document[at + kept : at + kept + corrupted]]
        at += kept + corrupted
    pad = length - len(inputs) - len(targets)
    tokens = np.array(inputs + targets + [eos_id] * pad, dtype=document.dtype)
    flags = np.zeros(length, bool)
    prefix, target = flags.copy(), flags.copy()
    prefix[: len(inputs)] = True
    target[len(inputs) : len(inputs) + len(targets)] = True
    return Example(tokens, prefix, target)


def prefix_example(
    document: np.ndarray, d: Denoiser, sentinels: tuple[int, ...], eos_id: int, rng: np.random.Generator
) -> Optional[Example]:
    """[mode] + the document's start (inputs) + the rest (targets), the targets' share
    uniform on the widest interval in [0, 1] centred on the corruption ([0, 2c] up to 0.5,
    [2c - 1, 1] above), so its mean is the corruption; None if too short."""
    mode = [] if d.mode is None else [d.mode]
    n = len(document) - len(mode)
    if n < 2:
        return None
    # Centred, not [0, 2c] clipped at 1: clipping would pull a mean above 0.5 down (0.75 -> 2/3).
    # Up to 0.5 the draw is the same number as [0, 2c]'s, so such runs' examples are unchanged.
    half_width = min(d.corruption, 1 - d.corruption)
    share = d.corruption - half_width + rng.random() * 2 * half_width
    suffix = int(np.clip(round(share * n), 1, n - 1))
    tokens = np.concatenate([np.array(mode, dtype=document.dtype), document[:n]])
    prefix = np.arange(len(document)) < len(document) - suffix
    return Example(tokens, prefix, ~prefix)


def _segments(total: int, parts: int, rng: np.random.Generator) -> np.ndarray:
    """`total` split at random into `parts` positive lengths."""
    cuts = np.sort(rng.choice(total - 1, parts - 1, replace=False)) + 1
    return np.diff(np.concatenate([[0], cuts, [total]]))
