"""Attention masks, each defined once as a FlexAttention `mask_mod` (b, h, q_idx, kv_idx) ->
bool, composed with `and_masks`/`or_masks`, and turned into what the device runs fast:

- causal alone: no mask at all; SDPA's `is_causal` keeps the flash kernel.
- anything else on CUDA: a FlexAttention `BlockMask`, built once per batch and shared by
  every layer (its build is part of the step, where it is timed).
- anything else elsewhere: a dense boolean [B, 1, T, T] mask for SDPA, evaluated from the
  same `mask_mod` by broadcasting. That path exists for tests and the CPU demo, not speed.

The per-row inputs are `doc_ids` [B, T] (the document of every position) and `prefix`
[B, T] (true on positions that attend bidirectionally within their document: a prefix-LM's
inputs).
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch
from torch.nn.attention.flex_attention import BlockMask, and_masks, create_block_mask, or_masks

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
KINDS = ("causal", "document", "prefix_lm")
Mask = Union[None, torch.Tensor, BlockMask]


def causal(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx


def document(doc_ids: torch.Tensor) -> MaskMod:
    """No attention across document boundaries within a packed row."""

    def same_document(b, h, q_idx, kv_idx):
        return doc_ids[b, q_idx] == doc_ids[b, kv_idx]

    return same_document


def bidirectional(prefix: torch.Tensor) -> MaskMod:
    """Prefix positions see each other (within the row: `and` it with `document`)."""

    def both_in_prefix(b, h, q_idx, kv_idx):
        return prefix[b, q_idx] & prefix[b, kv_idx]

    return both_in_prefix


def sliding_window(window: int) -> MaskMod:
    """Only the `window` latest positions, itself included."""

    def recent(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < window

    return recent


def mask_mod(
    kind: str,
    doc_ids: Optional[torch.Tensor] = None,
    prefix: Optional[torch.Tensor] = None,
    window: Optional[int] = None,
) -> MaskMod:
    """The composed mask of `model.attention` (and `model.attention_window`). Prefix-LM is
    per document: a document's inputs attend to each other, its targets to its inputs and
    its earlier targets."""
    if kind == "causal":
        mod = causal
    elif kind == "document":
        mod = and_masks(causal, document(doc_ids))
    elif kind == "prefix_lm":
        mod = and_masks(document(doc_ids), or_masks(causal, bidirectional(prefix)))
    else:
        raise ValueError(f"unknown attention mask {kind!r} (one of {', '.join(KINDS)})")
    return mod if window is None else and_masks(mod, sliding_window(window))


def dense(mod: MaskMod, batch: int, length: int, device: torch.device) -> torch.Tensor:
    """`mod` evaluated at every (b, q, kv): a [B, 1, T, T] boolean mask for SDPA."""
    b = torch.arange(batch, device=device)[:, None, None]
    q = torch.arange(length, device=device)[None, :, None]
    kv = torch.arange(length, device=device)[None, None, :]
    h = torch.zeros((), dtype=torch.long, device=device)
    return mod(b, h, q, kv).expand(batch, length, length)[:, None]


# Outside the compiled model's graph: built inside it (torch 2.11, H200), the block mask's
# kernels gave a document-masked forward far off its dense path and a prefix-LM one a CUDA
# error that poisoned the process (docs/benchmarks.md, GPU checks); built eagerly, as
# tests/gpu/test_attention_cuda.py's FlexAttention-against-SDPA check builds it, both agreed.
@torch.compiler.disable
def build(
    kind: str,
    window: Optional[int],
    doc_ids: Optional[torch.Tensor],
    prefix: Optional[torch.Tensor],
    batch: int,
    length: int,
    device: torch.device,
) -> Mask:
    """What `Attention` runs for one batch: None (plain causal, SDPA's flash path), a
    FlexAttention block mask on CUDA, or a dense boolean mask elsewhere."""
    if kind == "causal" and window is None:
        return None
    if kind != "causal" and doc_ids is None:
        raise ValueError(f"model.attention={kind} needs the batch's doc_ids")
    if kind == "prefix_lm" and prefix is None:
        raise ValueError("model.attention=prefix_lm needs the batch's prefix positions")
    mod = mask_mod(kind, doc_ids, prefix, window)
    if device.type == "cuda":
        return create_block_mask(mod, batch, None, length, length, device=device)
    return dense(mod, batch, length, device)
