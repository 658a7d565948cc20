"""Tensor code of the policy losses (catalogue: :mod:`ppokit.components.policy_loss`).

A clipped loss reports where its clip is active (``clipfrac``) into the ``metrics`` dict the
trainer passes, from the ratio its call computes: the ratio is computed once a call.
``clipped`` gives the same positions on its own (a second computation of the ratio).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ppokit.components import policy_loss as catalogue
from ppokit.ops import LOG_RATIO_BOUND, bool_mask, masked

__all__ = ["CISPO", "GSPO", "PPOClip", "Reinforce"]


def _log_ratio(logp: Tensor, logp_old: Tensor, mask: Tensor) -> Tensor:
    """clamp(logp - logp_old, ±LOG_RATIO_BOUND) in float32, 0 at masked positions."""
    diff = logp.float() - logp_old.detach().float()
    return masked(diff, mask).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)


def _all_true(like: Tensor) -> Tensor:
    return torch.ones(like.shape, dtype=torch.bool, device=like.device)


def _report(metrics: dict[str, Tensor] | None, name: str, active: Tensor, mask: Tensor) -> None:
    """``metrics[name]``: the positions ``active`` of ``mask`` (bool [B, T]), when asked."""
    if metrics is not None:
        metrics[name] = active.detach() & bool_mask(mask)


@catalogue.PPO_CLIP.implementation
class PPOClip:
    def __init__(self, *, clip_low: float, clip_high: float, dual_clip: float | None) -> None:
        self.clip_low = clip_low
        self.clip_high = clip_high
        self.dual_clip = dual_clip

    def __call__(
        self,
        logp: Tensor,
        logp_old: Tensor,
        adv: Tensor,
        mask: Tensor,
        metrics: dict[str, Tensor] | None = None,
    ) -> Tensor:
        ratio = _log_ratio(logp, logp_old, mask).exp()
        a = masked(adv.detach().float(), mask)
        bounded = ratio.clamp(1.0 - self.clip_low, 1.0 + self.clip_high)
        loss = torch.maximum(-a * ratio, -a * bounded)
        if self.dual_clip is not None:
            loss = torch.where(a < 0, torch.minimum(loss, -self.dual_clip * a), loss)
        _report(metrics, "clipfrac", self._active(ratio.detach(), a), mask)
        return masked(loss, mask)

    def clipped(
        self, logp: Tensor, logp_old: Tensor, adv: Tensor, mask: Tensor | None = None
    ) -> Tensor:
        """Where the gradient is cut: rho past the bound in the advantage's direction, or
        (dual clip) rho > c for A < 0."""
        mask = _all_true(logp) if mask is None else bool_mask(mask)
        ratio = _log_ratio(logp, logp_old, mask).detach().exp()
        return self._active(ratio, adv.detach().float()) & mask

    def _active(self, ratio: Tensor, a: Tensor) -> Tensor:
        out = ((a > 0) & (ratio > 1.0 + self.clip_high)) | ((a < 0) & (ratio < 1.0 - self.clip_low))
        if self.dual_clip is not None:
            out = out | ((a < 0) & (ratio > self.dual_clip))
        return out


@catalogue.GSPO.implementation
class GSPO:
    """s_{i,t} has the value s_i and the gradient s_i * grad logp_t."""

    def __init__(self, *, clip_low: float, clip_high: float) -> None:
        self.clip_low = clip_low
        self.clip_high = clip_high

    @staticmethod
    def sequence_ratio(logp: Tensor, logp_old: Tensor, mask: Tensor) -> Tensor:
        """s_i = exp(mean_t (logp - logp_old)) over each row's masked positions, float32 [B]
        (1 for an empty row)."""
        m = bool_mask(mask)
        diff = masked(logp.float() - logp_old.detach().float(), m)
        count = m.sum(dim=1).clamp_min(1).float()
        mean = (diff.sum(dim=1) / count).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        return mean.exp()

    def __call__(
        self,
        logp: Tensor,
        logp_old: Tensor,
        adv: Tensor,
        mask: Tensor,
        metrics: dict[str, Tensor] | None = None,
    ) -> Tensor:
        lp = masked(logp.float(), mask)
        seq = self.sequence_ratio(logp, logp_old, mask).detach()
        ratio = seq[:, None] * (lp - lp.detach()).exp()
        a = masked(adv.detach().float(), mask)
        bounded = ratio.clamp(1.0 - self.clip_low, 1.0 + self.clip_high)
        _report(metrics, "clipfrac", self._active(seq[:, None], a), mask)
        return masked(torch.maximum(-a * ratio, -a * bounded), mask)

    def clipped(
        self, logp: Tensor, logp_old: Tensor, adv: Tensor, mask: Tensor | None = None
    ) -> Tensor:
        """Where s_i is past the bound in the advantage's direction (per token).

        The sequence ratio averages over ``mask`` (every position when it is None).
        """
        mask = _all_true(logp) if mask is None else bool_mask(mask)
        seq = self.sequence_ratio(logp, logp_old, mask).detach()[:, None]
        return self._active(seq, adv.detach().float()) & mask

    def _active(self, seq: Tensor, a: Tensor) -> Tensor:
        return ((a > 0) & (seq > 1.0 + self.clip_high)) | ((a < 0) & (seq < 1.0 - self.clip_low))


@catalogue.CISPO.implementation
class CISPO:
    """The IS weight is truncated, but every token keeps its gradient."""

    def __init__(self, *, clip_high: float) -> None:
        self.clip_high = clip_high

    def __call__(
        self,
        logp: Tensor,
        logp_old: Tensor,
        adv: Tensor,
        mask: Tensor,
        metrics: dict[str, Tensor] | None = None,
    ) -> Tensor:
        ratio = _log_ratio(logp, logp_old, mask).detach().exp()
        weight = ratio.clamp_max(1.0 + self.clip_high)
        a = masked(adv.detach().float(), mask)
        _report(metrics, "clipfrac", ratio > 1.0 + self.clip_high, mask)
        return masked(-weight * a * masked(logp.float(), mask), mask)

    def clipped(
        self, logp: Tensor, logp_old: Tensor, adv: Tensor, mask: Tensor | None = None
    ) -> Tensor:
        """Where the IS weight is truncated (rho > 1 + clip_high)."""
        mask = _all_true(logp) if mask is None else bool_mask(mask)
        ratio = _log_ratio(logp, logp_old, mask).detach().exp()
        return (ratio > 1.0 + self.clip_high) & mask


@catalogue.REINFORCE.implementation
class Reinforce:
    def __call__(self, logp: Tensor, logp_old: Tensor | None, adv: Tensor, mask: Tensor) -> Tensor:
        a = masked(adv.detach().float(), mask)
        return masked(-a * masked(logp.float(), mask), mask)
