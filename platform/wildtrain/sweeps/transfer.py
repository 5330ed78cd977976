"""How the winner of small trials scales to the big run: the muP width rule and the
depth-muP depth rule, for Adam. Pure.

Width (Yang et al. 2022, "Tensor Programs V", Table 3; Cerebras' "The Practitioner's Guide
to the Maximal Update Parameterization", Table 1), with the width multiplier m_d = d / d_base:
embeddings keep their init and learning rate; the blocks' matrices get init std
sigma / sqrt(m_d) and learning rate eta / m_d; the output logits are multiplied by 1 / m_d.
Depth (Yang et al. 2023, "Tensor Programs VI: Feature Learning in Infinite-Depth Neural
Networks", Adam), with m_L = L / L_base: each residual branch is multiplied by 1 / sqrt(m_L)
and the blocks' learning rate by 1 / sqrt(m_L).

The rule composes: it scales from the trial's own shape and multipliers, so a trial that
was itself transferred from a smaller base scales on from where it stands, and the base
recorded is the first one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from wildtrain.config import ModelConfig


@dataclass(frozen=True)
class Transfer:
    width_mult: float  # target dim / trial dim
    depth_mult: float  # target n_layers / trial n_layers
    hidden_lr_mult: float  # optim.hidden_lr_mult of the target
    hidden_init_std: float  # model.hidden_init_std of the target
    output_mult: float  # model.output_mult of the target
    residual_mult: float  # model.residual_mult of the target
    base_dim: int
    base_n_layers: int

    def overrides(self) -> dict[str, float | int]:
        return {
            "optim.hidden_lr_mult": self.hidden_lr_mult, "model.hidden_init_std": self.hidden_init_std,
            "model.output_mult": self.output_mult, "model.residual_mult": self.residual_mult,
            "model.base_dim": self.base_dim, "model.base_n_layers": self.base_n_layers,
        }


def transfer(trial: ModelConfig, trial_hidden_lr_mult: float, target: ModelConfig) -> Transfer:
    """The multipliers that make `target` train like `trial` did (same optim.lr, init_std)."""
    width = target.dim / trial.dim
    depth = target.n_layers / trial.n_layers
    hidden_std = trial.hidden_init_std if trial.hidden_init_std is not None else trial.init_std
    return Transfer(
        width_mult=width,
        depth_mult=depth,
        hidden_lr_mult=trial_hidden_lr_mult / width / math.sqrt(depth),
        hidden_init_std=hidden_std / math.sqrt(width),
        output_mult=trial.output_mult / width,
        residual_mult=trial.residual_mult / math.sqrt(depth),
        base_dim=trial.base_dim or trial.dim,
        base_n_layers=trial.base_n_layers or trial.n_layers,
    )
