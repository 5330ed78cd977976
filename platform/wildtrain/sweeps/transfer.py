"""How the winner of small trials scales to the big run: muP for width and depth-muP for
depth, for Adam. Pure.

The trial's multipliers (init std, learning rate, logit and residual multipliers) are what
was tuned; the big run keeps them and records the trial's shape as its base model
(`model.base_*`), against which the model scales each matrix by its own fan-in, the logits,
the residual branches and attention's scale (`wildtrain.model.transformer.scaling`, with the
rules). A trial that was itself transferred passes its own base on, so the rule composes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from wildtrain.config import ModelConfig
from wildtrain.model.transformer import Scaling, ffn_hidden_dim, scaling


@dataclass(frozen=True)
class Transfer:
    hidden_lr_mult: float  # optim.hidden_lr_mult of the trial, at its base
    hidden_init_std: float  # the trial's hidden init std, at its base
    output_mult: float
    residual_mult: float
    base_dim: int
    base_ffn_dim: int
    base_head_dim: int
    base_n_layers: int
    scaled: Scaling  # what the target's model makes of them

    def overrides(self) -> dict[str, float | int]:
        return {
            "optim.hidden_lr_mult": self.hidden_lr_mult,
            "model.hidden_init_std": self.hidden_init_std,
            "model.output_mult": self.output_mult,
            "model.residual_mult": self.residual_mult,
            "model.base_dim": self.base_dim,
            "model.base_ffn_dim": self.base_ffn_dim,
            "model.base_head_dim": self.base_head_dim,
            "model.base_n_layers": self.base_n_layers,
        }


def transfer(trial: ModelConfig, trial_hidden_lr_mult: float, target: ModelConfig) -> Transfer:
    """The settings that make `target` train like `trial` did (same optim.lr, init_std)."""
    if trial.base_dim is None:
        base = dict(
            base_dim=trial.dim,
            base_ffn_dim=ffn_hidden_dim(trial),
            base_head_dim=trial.dim // trial.n_heads,
            base_n_layers=trial.n_layers,
        )
    else:
        base = dict(
            base_dim=trial.base_dim,
            base_ffn_dim=trial.base_ffn_dim,
            base_head_dim=trial.base_head_dim,
            base_n_layers=trial.base_n_layers,
        )
    hidden_std = trial.hidden_init_std if trial.hidden_init_std is not None else trial.init_std
    kept = dict(hidden_init_std=hidden_std, output_mult=trial.output_mult, residual_mult=trial.residual_mult)
    return Transfer(
        hidden_lr_mult=trial_hidden_lr_mult, **kept, **base, scaled=scaling(replace(target, **kept, **base))
    )
