"""Model size and training cost, computed from the config alone.

Both work for shapes too large to instantiate (the 7B and 21B presets), which is why
they are written out from the layer shapes rather than read off a module.
"""

from __future__ import annotations

from wildtrain.config import ModelConfig
from wildtrain.model.transformer import ffn_hidden_dim


def _matmul_params(cfg: ModelConfig) -> int:
    head_dim = cfg.dim // cfg.n_heads
    kv_dim = (cfg.n_kv_heads or cfg.n_heads) * head_dim
    attention = 2 * cfg.dim * cfg.dim + 2 * cfg.dim * kv_dim  # wq, wo; wk, wv
    mlp = 3 * cfg.dim * ffn_hidden_dim(cfg)  # w1, w3, w2
    return cfg.n_layers * (attention + mlp) + cfg.dim * cfg.vocab_size  # + output head


def param_count(cfg: ModelConfig) -> int:
    """Exactly `Transformer(cfg).num_params()`."""
    norms = (2 * cfg.n_layers + 1) * cfg.dim
    return _matmul_params(cfg) + cfg.vocab_size * cfg.dim + norms  # + input embedding


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs (forward + backward) per token at sequence length `seq_len`.

    6 * N + 12 * n_layers * dim * seq_len, the convention of PaLM (Chowdhery et al. 2022,
    appendix B), so MFU figures compare with published ones:

    - N counts the parameters that take part in a matmul: every linear weight, the output
      head included. The input embedding is a table lookup and norm weights are
      elementwise, so neither costs matmul FLOPs. Each such weight costs 2 FLOPs per token
      forward (multiply + add) and 4 backward (gradients of input and of weight).
    - Attention scores (QK^T) and the weighted sum of values are matmuls with no weights:
      per layer and token, seq_len * dim multiply-adds each forward, 4 * seq_len * dim
      FLOPs together, tripled by backward. The causal mask skips about half of that work,
      but the convention counts it in full, as the published MFU numbers do.
    """
    return 6.0 * _matmul_params(cfg) + 12.0 * cfg.n_layers * cfg.dim * seq_len
