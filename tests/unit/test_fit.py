"""The loss-vs-compute fit recovers a known law from noisy synthetic trials."""

import numpy as np
import pytest

from wildtrain.sweeps.fit import FitError, Law, fit_law

# Chinchilla's own fit (Hoffmann et al. 2022, approach 3).
TRUE = Law(E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28)


def test_fit_recovers_known_exponents_within_5_percent():
    rng = np.random.default_rng(1)
    n, d = (np.array(x).ravel() for x in np.meshgrid(np.geomspace(1e7, 1e10, 6), np.geomspace(1e8, 1e11, 6)))
    losses = np.array([TRUE.predict(a, b) for a, b in zip(n, d)]) * np.exp(rng.normal(0, 0.002, len(n)))
    fitted = fit_law(n, d, losses, bootstrap=50)
    assert fitted.law.alpha == pytest.approx(TRUE.alpha, rel=0.05)
    assert fitted.law.beta == pytest.approx(TRUE.beta, rel=0.05)
    assert fitted.alpha_interval[0] <= TRUE.alpha <= fitted.alpha_interval[1]
    assert fitted.beta_interval[0] <= TRUE.beta <= fitted.beta_interval[1]
    # A size beyond the trials: predicted within 1% of the truth, its interval around the prediction.
    predicted = fitted.law.predict(7e10, 2e12)
    assert predicted == pytest.approx(TRUE.predict(7e10, 2e12), rel=0.01)
    low, high = fitted.predict_interval(7e10, 2e12)
    assert low <= predicted <= high and high - low < 0.02 * predicted


def test_too_few_trials_are_refused_with_what_is_missing():
    with pytest.raises(FitError, match=r"at least 8 points .* got 2 points, 1 sizes, 2 token counts"):
        fit_law([1e6, 1e6], [1e8, 2e8], [4.0, 3.9])


def test_a_badly_fitted_law_predicts_inf_beyond_float_range_instead_of_raising():
    wild = Law(E=1.0, A=1e3, B=1e3, alpha=-400.0, beta=0.3)
    assert wild.predict(1e9, 1e10) == float("inf")
    assert Law(E=1.7, A=400.0, B=410.0, alpha=0.34, beta=0.28).predict(1e9, 2e10) == pytest.approx(
        1.7 + 400.0 / 1e9**0.34 + 410.0 / 2e10**0.28
    )
