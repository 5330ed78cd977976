"""FlexAttention with the block masks and SDPA with the dense masks of the same mask_mods
agree on CUDA within bf16 tolerance, forward and backward, and the model's CUDA path (a
BlockMask built in its forward) matches its dense path."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from wildtrain.config import load_config
from wildtrain.model import Transformer, masks

pytestmark = pytest.mark.gpu

B, H, T, D = 2, 4, 512, 64


def batch():
    rng = np.random.default_rng(0)
    doc_ids = np.sort(rng.integers(0, 6, (B, T)), axis=1)
    prefix = np.concatenate([np.arange(n) < n // 2 for row in doc_ids for n in np.unique(row, return_counts=True)[1]])
    return (torch.from_numpy(doc_ids).cuda(), torch.from_numpy(prefix.reshape(B, T)).cuda())


@pytest.mark.parametrize("kind", ["document", "prefix_lm"])
def test_flex_and_sdpa_agree_in_bf16(kind):
    doc_ids, prefix = batch()
    mod = masks.mask_mod(kind, doc_ids, prefix)
    q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad = torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16)
    flex = masks.build(kind, None, doc_ids, prefix, B, T, torch.device("cuda"))
    out = torch.compile(torch.nn.attention.flex_attention.flex_attention)(q, k, v, block_mask=flex)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=masks.dense(mod, B, T, torch.device("cuda")))
    eq, ek, ev = torch.autograd.grad(expected, (q, k, v), grad)
    for got, want in ((out, expected), (dq, eq), (dk, ek), (dv, ev)):
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


def test_the_models_flex_path_matches_its_dense_path():
    cfg = replace(load_config(["train.objective=prefix_lm", "model.attention=prefix_lm"]).model, max_seq_len=T)
    torch.manual_seed(0)
    model = Transformer(cfg).cuda()
    doc_ids, prefix = batch()
    tokens = torch.randint(0, 256, (B, T), device="cuda")
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        flex = model(tokens, doc_ids=doc_ids, prefix=prefix)
        model.cpu()
        dense = model(tokens.cpu(), doc_ids=doc_ids.cpu(), prefix=prefix.cpu())
    torch.testing.assert_close(flex.float().cpu(), dense.float(), atol=5e-2, rtol=5e-2)
