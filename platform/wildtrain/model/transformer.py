"""A Llama-style decoder-only transformer in plain PyTorch.

Pre-norm blocks of RMSNorm -> masked self-attention (`model.attention`: causal, per
document or prefix-LM, see `masks`; rotary positions, optional grouped-query attention) and RMSNorm -> SwiGLU MLP; a
final RMSNorm and an untied
output head; no biases.

Parametrized by muP against a base (proxy) model when `model.base_*` give its shape
(`scaling`): Yang et al. 2022, "Tensor Programs V", Table 8 for Adam, and depth-muP (Yang
et al. 2023, "Tensor Programs VI"). Each block matrix's init variance and Adam learning rate
scale by base fan-in / its own fan-in (dim for wq, wk, wv, wo, w1, w3; ffn_dim for w2, which
grows faster than dim between the presets); the embedding and output head keep theirs (their
fan-in or fan-out is the vocabulary) and the logits are multiplied by base_dim / dim;
attention's logits are q.k / head_dim (muP's 1/d), written sqrt(base_head_dim) / head_dim so
that the base model keeps its 1/sqrt(head_dim); with m_L = n_layers / base_n_layers, residual
branches and the blocks' learning rates are multiplied by 1/sqrt(m_L). The config's own
multipliers are the base model's and are multiplied by these. Without a base, all are 1.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from torch.utils.checkpoint import checkpoint

from wildtrain.config import ModelConfig
from wildtrain.model import masks


def ffn_hidden_dim(cfg: ModelConfig) -> int:
    if cfg.ffn_dim is not None:
        return cfg.ffn_dim
    # 8/3 * dim keeps the three SwiGLU matrices at the parameter count of a 4 * dim GELU MLP.
    hidden = int(8 * cfg.dim / 3)
    return cfg.multiple_of * math.ceil(hidden / cfg.multiple_of)


# The blocks' matrices, by their names in a block.
HIDDEN = (
    "attention.wq",
    "attention.wk",
    "attention.wv",
    "attention.wo",
    "feed_forward.w1",
    "feed_forward.w3",
    "feed_forward.w2",
)


def fan_ins(dim: int, ffn_dim: int) -> dict[str, int]:
    """Each block matrix's fan-in: the width, but for the MLP's down-projection, ffn_dim (wo's,
    n_heads * head_dim, is the width: the heads divide it)."""
    return {name: ffn_dim if name == "feed_forward.w2" else dim for name in HIDDEN}


@dataclass(frozen=True)
class Scaling:
    """What muP and depth-muP make of a model against its base (see the module docstring)."""

    fan_in_ratio: dict[str, float]  # each block matrix: the base's fan-in / its own
    depth_ratio: float  # base_n_layers / n_layers
    output_mult: float  # of the logits
    residual_mult: float  # of each residual branch
    attention_scale: Optional[float]  # of q.k; None: SDPA's 1/sqrt(head_dim)

    def init_std(self, matrix: str, std: float) -> float:
        """Of a block matrix whose base model's init std is `std`."""
        return std * math.sqrt(self.fan_in_ratio[matrix])

    def lr_mult(self, matrix: str, hidden_lr_mult: float) -> float:
        """Of a block matrix's learning rate, whose base model's is lr * `hidden_lr_mult`."""
        return hidden_lr_mult * self.fan_in_ratio[matrix] * math.sqrt(self.depth_ratio)


def scaling(cfg: ModelConfig) -> Scaling:
    if cfg.base_dim is None:
        return Scaling(dict.fromkeys(HIDDEN, 1.0), 1.0, cfg.output_mult, cfg.residual_mult, None)
    base, own = fan_ins(cfg.base_dim, cfg.base_ffn_dim), fan_ins(cfg.dim, ffn_hidden_dim(cfg))
    depth_ratio = cfg.base_n_layers / cfg.n_layers
    return Scaling(
        fan_in_ratio={name: base[name] / own[name] for name in HIDDEN},
        depth_ratio=depth_ratio,
        output_mult=cfg.output_mult * cfg.base_dim / cfg.dim,
        residual_mult=cfg.residual_mult * math.sqrt(depth_ratio),
        attention_scale=math.sqrt(cfg.base_head_dim) / (cfg.dim // cfg.n_heads),
    )


def rope_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    # Integer ranges, made fp32 afterwards: DeepSpeed's zero.Init makes every floating
    # tensor a constructor returns bf16, and bf16 positions above 256 are not integers.
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(max_seq_len).float(), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs of `x` [B, T, heads, head_dim] by the angles of each
    position, `cos`/`sin` [B or 1, T, head_dim/2]."""
    # Rotating in fp32 keeps the positional signal exact when activations are bf16.
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    rotated = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    return rotated.type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalising in fp32: the mean of squares overflows or loses precision in half types.
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, scale: Optional[float]):
        super().__init__()
        self.scale = scale
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads or cfg.n_heads
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: masks.Mask) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        gqa = self.n_kv_heads != self.n_heads
        if isinstance(mask, BlockMask):
            out = _compiled_flex_attention()(q, k, v, block_mask=mask, scale=self.scale, enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.scale, enable_gqa=gqa
            )
        return self.wo(out.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hidden = ffn_hidden_dim(cfg)
        self.w1 = nn.Linear(cfg.dim, hidden, bias=False)
        self.w3 = nn.Linear(cfg.dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, scaled: Scaling):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg, scaled.attention_scale)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = MLP(cfg)
        self.residual_mult = scaled.residual_mult

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: masks.Mask) -> torch.Tensor:
        x = x + self.residual_mult * self.attention(self.attention_norm(x), cos, sin, mask)
        return x + self.residual_mult * self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.scaling = scaling(cfg)
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, self.scaling) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        # Derived from the config, so kept out of checkpoints.
        cos, sin = rope_tables(cfg.dim // cfg.n_heads, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        for param, init in self.initializers():
            init(param)

    def initializers(self) -> Iterator[tuple[nn.Parameter, Callable[[torch.Tensor], None]]]:
        """Each parameter the init scheme sets, with how, in the order that draws the random
        numbers. A model built partitioned (DeepSpeed's zero.Init) has only shards by the
        time its __init__ runs, so its builder gathers each parameter and applies these."""
        cfg = self.cfg
        hidden = {id(w): name for name, w in self.hidden_matrices()}
        hidden_std = cfg.hidden_init_std if cfg.hidden_init_std is not None else cfg.init_std
        matmul = [m.weight for m in self.modules() if isinstance(m, (nn.Linear, nn.Embedding))]
        for weight in matmul:
            std = self.scaling.init_std(hidden[id(weight)], hidden_std) if id(weight) in hidden else cfg.init_std
            yield weight, lambda w, std=std: nn.init.normal_(w, std=std)
        # GPT-2 scheme: each block adds two projections to the residual stream, so scaling
        # them keeps the stream's variance from growing with depth. A model transferred from
        # a shallower base leaves depth to residual_mult (depth-muP) and keeps the base's.
        residual_std = hidden_std / math.sqrt(2 * (cfg.base_n_layers or cfg.n_layers))
        for block in self.layers:
            for name in ("attention.wo", "feed_forward.w2"):
                std = self.scaling.init_std(name, residual_std)
                yield block.get_parameter(f"{name}.weight"), lambda w, std=std: nn.init.normal_(w, std=std)

    def hidden_matrices(self) -> list[tuple[str, nn.Parameter]]:
        """The blocks' matrices, each with its name in a block (`HIDDEN`): what muP gives an
        init and learning rate scaled by its fan-in (the embedding, norms and output head
        keep theirs)."""
        return [
            (name.removesuffix(".weight"), p)
            for block in self.layers
            for name, p in block.named_parameters()
            if name.removesuffix(".weight") in HIDDEN
        ]

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(
        self,
        tokens: torch.Tensor,
        targets: Optional[torch.Tensor] = None,
        loss_mask: Optional[torch.Tensor] = None,
        doc_ids: Optional[torch.Tensor] = None,
        positions: Optional[torch.Tensor] = None,
        prefix: Optional[torch.Tensor] = None,
        attention: Optional[str] = None,
    ) -> torch.Tensor:
        """Logits [B, T, vocab], or the cross-entropy against `targets` when given.

        `doc_ids` and `prefix` [B, T] are what `model.attention` masks by (see `masks`), or
        `attention` when given (validation scores every model with document masks);
        `positions` [B, T] the rotary position of each token (0..T-1 when None; restarting
        at every document of a packed row is the data path's choice). With `loss_mask`
        [B, T] the loss is each row's mean over its masked-in positions, averaged over
        rows: micro-batches of equal size then weigh every row alike however a global
        batch is split, so the loss does not depend on the world size."""
        B, T = tokens.shape
        if T > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds model.max_seq_len ({self.cfg.max_seq_len})")
        if positions is None:
            cos, sin = self.rope_cos[None, :T], self.rope_sin[None, :T]
        else:
            cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        mask = masks.build(
            attention or self.cfg.attention,
            self.cfg.attention_window,
            doc_ids,
            None if prefix is None else prefix.bool(),
            B,
            T,
            tokens.device,
        )
        h = self.tok_embeddings(tokens)
        for block in self.layers:
            if self.cfg.activation_checkpointing and self.training:
                # Recomputes the block in backward instead of keeping its activations: about
                # a third more compute for memory that no longer grows with depth. The
                # non-reentrant form works with ZeRO-3's parameter hooks and torch.compile.
                h = checkpoint(block, h, cos, sin, mask, use_reentrant=False)
            else:
                h = block(h, cos, sin, mask)
        logits = self.output(self.norm(h))
        if self.scaling.output_mult != 1.0:
            logits = logits * self.scaling.output_mult
        if targets is None:
            return logits
        if loss_mask is None:
            return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        per_token = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none").view(B, T)
        weights = loss_mask.float()
        return ((per_token * weights).sum(1) / weights.sum(1).clamp(min=1)).mean()


@functools.cache
def _compiled_flex_attention():
    # Uncompiled, flex_attention runs a dense reference implementation: the fused kernel
    # exists only through torch.compile. Compiled once per process, on first use (CUDA).
    return torch.compile(flex_attention, dynamic=False)
