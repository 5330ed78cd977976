"""Models for tests that compare computations."""

from __future__ import annotations

import torch

from wildtrain.config import Config, ModelConfig
from wildtrain.engine import EngineSettings
from wildtrain.model import Transformer


def random_model(cfg: ModelConfig, seed: int = 0) -> Transformer:
    """A model whose every weight is random, norms included: a weight mapped to the wrong
    place, or not scaled, changes the logits."""
    torch.manual_seed(seed)
    model = Transformer(cfg)
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 1:
                param.copy_(1 + 0.2 * torch.randn_like(param))
            else:
                param.normal_(0, 0.1)
    return model.eval()


def engine_settings(cfg: Config) -> EngineSettings:
    """What `cfg` builds an engine from, as the worker composes it."""
    return EngineSettings(cfg.model, cfg.optim, cfg.deepspeed, cfg.train.steps, cfg.elastic.collective_timeout_s)
