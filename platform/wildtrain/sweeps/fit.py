"""A loss-vs-compute law fitted to a sweep's trials: Chinchilla's approach 3 (Hoffmann et
al. 2022), L(N, D) = E + A / N^alpha + B / D^beta over parameters N and tokens D, fitted in
log space with a Huber loss (delta 1e-3) by L-BFGS from a grid of starts, with bootstrap
intervals over the trials. Pure (numpy, scipy)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Sequence

import numpy as np

HUBER_DELTA = 1e-3
# Starts of the optimisation (a coarser version of the paper's grid): log A and log B,
# alpha and beta, log E.
_STARTS = list(itertools.product((0.0, 5.0, 10.0), (0.0, 5.0, 10.0), (0.2, 0.5, 1.0), (0.2, 0.5, 1.0), (-1.0, 0.5)))
# At least this many points for five parameters, or the fit says nothing.
MIN_POINTS = 8


class FitError(ValueError):
    pass


@dataclass(frozen=True)
class Law:
    E: float
    A: float
    B: float
    alpha: float
    beta: float

    def predict(self, n: float, d: float) -> float:
        # In floats that overflow to inf: a bootstrap law fitted badly (from a few points) may
        # predict beyond float range far from its data, and its interval then says so.
        with np.errstate(over="ignore"):
            return float(
                self.E + self.A * np.power(np.float64(n), -self.alpha) + self.B * np.power(np.float64(d), -self.beta)
            )


@dataclass(frozen=True)
class Fitted:
    law: Law
    alpha_interval: tuple[float, float]
    beta_interval: tuple[float, float]
    laws: tuple[Law, ...]  # the bootstrap's, for intervals of predictions

    def predict_interval(self, n: float, d: float, level: float = 0.9) -> tuple[float, float]:
        values = [law.predict(n, d) for law in self.laws]
        return _interval(values, level)


def _objective(theta: np.ndarray, log_n: np.ndarray, log_d: np.ndarray, log_l: np.ndarray) -> tuple[float, np.ndarray]:
    """The Huber loss of the log-space residuals, and its gradient (L-BFGS would otherwise
    difference it numerically: six evaluations per step)."""
    a, b, alpha, beta, e = theta
    terms = np.stack([a - alpha * log_n, b - beta * log_d, np.full_like(log_n, e)])
    predicted = np.logaddexp.reduce(terms, axis=0)
    weights = np.exp(terms - predicted)  # d predicted / d term: a softmax
    r = predicted - log_l
    small = np.abs(r) <= HUBER_DELTA
    loss = np.sum(np.where(small, 0.5 * r**2, HUBER_DELTA * (np.abs(r) - 0.5 * HUBER_DELTA)))
    slope = np.clip(r, -HUBER_DELTA, HUBER_DELTA)
    grad = np.array(
        [
            np.sum(slope * weights[0]),
            np.sum(slope * weights[1]),
            -np.sum(slope * weights[0] * log_n),
            -np.sum(slope * weights[1] * log_d),
            np.sum(slope * weights[2]),
        ]
    )
    return float(loss), grad


def _fit(log_n, log_d, log_l, starts, options=None) -> np.ndarray:
    from scipy.optimize import minimize

    best = None
    for start in starts:
        result = minimize(
            _objective, np.array(start), args=(log_n, log_d, log_l), method="L-BFGS-B", jac=True, options=options
        )
        if best is None or result.fun < best.fun:
            best = result
    return best.x


# A resample fitted from the full fit's optimum starts near its own: with L-BFGS-B's
# default tolerances it stops at once (the Huber loss of a good fit is ~1e-5), and the
# intervals come out too narrow.
_FROM_OPTIMUM = {"gtol": 1e-10, "ftol": 1e-13, "maxiter": 200}


def _law(theta: np.ndarray) -> Law:
    a, b, alpha, beta, e = theta
    return Law(float(np.exp(e)), float(np.exp(a)), float(np.exp(b)), float(alpha), float(beta))


def _interval(values: Sequence[float], level: float) -> tuple[float, float]:
    tail = (1 - level) / 2 * 100
    return float(np.percentile(values, tail)), float(np.percentile(values, 100 - tail))


def fit_law(
    params: Sequence[float],
    tokens: Sequence[float],
    losses: Sequence[float],
    bootstrap: int = 100,
    seed: int = 0,
    level: float = 0.9,
) -> Fitted:
    """The law through (N, D, loss) points, with `level` bootstrap intervals: each resample
    of the points is fitted from the full fit's optimum, as a grid per resample would cost
    the grid's size again for little change."""
    n, d, loss = (np.asarray(x, dtype=float) for x in (params, tokens, losses))
    if len(loss) < MIN_POINTS or len(set(n)) < 2 or len(set(d)) < 2 or not np.all(np.isfinite(loss)):
        raise FitError(
            f"a loss-vs-compute fit needs at least {MIN_POINTS} points (the best finished trial at a "
            f"model size and token count) with finite losses over several of each; got {len(loss)} points, "
            f"{len(set(n))} sizes, {len(set(d))} token counts"
        )
    log_n, log_d, log_l = np.log(n), np.log(d), np.log(loss)
    theta = _fit(log_n, log_d, log_l, _STARTS)
    rng = np.random.default_rng(seed)
    laws = []
    for _ in range(bootstrap):
        pick = rng.integers(0, len(loss), len(loss))
        laws.append(_law(_fit(log_n[pick], log_d[pick], log_l[pick], [theta], _FROM_OPTIMUM)))
    return Fitted(
        _law(theta),
        _interval([law.alpha for law in laws], level),
        _interval([law.beta for law in laws], level),
        tuple(laws),
    )
