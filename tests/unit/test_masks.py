"""The attention masks against a reference written position by position, and the model
under them: a document-masked row is its documents run alone, a prefix-LM loss trains
only on targets."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from wildtrain.config import load_config
from wildtrain.data.objectives import FIELDS, Objective
from wildtrain.data.tokenizer import ByteTokenizer
from wildtrain.model import Transformer, masks

B, T = 3, 40
SMALL = replace(load_config([]).model, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)


def packed_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """doc_ids of a few documents per row, and a random prefix at the start of each."""
    rng = np.random.default_rng(seed)
    doc_ids = np.sort(rng.integers(0, 5, (B, T)), axis=1)
    prefix = np.zeros((B, T), bool)
    for b in range(B):
        for doc in np.unique(doc_ids[b]):
            where = np.flatnonzero(doc_ids[b] == doc)
            prefix[b, where[: rng.integers(0, len(where) + 1)]] = True
    return torch.from_numpy(doc_ids), torch.from_numpy(prefix)


def reference(kind: str, doc_ids, prefix, window=None) -> torch.Tensor:
    allowed = torch.zeros(B, 1, T, T, dtype=torch.bool)
    for b in range(B):
        for q in range(T):
            for kv in range(T):
                same_doc = bool(doc_ids[b, q] == doc_ids[b, kv])
                if kind == "causal":
                    ok = kv <= q
                elif kind == "document":
                    ok = same_doc and kv <= q
                else:  # inputs see their document's inputs; targets their inputs and earlier targets
                    ok = same_doc and (kv <= q or bool(prefix[b, q] and prefix[b, kv]))
                allowed[b, 0, q, kv] = ok and (window is None or q - kv < window)
    return allowed


@pytest.mark.parametrize("kind", masks.KINDS)
@pytest.mark.parametrize("window", [None, 5])
def test_every_mask_equals_the_reference_on_random_packed_batches(kind, window):
    for seed in range(3):
        doc_ids, prefix = packed_batch(seed)
        built = masks.dense(masks.mask_mod(kind, doc_ids, prefix, window), B, T, torch.device("cpu"))
        assert torch.equal(built, reference(kind, doc_ids, prefix, window))


def test_document_and_prefix_masks_never_cross_documents():
    doc_ids, prefix = packed_batch(7)
    for kind in ("document", "prefix_lm"):
        allowed = masks.dense(masks.mask_mod(kind, doc_ids, prefix), B, T, torch.device("cpu"))[:, 0]
        assert not (allowed & (doc_ids[:, :, None] != doc_ids[:, None, :])).any()
    allowed = masks.dense(masks.mask_mod("prefix_lm", doc_ids, prefix), B, T, torch.device("cpu"))[:, 0]
    same = doc_ids[:, :, None] == doc_ids[:, None, :]
    both_prefix = prefix[:, :, None] & prefix[:, None, :] & same
    assert allowed[both_prefix].all(), "prefix positions see each other, later ones included"
    later = torch.triu(torch.ones(T, T, dtype=torch.bool), 1)
    assert not allowed[~prefix[:, :, None].expand(-1, -1, T) & later].any(), "targets never see later positions"


def test_the_block_mask_attends_as_the_dense_mask():
    """The CUDA path's BlockMask from the same mask_mod, run by FlexAttention's reference
    implementation on CPU (tests/gpu compares the kernels)."""
    doc_ids, prefix = packed_batch(3)
    q, k, v = torch.randn(3, B, 2, T, 8).unbind(0)
    mod = masks.mask_mod("prefix_lm", doc_ids, prefix)
    block = create_block_mask(mod, B, None, T, T, device="cpu", BLOCK_SIZE=8)
    dense = masks.dense(mod, B, T, torch.device("cpu"))
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense)
    torch.testing.assert_close(flex_attention(q, k, v, block_mask=block), expected, atol=1e-5, rtol=1e-5)


def test_a_document_masked_row_computes_each_document_as_if_alone():
    torch.manual_seed(0)
    model = Transformer(replace(SMALL, attention="document")).eval()
    lengths = [7, 20, 13]
    tokens = torch.randint(0, 256, (1, sum(lengths)))
    doc_ids = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))[None]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        packed = model(tokens, doc_ids=doc_ids, positions=positions)
        alone = torch.cat([model(part, doc_ids=torch.zeros_like(part)) for part in tokens.split(lengths, dim=1)], 1)
        causal = Transformer(replace(SMALL, attention="causal")).eval()
        causal.load_state_dict(model.state_dict())
        crossing = causal(tokens)
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(crossing[:, 7:], alone[:, 7:], atol=1e-3), "without the mask documents would mix"


def test_targets_only_loss_gives_prefix_positions_exactly_zero_gradient():
    cfg = load_config(["train.objective=ul2", "model.attention=prefix_lm"])
    objective = Objective.of(cfg.objective, cfg.train, cfg.model, ByteTokenizer().describe())
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, (2, 61)).astype(np.int32)
    doc_ids = np.repeat(np.array([[0] * 25 + [1] * 36]), 2, axis=0).astype(np.int32)
    rows = torch.from_numpy(objective.rows(5, np.array([11, 12]), tokens, doc_ids)).long()
    fields = dict(zip(FIELDS, rows.unbind(1)))
    torch.manual_seed(0)
    model = Transformer(replace(SMALL, attention="prefix_lm"))
    logits = []

    def keep(module, args, out):
        out.retain_grad()
        logits.append(out)

    model.output.register_forward_hook(keep)
    model(**fields).backward()
    grad = logits[0].grad.abs().sum(-1)
    loss_on = fields["loss_mask"].bool()
    label_is_input = torch.cat([fields["prefix"][:, 1:], torch.zeros(2, 1, dtype=torch.long)], 1).bool()
    assert label_is_input.any() and not (loss_on & label_is_input).any(), "no loss predicts an input token"
    assert (grad[~loss_on] == 0).all(), "positions without loss get exactly zero gradient"
    assert (grad[loss_on] > 0).all()
