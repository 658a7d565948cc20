"""Policy losses: ``pl(logp, logp_old, adv, mask) -> elementwise [B, T]`` float32.

Every loss is exactly 0 where ``mask`` is False, whatever the inputs hold there, and is
differentiable in ``logp`` only (``logp_old`` and ``adv`` are treated as constants).
Optional ``clipped(logp, logp_old, adv, mask=None) -> bool [B, T]`` marks the positions where
the clip is active, i.e. where clipping zeroes (or caps) the gradient: the ``clipfrac`` metric.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["CISPO", "GSPO", "PPOClip", "Reinforce"]

#: Bound on log-ratios before exponentiation (exp(20) ~ 5e8 stays finite in float32).
LOG_RATIO_BOUND = 20.0


def _bool_mask(mask: Tensor) -> Tensor:
    return mask if mask.dtype == torch.bool else mask != 0


def _masked(x: Tensor, mask: Tensor) -> Tensor:
    """x where mask, else exactly 0 (also blocks NaN/inf and gradients at masked positions)."""
    return torch.where(_bool_mask(mask), x, torch.zeros_like(x))


def _log_ratio(logp: Tensor, logp_old: Tensor, mask: Tensor) -> Tensor:
    """clamp(logp - logp_old, -20, 20) in float32, 0 at masked positions."""
    diff = logp.float() - logp_old.detach().float()
    return _masked(diff, mask).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)


def _all_true(like: Tensor) -> Tensor:
    return torch.ones(like.shape, dtype=torch.bool, device=like.device)


class PPOClip:
    """PPO's clipped surrogate, with asymmetric (clip-higher) bounds and optional dual clip.

    rho = exp(clamp(logp - logp_old, -20, 20));
    l = max(-A rho, -A clip(rho, 1 - clip_low, 1 + clip_high));
    with dual_clip c > 1, where A < 0: l = min(l, -c A).

    Proximal Policy Optimization Algorithms (Schulman et al., 2017), arXiv:1707.06347;
    clip-higher from DAPO (Yu et al., 2025), arXiv:2503.14476; dual clip from Mastering
    Complex Control in MOBA Games with Deep RL (Ye et al., 2020), arXiv:1912.09729.
    """

    def __init__(
        self, clip_low: float = 0.2, clip_high: float = 0.2, dual_clip: float | None = None
    ) -> None:
        self.clip_low = clip_low
        self.clip_high = clip_high
        self.dual_clip = dual_clip

    def __call__(self, logp: Tensor, logp_old: Tensor, adv: Tensor, mask: Tensor) -> Tensor:
        ratio = _log_ratio(logp, logp_old, mask).exp()
        a = _masked(adv.detach().float(), mask)
        bounded = ratio.clamp(1.0 - self.clip_low, 1.0 + self.clip_high)
        loss = torch.maximum(-a * ratio, -a * bounded)
        if self.dual_clip is not None:
            loss = torch.where(a < 0, torch.minimum(loss, -self.dual_clip * a), loss)
        return _masked(loss, mask)

    def clipped(
        self, logp: Tensor, logp_old: Tensor, adv: Tensor, mask: Tensor | None = None
    ) -> Tensor:
        """Where the gradient is cut: rho past the bound in the advantage's direction, or
        (dual clip) rho > c for A < 0."""
        mask = _all_true(logp) if mask is None else _bool_mask(mask)
        ratio = _log_ratio(logp, logp_old, mask).detach().exp()
        a = adv.detach().float()
        out = ((a > 0) & (ratio > 1.0 + self.clip_high)) | ((a < 0) & (ratio < 1.0 - self.clip_low))
        if self.dual_clip is not None:
            out = out | ((a < 0) & (ratio > self.dual_clip))
        return out & mask


class GSPO:
    """Group Sequence Policy Optimization: a clipped surrogate on the sequence-level ratio.

    s_i = exp(mean over the row's masked t of (logp - logp_old)), used per token in
    token-gradient form s_{i,t} = sg(s_i) * exp(logp_t - sg(logp_t)) (value s_i, gradient
    s_i * grad logp_t); l_{i,t} = max(-A s_{i,t}, -A clip(s_{i,t}, 1 - clip_low, 1 + clip_high)).

    Group Sequence Policy Optimization (Zheng et al., 2025), arXiv:2507.18071.
    """

    def __init__(self, clip_low: float = 3e-4, clip_high: float = 4e-4) -> None:
        self.clip_low = clip_low
        self.clip_high = clip_high

    @staticmethod
    def sequence_ratio(logp: Tensor, logp_old: Tensor, mask: Tensor) -> Tensor:
        """s_i = exp(mean_t (logp - logp_old)) over each row's masked positions, float32 [B]
        (1 for an empty row)."""
        m = _bool_mask(mask)
        diff = _masked(logp.float() - logp_old.detach().float(), m)
        count = m.sum(dim=1).clamp_min(1).float()
        mean = (diff.sum(dim=1) / count).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        return mean.exp()

    def __call__(self, logp: Tensor, logp_old: Tensor, adv: Tensor, mask: Tensor) -> Tensor:
        lp = _masked(logp.float(), mask)
        seq = self.sequence_ratio(logp, logp_old, mask).detach()
        ratio = seq[:, None] * (lp - lp.detach()).exp()
        a = _masked(adv.detach().float(), mask)
        bounded = ratio.clamp(1.0 - self.clip_low, 1.0 + self.clip_high)
        return _masked(torch.maximum(-a * ratio, -a * bounded), mask)

    def clipped(
        self, logp: Tensor, logp_old: Tensor, adv: Tensor, mask: Tensor | None = None
    ) -> Tensor:
        """Where s_i is past the bound in the advantage's direction (per token).

        The sequence ratio averages over ``mask`` (every position when it is None).
        """
        mask = _all_true(logp) if mask is None else _bool_mask(mask)
        seq = self.sequence_ratio(logp, logp_old, mask).detach()[:, None]
        a = adv.detach().float()
        out = ((a > 0) & (seq > 1.0 + self.clip_high)) | ((a < 0) & (seq < 1.0 - self.clip_low))
        return out & mask


class CISPO:
    """Clipped importance-sampling-weight policy optimisation.

    l = -sg(min(rho, 1 + clip_high)) A logp, rho = exp(clamp(logp - logp_old, -20, 20)):
    the IS weight is truncated, but every token keeps its gradient.

    MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention
    (MiniMax, 2025), arXiv:2506.13585.
    """

    def __init__(self, clip_high: float) -> None:
        self.clip_high = clip_high

    def __call__(self, logp: Tensor, logp_old: Tensor, adv: Tensor, mask: Tensor) -> Tensor:
        weight = _log_ratio(logp, logp_old, mask).detach().exp().clamp_max(1.0 + self.clip_high)
        a = _masked(adv.detach().float(), mask)
        return _masked(-weight * a * _masked(logp.float(), mask), mask)

    def clipped(
        self, logp: Tensor, logp_old: Tensor, adv: Tensor, mask: Tensor | None = None
    ) -> Tensor:
        """Where the IS weight is truncated (rho > 1 + clip_high)."""
        mask = _all_true(logp) if mask is None else _bool_mask(mask)
        ratio = _log_ratio(logp, logp_old, mask).detach().exp()
        return (ratio > 1.0 + self.clip_high) & mask


class Reinforce:
    """The on-policy score-function loss l = -A logp (RLOO, ReMax, OPO).

    Simple Statistical Gradient-Following Algorithms for Connectionist Reinforcement
    Learning (Williams, 1992).
    """

    def __call__(self, logp: Tensor, logp_old: Tensor | None, adv: Tensor, mask: Tensor) -> Tensor:
        a = _masked(adv.detach().float(), mask)
        return _masked(-a * _masked(logp.float(), mask), mask)
