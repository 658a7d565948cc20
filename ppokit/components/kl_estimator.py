"""KL estimators: ``kl(logp, logp_ref) -> [B, T]`` float32, per-token estimates of
KL(pi || pi_ref) from the log-probabilities of sampled tokens a ~ pi.

Each takes ``straight_through``: when True the value is unchanged but the gradient with
respect to ``logp`` is the k2 estimator's, (logp - logp_ref): value.detach() + (k2 - sg(k2)).

Approximating KL Divergence (J. Schulman, 2020), http://joschu.net/blog/kl-approx.html.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["K1", "K2", "K3", "AbsKL", "KLEstimator"]

#: Bound on the log-ratio inside k3's exponential.
LOG_RATIO_BOUND = 20.0
#: k3 is clamped to at most this value.
K3_MAX = 10.0


def _k2(diff: Tensor) -> Tensor:
    return 0.5 * diff * diff


class KLEstimator:
    """Base: subclasses define ``estimate(diff)`` of diff = logp - logp_ref (float32)."""

    def __init__(self, straight_through: bool = False) -> None:
        self.straight_through = straight_through

    def estimate(self, diff: Tensor) -> Tensor:
        raise NotImplementedError

    def __call__(self, logp: Tensor, logp_ref: Tensor) -> Tensor:
        diff = logp.float() - logp_ref.detach().float()
        value = self.estimate(diff)
        if not self.straight_through:
            return value
        k2 = _k2(diff)
        return value.detach() + (k2 - k2.detach())


class K1(KLEstimator):
    """k1 = logp - logp_ref (unbiased, high variance, can be negative).

    Approximating KL Divergence (J. Schulman, 2020).
    """

    def estimate(self, diff: Tensor) -> Tensor:
        return diff


class K2(KLEstimator):
    """k2 = 0.5 (logp - logp_ref)^2 (biased, low variance, >= 0).

    Approximating KL Divergence (J. Schulman, 2020).
    """

    def estimate(self, diff: Tensor) -> Tensor:
        return _k2(diff)


class K3(KLEstimator):
    """k3 = exp(d) - d - 1 with d = clamp(logp_ref - logp, -20, 20), clamped to [0, 10]
    (>= 0; unbiased where the clamps do not bind).

    Approximating KL Divergence (J. Schulman, 2020).
    """

    def estimate(self, diff: Tensor) -> Tensor:
        d = (-diff).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        # expm1(d) - d is exp(d) - d - 1 without cancellation near d = 0, so k3 >= 0 holds
        # in floating point too.
        return (torch.expm1(d) - d).clamp(0.0, K3_MAX)


class AbsKL(KLEstimator):
    """|logp - logp_ref|.

    Approximating KL Divergence (J. Schulman, 2020).
    """

    def estimate(self, diff: Tensor) -> Tensor:
        return diff.abs()
