"""Small statistics for comparing runs: a Student-t confidence interval of a mean, and the
unbiased pass@k estimator.

Torch-free; the distributions are SciPy's (``scipy.stats``), imported when a function is
called, so that importing this module stays light.

- :func:`mean_ci95` ``(values) -> (mean, half_width)``: the two-sided 95% Student-t interval
  ``mean ± t_{0.975, n-1} · s / sqrt(n)`` (``s`` the sample standard deviation).
- :func:`pass_at_k` ``(n, c, k)``: the probability that at least one of ``k`` samples drawn
  without replacement from ``n`` samples, ``c`` of them correct, is correct.
- :func:`student_t_cdf` and :func:`student_t_quantile`: the distribution behind the interval.
- :func:`wilson_half_width` and :func:`wilson_interval`: the 95% Wilson score interval of a
  proportion (the evaluation's accuracy).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

__all__ = [
    "mean_ci95",
    "pass_at_k",
    "student_t_cdf",
    "student_t_quantile",
    "wilson_half_width",
    "wilson_interval",
]


def student_t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t distribution with ``df > 0`` degrees of freedom."""
    if not df > 0:
        raise ValueError(f"degrees of freedom must be > 0, got {df}")
    from scipy.stats import t as student_t

    return float(student_t.cdf(t, df))


def student_t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t distribution (``0 < p < 1``, ``df > 0``):
    ``student_t_quantile(0.975, 2) = 4.302653``."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must be in (0, 1), got {p}")
    if not df > 0:
        raise ValueError(f"degrees of freedom must be > 0, got {df}")
    from scipy.stats import t as student_t

    return float(student_t.ppf(p, df))


def mean_ci95(values: Iterable[float]) -> tuple[float, float]:
    """``(mean, half_width)`` of the two-sided 95% Student-t confidence interval of the mean.

    ``half_width = t_{0.975, n-1} · s / sqrt(n)`` with ``s`` the sample standard deviation
    (divisor ``n - 1``); the interval is ``mean ± half_width``. With a single value the spread
    is unknown, so the half-width is ``nan`` (not 0: one seed says nothing about the
    variability over seeds). Raises ``ValueError`` for no values.
    """
    xs = [float(v) for v in values]
    n = len(xs)
    if n == 0:
        raise ValueError("mean_ci95 needs at least one value")
    mean = math.fsum(xs) / n
    if n == 1:
        return mean, math.nan
    var = math.fsum((x - mean) ** 2 for x in xs) / (n - 1)
    half = student_t_quantile(0.975, n - 1) * math.sqrt(var / n)
    return mean, half


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimator of Chen et al. (2021), arXiv:2107.03374.

    With ``n`` samples of which ``c`` are correct, ``pass@k = 1 - C(n-c, k) / C(n, k)``: the
    probability that a draw of ``k`` of the ``n`` samples (without replacement) holds a
    correct one. Computed stably as in the paper, ``1 - prod_{i=n-c+1}^{n} (1 - k/i)``, and
    exactly 1.0 when ``n - c < k``. Needs ``0 <= c <= n`` and ``1 <= k <= n``.
    """
    if n < 1 or not 0 <= c <= n:
        raise ValueError(f"pass_at_k needs n >= 1 and 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 1 <= k <= n, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    # the product runs from i = n down to n-c+1, so one more correct sample multiplies the
    # same partial product by one more factor < 1: the result is monotone in c exactly
    prod = 1.0
    for i in range(n, n - c, -1):
        prod *= 1.0 - k / i
    return 1.0 - prod


#: The two-sided 95% quantile of the standard normal distribution.
Z95 = 1.959963984540054


def _confidence(z: float) -> float:
    """The two-sided confidence level of the standard normal quantile ``z``."""
    from scipy.stats import norm

    return float(2.0 * norm.cdf(z) - 1.0)


def wilson_interval_of(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval ``(low, high)`` of ``successes`` out of ``n`` at the normal
    quantile ``z`` (scipy's ``binomtest(...).proportion_ci(method="wilson")``); ``nan`` for
    ``n = 0``."""
    if n <= 0:
        return math.nan, math.nan
    from scipy.stats import binomtest

    ci = binomtest(successes, n).proportion_ci(confidence_level=_confidence(z), method="wilson")
    return float(ci.low), float(ci.high)


def wilson_half_width(successes: int, n: int, z: float = Z95) -> float:
    """Half the width of the Wilson score interval of a proportion ``successes / n``.

    ``z / (1 + z²/n) · sqrt(p̂(1 − p̂)/n + z²/(4n²))``; unlike the normal approximation it is
    not 0 when every prompt (or none) is correct. The interval is centred on
    ``(p̂ + z²/(2n)) / (1 + z²/n)``, which is p̂ shrunk towards 1/2. ``nan`` for ``n = 0``.
    """
    low, high = wilson_interval_of(successes, n, z)
    return (high - low) / 2


def wilson_interval(accuracy: float, n: int, z: float = Z95) -> tuple[float, float]:
    """The 95% Wilson score interval ``(low, high)`` of a proportion ``accuracy`` over ``n``
    prompts (what ``eval/accuracy`` and ``eval/accuracy_ci95`` describe, e.g. to plot it)."""
    return wilson_interval_of(round(accuracy * n), n, z)
