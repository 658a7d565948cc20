"""Rollout corrections: per-token weights for the mismatch between the behaviour policy μ
that generated a batch (what the rollout engine recorded, ``batch.logp_rollout``) and π_old,
the trainer's policy at the weights that sampled (``batch.logp_old``). A fast engine computes
probabilities with other kernels and often another dtype, so its tokens are slightly
off-policy; a correction reweights or rejects them.

``corr(batch) -> weights [B, T]``: float32, no grad, 0 at masked positions and at rejected
tokens or rows. With Δ_t = logp_old − logp_rollout and r_t = exp Δ_t, the actor's
policy-gradient term becomes agg(pl(...)·ω·c, mask') with mask' = mask·[ω > 0]·[c > 0]
(docs/design.md).

This module is the torch-free catalogue; the tensor code is
:mod:`ppokit.components.rollout_correction.impl`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, Protocol

from pydantic import Field

from ppokit import papers
from ppokit.catalogue import Bounds, Component, Contract, NoParams, Params
from ppokit.metrics_table import Metric

if TYPE_CHECKING:
    from torch import Tensor

    from ppokit.batch import RolloutBatch


class RolloutCorrection(Protocol):
    """``corr(batch) -> [B, T]`` float32 weights, 0 where masked or rejected, no grad."""

    def __call__(self, batch: RolloutBatch) -> Tensor: ...


CONTRACT = Contract(
    "estimate",
    optional={
        "keeps_rejected": "True: a rejected token (weight 0) stays in mask', so in the "
        "loss's normaliser (TRL's *_mask modes)"
    },
)
MODULE = "ppokit.components.rollout_correction.impl"
REQUIRES = ("logp_old", "logp_rollout")
#: What every correction reports each round (its ``metrics(batch, weights)``).
METRICS = (
    Metric("rollout/correction_weight_mean", "mean weight c over the response tokens"),
    Metric("rollout/correction_masked_frac", "fraction of response tokens of weight 0"),
    Metric("rollout/correction_masked_rows", "fraction of responses of weight 0 throughout"),
)
YAO = papers.cite(papers.OFF_POLICY, "verl algorithm.rollout_correction")
ICEPOP = papers.cite(
    ("IcePop: masked importance sampling of the training-inference mismatch", papers.ICEPOP)
)
VERL_RS = papers.cite(
    "Rejection sampling by the rollout/training ratio, as in verl "
    "(algorithm.rollout_correction, rollout_rs)",
    papers.OFF_POLICY,
    "verl algorithm.rollout_correction",
)


class CapParams(Params):
    cap: float = Field(
        2.0, ge=1.0, le=1e6, description="truncation C of the ratio: min(ratio, C); >= 1"
    )


class BoundsParams(Bounds):
    low: float = Field(0.5, gt=0.0, le=1.0, description="the smallest ratio kept (<= 1)")
    high: float = Field(2.0, ge=1.0, le=1e6, description="the largest ratio kept (>= 1)")


class MISParams(Params):
    low: float | None = Field(
        0.5, gt=0.0, le=1.0, description="the smallest ratio kept (<= 1); null: no lower bound"
    )
    high: float = Field(2.0, ge=1.0, le=1e6, description="the largest ratio kept (>= 1)")
    rejected: Literal["dropped", "zero"] = Field(
        "dropped",
        description="a rejected token leaves mask' and the loss's normaliser (dropped) or "
        "weighs 0 and stays in it (zero: TRL's token_mask and sequence_mask)",
    )


class TokenMISParams(MISParams):
    high: float = Field(5.0, ge=1.0, le=1e6, description="the largest ratio kept (>= 1)")


class GeoParams(BoundsParams):
    low: float = Field(
        0.999, gt=0.0, le=1.0, description="the smallest geometric-mean ratio kept (<= 1)"
    )
    high: float = Field(
        1.001, ge=1.0, le=1e6, description="the largest geometric-mean ratio kept (>= 1)"
    )


NONE = Component(
    "rollout_correction",
    "none",
    MODULE,
    params=NoParams,
    metrics=METRICS,
    summary="No correction: the batch is taken as on-policy for π_old",
    formula="c_t = 1 on response positions",
    source=str(papers.PPO),
)

TOKEN_TIS = Component(
    "rollout_correction",
    "token_tis",
    MODULE,
    params=CapParams,
    summary="Truncated importance sampling per token: min(π_old/μ, C)",
    formula="c_t = min(r_t, cap), r_t = exp(logp_old_t - logp_rollout_t)",
    requires=REQUIRES,
    metrics=METRICS,
    source=YAO,
)

TOKEN_MIS = Component(
    "rollout_correction",
    "token_mis",
    MODULE,
    params=TokenMISParams,
    summary="Masked importance sampling per token: tokens whose ratio leaves [low, high] are dropped",
    formula="c_t = r_t · 1[low <= r_t <= high]; rejected: zero keeps c_t = 0 in mask'",
    requires=REQUIRES,
    metrics=METRICS,
    source=ICEPOP,
)

SEQ_TIS = Component(
    "rollout_correction",
    "seq_tis",
    MODULE,
    params=CapParams,
    summary="Truncated importance sampling per sequence, on every token of the row",
    formula="c_t = min(exp(Σ_t Δ_t), cap), Δ_t = logp_old_t - logp_rollout_t",
    requires=REQUIRES,
    metrics=METRICS,
    source=YAO,
)

SEQ_MIS = Component(
    "rollout_correction",
    "seq_mis",
    MODULE,
    params=MISParams,
    summary="Masked importance sampling per sequence: rows whose ratio leaves [low, high] are dropped",
    formula="ρ = exp(Σ_t Δ_t); c_t = ρ · 1[low <= ρ <= high]; rejected: zero keeps c_t = 0 in mask'",
    requires=REQUIRES,
    metrics=METRICS,
    source=VERL_RS,
)

GEO_MASK = Component(
    "rollout_correction",
    "geo_mask",
    MODULE,
    params=GeoParams,
    summary="Rejects rows by the geometric-mean ratio (which does not grow with length)",
    formula="g = exp(mean_t Δ_t); c_t = 1[low <= g <= high]",
    requires=REQUIRES,
    metrics=METRICS,
    source=VERL_RS,
)

#: Every built-in rollout correction, registered by the default plugin.
ENTRIES: tuple[Component, ...] = (NONE, TOKEN_TIS, TOKEN_MIS, SEQ_TIS, SEQ_MIS, GEO_MASK)
