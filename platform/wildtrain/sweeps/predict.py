"""`wildtrain fit SWEEP --to ...`: the loss-vs-compute law (`fit`) through the sweep's
finished trials, from MLflow, and the loss it predicts for the promoted run."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from wildtrain.config import load_config
from wildtrain.model import param_count
from wildtrain.sweeps import compare
from wildtrain.sweeps.execute import trial_args
from wildtrain.sweeps.fit import Fitted, fit_law
from wildtrain.sweeps.promote import promoted_args
from wildtrain.sweeps.report import fetch_sweep


@dataclass(frozen=True)
class Prediction:
    fitted: Fitted
    params: int  # of the promoted run's model
    tokens: int  # it trains on
    loss: float
    interval: tuple[float, float]

    def text(self) -> str:
        law = self.fitted.law
        return (f"L(N, D) = {law.E:.3f} + {law.A:.4g} / N^{law.alpha:.3f} + {law.B:.4g} / D^{law.beta:.3f}\n"
                f"  alpha {law.alpha:.3f} (90% {self.fitted.alpha_interval[0]:.3f}..{self.fitted.alpha_interval[1]:.3f}), "
                f"beta {law.beta:.3f} (90% {self.fitted.beta_interval[0]:.3f}..{self.fitted.beta_interval[1]:.3f})\n"
                f"predicted loss at N={self.params:.4g} parameters, D={self.tokens:.4g} tokens: {self.loss:.4f} "
                f"(90% {self.interval[0]:.4f}..{self.interval[1]:.4f})\n")


def predict_promoted(uri: str, sweep: str, to: Sequence[str], overrides: Sequence[str] = (),
                     conf_dir: Optional[Path] = None) -> Prediction:
    """Fit the sweep's finished trials (parameters from their configs, tokens and final loss
    from MLflow: the validation loss where every trial has one, as they are ranked) and
    predict the run `promote` would write with `to`."""
    parent, _, trials = fetch_sweep(uri, sweep)
    ranked = [r for r in compare.rank(trials) if r.place is not None]
    args = {r.trial.name: trial_args(parent, r.trial) for r in ranked}
    params = [param_count(load_config(args[r.trial.name], conf_dir).model) for r in ranked]
    fitted = fit_law(params, [r.trial.tokens[-1] for r in ranked], [r.score for r in ranked])
    target = load_config(promoted_args(args[ranked[0].trial.name], to, overrides, conf_dir), conf_dir)
    n = param_count(target.model)
    d = target.train.steps * target.train.global_batch_size * target.data.seq_len
    return Prediction(fitted, n, d, fitted.law.predict(n, d), fitted.predict_interval(n, d))
