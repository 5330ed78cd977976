"""The objectives' examples: their layout, their statistics against the config, and that
they are a pure function of (seed, step, sample id, row), whatever rank builds them."""

from __future__ import annotations

from collections import Counter
from typing import Optional

import numpy as np
import pytest

from wildtrain.config import ConfigError, load_config
from wildtrain.data.manifest import DataError
from wildtrain.data.objectives import FIELDS, Objective
from wildtrain.data.tokenizer import ByteTokenizer

BYTE = ByteTokenizer()
SENTINELS = set(BYTE.sentinels)
F = {name: i for i, name in enumerate(FIELDS)}


def objective(*overrides: str, tokenizer: Optional[dict] = None) -> Objective:
    cfg = load_config(list(overrides))
    return Objective.of(cfg.objective, cfg.train, cfg.model, tokenizer or BYTE.describe())


def packed(rows: int, seq_len: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 256, (rows, seq_len + 1)).astype(np.int32)
    doc_ids = np.sort(rng.integers(0, 4, (rows, seq_len + 1)), axis=1).astype(np.int32)
    return tokens, doc_ids


@pytest.mark.parametrize("kind", ["causal", "prefix_lm", "ul2"])
def test_examples_depend_on_seed_step_and_sample_only_never_on_the_rank(kind):
    ul2 = objective(f"train.objective={kind}", "model.attention=document")
    tokens, doc_ids = packed(8, 128)
    ids = np.arange(100, 108)
    whole = ul2.rows(3, ids, tokens, doc_ids)
    # Any split of the step's rows over ranks builds the same examples.
    halves = [ul2.rows(3, ids[s], tokens[s], doc_ids[s]) for s in (slice(0, 4), slice(4, 8))]
    assert np.array_equal(np.concatenate(halves), whole)
    assert np.array_equal(ul2.rows(3, ids, tokens, doc_ids), whole)
    assert whole.shape == (8, len(FIELDS), 128) and whole.dtype == np.int32
    if kind != "causal":
        assert not np.array_equal(ul2.rows(4, ids, tokens, doc_ids), whole), "another step corrupts anew"
        assert not np.array_equal(
            objective(f"train.objective={kind}", "model.attention=document", "train.seed=1").rows(
                3, ids, tokens, doc_ids
            ),
            whole,
        )


def test_plain_causal_keeps_the_token_rows():
    tokens, doc_ids = packed(2, 16)
    assert objective().rows(0, np.arange(2), tokens, doc_ids) is tokens


def test_ul2_rows_keep_documents_in_place_with_positions_restarting_and_loss_on_targets():
    ul2 = objective("train.objective=ul2", "model.attention=prefix_lm")
    tokens, doc_ids = packed(16, 256, seed=1)
    rows = ul2.rows(0, np.arange(16), tokens, doc_ids)
    assert np.array_equal(rows[:, F["doc_ids"]], doc_ids[:, :-1])
    assert np.array_equal(rows[:, F["tokens"], 1:], rows[:, F["targets"], :-1]), "targets are the next tokens"
    for row, docs in zip(rows, doc_ids[:, :-1]):
        starts = np.flatnonzero(np.diff(docs, prepend=-1))
        assert (row[F["positions"], starts] == 0).all() and (
            np.diff(row[F["positions"]])[np.diff(docs) == 0] == 1
        ).all()
        assert set(row[F["tokens"], starts]) <= set(BYTE.modes.values()), "every example starts with its mode token"
        loss = row[F["loss_mask"]].astype(bool)
        assert loss.any()
        # A loss position predicts a target: the token after it is not an input.
        assert not (loss[:-1] & (row[F["prefix"], 1:] == 1)).any()


def measure(denoiser_index: int, examples: int = 2_500):
    """(corruption, mean span) of one denoiser of the ul2 preset over `examples` documents
    of 512-2048 tokens: from the examples themselves, told apart by their sentinels. At
    2,000 documents, four seeds each put every span denoiser within 0.4% of its rate and span
    and the prefix denoiser's rate within 2.1%: the 5% tolerance is wide of the noise."""
    ul2 = objective("train.objective=ul2")
    d = ul2.denoisers[denoiser_index]
    only = Objective(ul2.kind, (d,), ul2.sentinels, ul2.eos_id, 0, False)
    rng = np.random.default_rng(denoiser_index)
    source = corrupted = spans = 0
    for _ in range(examples):
        document = rng.integers(0, 256, rng.integers(512, 2049)).astype(np.int32)
        e = only.example(document, rng)
        targets = e.tokens[e.target]
        sentinels = int(np.isin(targets, list(SENTINELS)).sum())
        corrupted += len(targets) - sentinels
        spans += sentinels
        source += int(e.prefix.sum()) - 1 - sentinels + len(targets) - sentinels  # less the mode token
    return d, corrupted / source, (corrupted / spans if spans else None)


@pytest.mark.parametrize("index", range(7))
def test_each_denoiser_corrupts_at_its_configured_rate_and_span(index):
    d, rate, mean_span = measure(index)
    assert rate == pytest.approx(d.corruption, rel=0.05), d
    if d.kind == "span":
        assert mean_span == pytest.approx(d.mean_span, rel=0.05), d


def mean_target_share(obj: Objective, documents: int = 4000, length: int = 1001) -> float:
    """The mean share of a document's tokens (less the mode token) that are targets."""
    rng = np.random.default_rng(0)
    shares = []
    for _ in range(documents):
        e = obj.example(rng.integers(0, 256, length).astype(np.int32), rng)
        shares.append(e.target.sum() / (length - (obj.denoisers[0].mode is not None)))
    return float(np.mean(shares))


@pytest.mark.parametrize("target", [0.1, 0.25, 0.5, 0.75, 0.9])
def test_prefix_lm_and_the_s_denoiser_hit_their_mean_target_share(target):
    prefix_lm = objective("train.objective=prefix_lm", f"objective.prefix_target={target}")
    s = objective(
        "train.objective=ul2", f"objective.denoisers=[{{name: S, kind: prefix, corruption: {target}, mode: '[S2S]'}}]"
    )
    # 4000 draws: the mean's standard error is at most 1 / sqrt(12 * 4000) < 0.005 (a uniform
    # share on an interval of width <= 1), so 0.02 is four of them; today's [0, 2c] clipped
    # at 1 gives 2/3 for 0.75 and 0.72 for 0.9.
    for obj in (prefix_lm, s):
        assert mean_target_share(obj) == pytest.approx(target, abs=0.02), obj.kind


def test_the_mixture_draws_denoisers_at_their_weights():
    ul2 = objective("train.objective=ul2")
    rng = np.random.default_rng(0)
    drawn = Counter(int(ul2.example(rng.integers(0, 256, 64).astype(np.int32), rng).tokens[0]) for _ in range(10_000))
    weights = Counter()
    for d in ul2.denoisers:
        weights[d.mode] += d.weight
    total = sum(weights.values())
    for mode, weight in weights.items():
        assert abs(drawn[mode] / 10_000 - weight / total) < 0.02, (mode, drawn)


def test_ul2r_preset_and_bad_objectives_name_their_key():
    cfg = load_config(["train.objective=ul2", "objective=ul2r"])
    assert [d.name for d in cfg.objective.denoisers] == ["R", "X", "S"]
    with pytest.raises(ConfigError, match=r"^train.objective: expected one of causal, prefix_lm, ul2, got 'mlm'"):
        load_config(["train.objective=mlm"])
    with pytest.raises(ConfigError, match=r"^model.attention: prefix_lm needs train.objective"):
        load_config(["model.attention=prefix_lm"])
    with pytest.raises(ConfigError, match=r"^objective.denoisers.0.corruption: must be between 0 and 1"):
        load_config(["train.objective=ul2", "objective.denoisers=[{corruption: 1.5}]"])


def test_a_dataset_without_reserved_ids_is_refused_for_ul2_only():
    old = {"kind": "byte", "vocab_size": 257, "eos_id": 256}
    objective(tokenizer=old)  # causal needs nothing reserved
    with pytest.raises(DataError, match=r"^objective.denoisers.0.mode: \[NLU\] is not a reserved token"):
        objective("train.objective=ul2", tokenizer=old)
    with pytest.raises(DataError, match=r"^train.objective: ul2's span denoisers need sentinel ids"):
        objective("train.objective=ul2", "objective.denoisers=[{mode: null}]", tokenizer=old)
