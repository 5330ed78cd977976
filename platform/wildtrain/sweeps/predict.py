"""`wildtrain fit SWEEP --to ...`: the loss-vs-compute law (`fit`) through the best of the
sweep's finished trials at each model size and token count, from MLflow, and the loss it
predicts for the promoted run."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Sequence

from wildtrain.config import load_config
from wildtrain.model import param_count
from wildtrain.sweeps import compare
from wildtrain.sweeps.execute import trial_args
from wildtrain.sweeps.fit import Fitted, fit_law
from wildtrain.sweeps.promote import promoted_args
from wildtrain.sweeps.report import fetch_sweep

# A trial without validation is fitted at the mean of this share of its last logged
# training losses (at least the last one).
FINAL_SHARE = 0.1


@dataclass(frozen=True)
class Prediction:
    fitted: Fitted
    params: int  # of the promoted run's model
    tokens: int  # it trains on
    loss: float
    interval: tuple[float, float]

    def text(self) -> str:
        law = self.fitted.law
        return (
            f"L(N, D) = {law.E:.3f} + {law.A:.4g} / N^{law.alpha:.3f} + {law.B:.4g} / D^{law.beta:.3f}\n"
            f"  alpha {law.alpha:.3f} (90% {self.fitted.alpha_interval[0]:.3f}..{self.fitted.alpha_interval[1]:.3f}), "
            f"beta {law.beta:.3f} (90% {self.fitted.beta_interval[0]:.3f}..{self.fitted.beta_interval[1]:.3f})\n"
            f"predicted loss at N={self.params:.4g} parameters, D={self.tokens:.4g} tokens: {self.loss:.4f} "
            f"(90% {self.interval[0]:.4f}..{self.interval[1]:.4f})\n"
        )


def predict_promoted(
    uri: str, sweep: str, to: Sequence[str], overrides: Sequence[str] = (), conf_dir: Optional[Path] = None
) -> Prediction:
    """Fit the sweep's finished trials (`fit_points`: parameters from their configs, tokens
    and final loss from MLflow) and predict the run `promote` would write with `to`."""
    parent, _, trials = fetch_sweep(uri, sweep)
    metric = compare.ranking_metric(trials)
    ranked = [r.trial for r in compare.rank(trials, metric) if r.place is not None]
    args = {t.name: trial_args(parent, t) for t in ranked}
    params = {t.name: param_count(load_config(args[t.name], conf_dir).model) for t in ranked}
    fitted = fit_law(*fit_points(ranked, params, metric))
    target = load_config(promoted_args(args[ranked[0].name], to, overrides, conf_dir), conf_dir)
    n = param_count(target.model)
    d = target.train.steps * target.train.global_batch_size * target.data.seq_len
    return Prediction(fitted, n, d, fitted.law.predict(n, d), fitted.predict_interval(n, d))


def fit_points(
    trials: Sequence[compare.TrialRecord], params: Mapping[str, int], metric: str
) -> tuple[list[int], list[float], list[float]]:
    """(N, D, loss) of the law's points: at each model size and token count, the trial with
    the lowest `final_loss`. The law is the loss at the best settings: a trial at a worse
    learning rate, say, lies on another curve, and would pull the fit to it."""
    best: dict[tuple[int, float], float] = {}
    for trial in trials:
        loss = final_loss(trial, metric)
        if loss is not None and math.isfinite(loss) and trial.tokens:
            point = (params[trial.name], trial.tokens[-1])
            best[point] = min(loss, best.get(point, math.inf))
    return [n for n, _ in best], [d for _, d in best], list(best.values())


def final_loss(trial: compare.TrialRecord, metric: str) -> Optional[float]:
    """The validation loss at the trial's last validation for "val/loss"; for "loss", the
    mean of its last `FINAL_SHARE` of logged training losses: less noisy than the last one
    alone, and unlike a moving average over the whole curve it does not lag behind a loss
    still falling."""
    if metric == "val/loss":
        return trial.val_loss
    if not trial.loss:
        return None
    return statistics.fmean(trial.loss[-max(1, round(len(trial.loss) * FINAL_SHARE)) :])
