"""The model: a Llama-style decoder and its analytic size and cost."""

from wildtrain.model.flops import flops_per_token, param_count
from wildtrain.model.transformer import Transformer

__all__ = ["Transformer", "flops_per_token", "param_count"]
