"""wildtrain's transformer in Hugging Face Transformers' terms: the config of the Transformers
architecture that computes what it computes, and its weights under that architecture's names.

The model (`transformer`) is Llama's computation, up to three differences that the weights
absorb exactly:

- rotary embeddings rotate consecutive pairs of a head's dimensions (2i, 2i+1); Llama's
  rotate the two halves (i, i + head_dim/2). Permuting the rows of wq and wk per head to
  that order gives the same dot products between queries and keys, so the same attention.
- muP's logit multiplier (`Scaling.output_mult`) scales the logits: the output head's
  weight times it is the same map.
- The residual multiplier (`Scaling.residual_mult`) scales what each residual branch adds:
  it folds into the branch's last projection (wo, w2), which the branch's output is linear in.
- muP's attention scale (`Scaling.attention_scale`, for a model with a base) replaces
  1/sqrt(head_dim): wq's rows times attention_scale * sqrt(head_dim) give Llama's
  1/sqrt(head_dim) the same logits, rotary embeddings being linear in the query.

Attention: `causal` is Llama's; `document` is causal within each document, and a sequence
given to Transformers is one document, so it is Llama's too; a sliding window
(`model.attention_window`) is Mistral's `sliding_window` (a query sees the `window` latest
positions, itself included, as here). `prefix_lm` has no Transformers decoder: its inputs
attend to each other bidirectionally, which a causal model would not do, so it is refused.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Mapping

import torch

from wildtrain.config import ModelConfig
from wildtrain.model.transformer import ffn_hidden_dim, scaling


class NotExpressible(ValueError):
    """A wildtrain model that no Transformers architecture computes the same; one line, naming the key."""


@dataclass(frozen=True)
class HFArchitecture:
    model_type: str  # Transformers' AutoConfig key: "llama" or "mistral"
    config: dict  # the keyword arguments of that model type's config class

    @property
    def name(self) -> str:
        return self.config["architectures"][0]


def hf_architecture(model: ModelConfig, eos_id: int) -> HFArchitecture:
    """The Transformers config that computes what `model` computes on one document, or
    `NotExpressible`. `eos_id`: the tokenizer's end-of-document id, where generation stops."""
    if model.attention == "prefix_lm":
        raise NotExpressible(
            "model.attention=prefix_lm: Transformers has no decoder whose inputs attend to each other "
            "bidirectionally; exported as a causal model it would compute differently, so it is not exported"
        )
    config = dict(
        vocab_size=model.vocab_size,
        hidden_size=model.dim,
        intermediate_size=ffn_hidden_dim(model),
        num_hidden_layers=model.n_layers,
        num_attention_heads=model.n_heads,
        num_key_value_heads=model.n_kv_heads or model.n_heads,
        head_dim=model.dim // model.n_heads,
        hidden_act="silu",
        max_position_embeddings=model.max_seq_len,
        rms_norm_eps=model.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": float(model.rope_theta)},
        tie_word_embeddings=False,
        # Llama's defaults (1 and 2) are ids of another vocabulary: generation would stop at them.
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=None,
        dtype="float32",
    )
    if model.attention_window is None:
        return HFArchitecture(
            "llama", config | {"architectures": ["LlamaForCausalLM"], "attention_bias": False, "mlp_bias": False}
        )
    return HFArchitecture(
        "mistral", config | {"architectures": ["MistralForCausalLM"], "sliding_window": model.attention_window}
    )


# wildtrain's parameter names -> Transformers' (Llama's and Mistral's are the same).
_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


def hf_name(name: str) -> str:
    if name in _NAMES:
        return _NAMES[name]
    match = _LAYER.match(name)
    return f"model.layers.{match[1]}.{_LAYER_NAMES[match[2]]}"


def rotate_halves(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """The rows of a query or key projection reordered per head from wildtrain's rotary
    pairs (2i, 2i+1) to Llama's halves (i, i + head_dim/2)."""
    out, dim = weight.shape
    return weight.view(heads, out // heads // 2, 2, dim).transpose(1, 2).reshape(out, dim)


def hf_state_dict(model: ModelConfig, weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`weights` (a `Transformer(model)`'s state dict) under Transformers' names, with the
    rotary order and the muP multipliers folded in (see the module docstring). Every
    parameter of the model must be there, and nothing else."""
    expected = {f"layers.{i}.{leaf}" for i in range(model.n_layers) for leaf in _LAYER_NAMES} | set(_NAMES)
    missing, unknown = sorted(expected - weights.keys()), sorted(weights.keys() - expected)
    if missing or unknown:
        raise ValueError(
            f"the checkpoint's weights do not fit model {model.name!r}: "
            f"missing {missing[:5] or 'none'}, unexpected {unknown[:5] or 'none'}"
        )
    kv_heads = model.n_kv_heads or model.n_heads
    scaled = scaling(model)
    converted = {}
    for name, weight in weights.items():
        if name.endswith("attention.wq.weight"):
            weight = rotate_halves(weight, model.n_heads)
            if scaled.attention_scale is not None:
                weight = weight * (scaled.attention_scale * math.sqrt(model.dim // model.n_heads))
        elif name.endswith("attention.wk.weight"):
            weight = rotate_halves(weight, kv_heads)
        elif name.endswith(("attention.wo.weight", "feed_forward.w2.weight")) and scaled.residual_mult != 1.0:
            weight = weight * scaled.residual_mult
        elif name == "output.weight" and scaled.output_mult != 1.0:
            weight = weight * scaled.output_mult
        converted[hf_name(name)] = weight.contiguous()
    return converted
