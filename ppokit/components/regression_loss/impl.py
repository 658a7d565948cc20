"""Tensor code of the critic's regression losses (catalogue:
:mod:`ppokit.components.regression_loss`).

:class:`RegressionLoss` holds the optional members the trainer reads: ``head_size`` (width
of the value head), ``value(head_out)`` and ``prediction(head_out)``. A plugin may subclass
it to change the critic's head (e.g. a categorical value head).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ppokit.components import regression_loss as catalogue

__all__ = ["MSE", "ClippedMSE", "Huber", "RegressionLoss"]


class RegressionLoss:
    """Base of the critic losses: a one-wide value head read as V = head_out[..., 0]."""

    head_size: int = 1

    def value(self, head_out: Tensor) -> Tensor:
        """The value V [B, T] read from the head output [B, T, head_size]."""
        return head_out[..., 0]

    def prediction(self, head_out: Tensor) -> Tensor:
        """What the loss takes as ``pred``: the value itself by default."""
        return self.value(head_out)

    def __call__(self, pred: Tensor, target: Tensor, old: Tensor | None = None) -> Tensor:
        raise NotImplementedError


@catalogue.MSE.implementation
class MSE(RegressionLoss):
    def __call__(self, pred: Tensor, target: Tensor, old: Tensor | None = None) -> Tensor:
        err = pred.float() - target.detach().float()
        return 0.5 * err * err


@catalogue.CLIPPED_MSE.implementation
class ClippedMSE(RegressionLoss):
    """The clipped branch is taken only where it is strictly larger, so the gradient is 0 exactly
    where ``clipped`` is True (value clipping as in OpenAI Baselines' ppo2)."""

    def __init__(self, *, clip: float) -> None:
        self.clip = clip

    def _branches(self, pred: Tensor, target: Tensor, old: Tensor) -> tuple[Tensor, Tensor]:
        v = pred.float()
        y = target.detach().float()
        v_old = old.detach().float()
        v_clip = v_old + (v - v_old).clamp(-self.clip, self.clip)
        return (v - y).square(), (v_clip - y).square()

    def __call__(
        self,
        pred: Tensor,
        target: Tensor,
        old: Tensor | None = None,
        metrics: dict[str, Tensor] | None = None,
    ) -> Tensor:
        if old is None:
            raise ValueError("clipped_mse needs the old values (old=V_old)")
        plain, clipped = self._branches(pred, target, old)
        further = clipped > plain
        if metrics is not None:  # where the clip is active: vf_clipfrac
            metrics["vf_clipfrac"] = further.detach()
        return 0.5 * torch.where(further, clipped, plain)

    def clipped(self, pred: Tensor, target: Tensor, old: Tensor) -> Tensor:
        """Where the clipped branch is active and further from Y (the gradient is cut)."""
        plain, clipped = self._branches(pred.detach(), target, old)
        return clipped > plain


@catalogue.HUBER.implementation
class Huber(RegressionLoss):
    def __init__(self, *, delta: float) -> None:
        self.delta = delta

    def __call__(self, pred: Tensor, target: Tensor, old: Tensor | None = None) -> Tensor:
        err = pred.float() - target.detach().float()
        size = err.abs()
        quadratic = 0.5 * err * err
        linear = self.delta * (size - 0.5 * self.delta)
        return torch.where(size <= self.delta, quadratic, linear)
