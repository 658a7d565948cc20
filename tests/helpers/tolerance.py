"""Tolerances derived from float32 arithmetic, for tests that compare two float32 computations
of one quantity (padded and unpadded, one process and two, micro-batches and one batch).

IEEE float32 rounds each operation to within a relative ``U = 2**-24`` (the unit roundoff).
A sum of ``n`` terms in any order is within ``γ(n - 1) · Σ|x_i|`` of the exact sum, with
``γ(k) = k·U / (1 - k·U)`` (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed.,
eq. 4.4), so two computed sums of the same terms differ by at most twice that. torch's exp and
log on a CPU are within ``ULPS`` units in the last place (SLEEF's 1.0-ULP kernels in the
vectorised loops, libm's in the scalar tail: an element can take either path, by where it sits
in memory), a relative ``2·U·ULPS``.
"""

from __future__ import annotations

import torch

#: The unit roundoff of float32.
U = 2.0**-24
#: The most units in the last place that torch's float32 exp (or log) is off on a CPU.
ULPS = 1


def gamma(n: int) -> float:
    """γ(n) = n·U / (1 − n·U): the relative error bound of n rounded operations in a row."""
    assert n * U < 1
    return n * U / (1 - n * U)


def sum_gap(x: torch.Tensor, n: int, dim: int = -1) -> torch.Tensor:
    """The most two float32 sums of the terms ``x`` along ``dim``, each summed among at most
    ``n`` terms (zeros of padding included) in any order and blocking, can differ by:
    2·γ(n − 1)·Σ|x|, in float64."""
    return 2 * gamma(max(n - 1, 0)) * x.double().abs().sum(dim)


def exp_gap(log_gap: torch.Tensor) -> torch.Tensor:
    """The most two float32 ``exp`` of arguments at most ``log_gap`` apart can differ by,
    relative to the larger: each exp is within δ = 2·U·ULPS of the exact value, and
    exp(a)/exp(b) = exp(a − b), so the ratio is within exp(gap)·(1 + δ)/(1 − δ)."""
    delta = 2 * U * ULPS
    return torch.exp(log_gap.double()) * (1 + delta) / (1 - delta) - 1
