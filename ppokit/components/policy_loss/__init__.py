"""Policy losses: ``pl(logp, logp_old, adv, mask) -> elementwise [B, T]`` float32.

Every loss is exactly 0 where ``mask`` is False, whatever the inputs hold there, and is
differentiable in ``logp`` only (``logp_old`` and ``adv`` are treated as constants).
A loss whose catalogue entry declares ``metrics`` is called with a keyword ``metrics``, a
dict its call fills with ``{name: [B, T] tensor}``: per-position diagnostics taken from the
ratio it computes anyway, which the trainer averages over mask' (the clipped losses report
``clipfrac``, where the clip is active, i.e. where clipping zeroes or caps the gradient).
Optional ``clipped(logp, logp_old, adv, mask=None) -> bool [B, T]`` gives the same positions
by a second computation of the ratio: the trainer reads it only for a loss that declares no
metrics.

This module is the torch-free catalogue; the tensor code is
:mod:`ppokit.components.policy_loss.impl`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from pydantic import Field

from ppokit import papers
from ppokit.catalogue import LOG_RATIO_BOUND, Component, Contract, NoParams, Params
from ppokit.metrics_table import Metric

if TYPE_CHECKING:
    from torch import Tensor


class PolicyLoss(Protocol):
    """``pl(logp, logp_old, adv, mask) -> [B, T]``, 0 where mask is False, differentiable in logp.

    A loss whose entry declares ``metrics`` takes ``metrics=``, a dict it fills with its
    per-position diagnostics ``{name: [B, T]}``. Optional: ``clipped(logp, logp_old, adv,
    mask) -> bool [B, T]`` (the clipfrac metric of a loss that declares no metrics)."""

    def __call__(self, logp: Tensor, logp_old: Tensor, adv: Tensor, mask: Tensor) -> Tensor: ...


CONTRACT = Contract(
    "elementwise",
    like=(0, "logp"),
    differentiable="logp",
    optional={
        "clipped": "bool [B, T]: where the clip is active (the clipfrac metric of a loss "
        "that declares no metrics)"
    },
)
MODULE = "ppokit.components.policy_loss.impl"
#: What a clipped loss reports from its call (``metrics["clipfrac"]``: where its clip is
#: active, bool [B, T]).
CLIPFRAC = (Metric("clipfrac", "fraction of tokens"),)


class PPOClipParams(Params):
    clip_low: float = Field(0.2, ge=0, lt=1, description="lower clip: rho >= 1 - clip_low")
    clip_high: float = Field(0.2, ge=0, description="upper clip: rho <= 1 + clip_high")
    dual_clip: float | None = Field(
        None, gt=1, description="dual clip c > 1: caps the loss at -c A where A < 0 (None: off)"
    )


class GSPOParams(Params):
    clip_low: float = Field(3e-4, ge=0, lt=1, description="lower clip of the sequence ratio")
    clip_high: float = Field(4e-4, ge=0, description="upper clip of the sequence ratio")


class CISPOParams(Params):
    clip_high: float = Field(..., gt=0, description="IS weight truncated at 1 + clip_high")


PPO_CLIP = Component(
    "policy_loss",
    "ppo_clip",
    MODULE,
    params=PPOClipParams,
    summary="PPO clipped surrogate (asymmetric clip-higher bounds, optional dual clip)",
    formula=(
        f"rho = exp(clamp(logp - logp_old, -{LOG_RATIO_BOUND:g}, {LOG_RATIO_BOUND:g})); "
        "l = max(-A rho, -A clip(rho, 1 - clip_low, 1 + clip_high)); "
        "dual clip c: l = min(l, -c A) where A < 0"
    ),
    requires=("logp_old",),
    metrics=CLIPFRAC,
    source=papers.cite(papers.PPO, ("clip-higher", papers.DAPO), ("dual clip", papers.DUAL_CLIP)),
)


GSPO = Component(
    "policy_loss",
    "gspo",
    MODULE,
    params=GSPOParams,
    summary="Clipped surrogate on the sequence-level (length-normalised) ratio",
    formula=(
        "s_i = exp(mean_t (logp - logp_old)); s_{i,t} = sg(s_i) exp(logp_t - sg(logp_t)); "
        "l = max(-A s_{i,t}, -A clip(s_{i,t}, 1 - clip_low, 1 + clip_high))"
    ),
    requires=("logp_old",),
    metrics=CLIPFRAC,
    source=str(papers.GSPO),
)


CISPO = Component(
    "policy_loss",
    "cispo",
    MODULE,
    params=CISPOParams,
    summary="Truncated, stop-gradient IS weight on a REINFORCE loss: no token loses its gradient",
    formula="l = -sg(min(rho, 1 + clip_high)) A logp",
    requires=("logp_old",),
    metrics=CLIPFRAC,
    source=str(papers.CISPO),
)


REINFORCE = Component(
    "policy_loss",
    "reinforce",
    MODULE,
    params=NoParams,
    summary="On-policy score-function loss (RLOO, ReMax, OPO)",
    formula="l = -A logp",
    source=str(papers.REINFORCE),
)

#: Every built-in policy_loss component, registered by the default plugin.
ENTRIES: tuple[Component, ...] = (
    PPO_CLIP,
    GSPO,
    CISPO,
    REINFORCE,
)
