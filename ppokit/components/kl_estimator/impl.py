"""Tensor code of the KL estimators (catalogue: :mod:`ppokit.components.kl_estimator`)."""

from __future__ import annotations

import torch
from torch import Tensor

from ppokit.components import kl_estimator as catalogue
from ppokit.components.kl_estimator import K3_MAX
from ppokit.ops import LOG_RATIO_BOUND

__all__ = ["K1", "K2", "K3", "K3IS", "AbsKL", "LogRatioEstimator"]


def _k2(diff: Tensor) -> Tensor:
    return 0.5 * diff * diff


class LogRatioEstimator:
    """Base: subclasses define ``estimate(diff)`` of diff = logp - logp_ref (float32)."""

    def __init__(self, *, straight_through: bool) -> None:
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


@catalogue.K1.implementation
class K1(LogRatioEstimator):
    def estimate(self, diff: Tensor) -> Tensor:
        return diff


@catalogue.K2.implementation
class K2(LogRatioEstimator):
    def estimate(self, diff: Tensor) -> Tensor:
        return _k2(diff)


@catalogue.K3.implementation
class K3(LogRatioEstimator):
    """expm1(d) - d is exp(d) - d - 1 without cancellation near d = 0, so k3 >= 0 holds in
    floating point too."""

    def estimate(self, diff: Tensor) -> Tensor:
        d = (-diff).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        # expm1(d) - d is exp(d) - d - 1 without cancellation near d = 0, so k3 >= 0 holds
        # in floating point too.
        return (torch.expm1(d) - d).clamp(0.0, K3_MAX)


@catalogue.ABS.implementation
class AbsKL(LogRatioEstimator):
    def estimate(self, diff: Tensor) -> Tensor:
        return diff.abs()


@catalogue.K3_IS.implementation
class K3IS(K3):
    """k3 times ρ = π/π_old, ρ not detached (TRL's ``use_bias_correction_kl``): the gradient
    flows through the weight too. Where logp is π_old (the ``kl`` metric) ρ = 1. Its entry
    requires ``logp_old``: the trainer passes it."""

    def __call__(self, logp: Tensor, logp_ref: Tensor, logp_old: Tensor | None = None) -> Tensor:
        diff = logp.float() - logp_ref.detach().float()
        value = self.estimate(diff)
        if logp_old is not None:
            log_rho = logp.float() - logp_old.detach().float()
            value = value * log_rho.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).exp()
        if not self.straight_through:
            return value
        k2 = _k2(diff)
        return value.detach() + (k2 - k2.detach())
