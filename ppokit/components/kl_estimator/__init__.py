"""KL estimators: ``kl(logp, logp_ref) -> [B, T]`` float32, per-token estimates of
KL(pi || pi_ref) from the log-probabilities of sampled tokens a ~ pi. Called without a mask:
the aggregation that consumes them does the masking.

An estimator whose entry requires ``logp_old`` is called ``kl(logp, logp_ref, logp_old)``: its estimate is weighted by the ratio π/π_old of the
sampled tokens (in the loss; where logp is π_old itself, the ``kl`` metric, the weight is 1).

Each takes ``straight_through``: when True the value is unchanged but the gradient with
respect to ``logp`` is the k2 estimator's, (logp - logp_ref): value.detach() + (k2 - sg(k2)).

This module is the torch-free catalogue; the tensor code is
:mod:`ppokit.components.kl_estimator.impl`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from pydantic import Field

from ppokit import papers
from ppokit.catalogue import LOG_RATIO_BOUND, Component, Contract, Params

if TYPE_CHECKING:
    from torch import Tensor


class KLEstimator(Protocol):
    """``kl(logp, logp_ref) -> [B, T]`` float32, differentiable in logp (an
    estimator whose entry requires ``logp_old``: ``kl(logp, logp_ref, logp_old)``)."""

    def __call__(
        self, logp: Tensor, logp_ref: Tensor, logp_old: Tensor | None = None
    ) -> Tensor: ...


CONTRACT = Contract("elementwise", like=(0, "logp"), differentiable="logp")
MODULE = "ppokit.components.kl_estimator.impl"


class KLParams(Params):
    straight_through: bool = Field(
        False, description="keep the value, take the gradient of k2 (logp - logp_ref)"
    )


_STRAIGHT_THROUGH = "; straight_through: value + k2 - sg(k2) with sg(value)"


def _estimator(
    name: str,
    summary: str,
    formula: str,
    requires: tuple[str, ...] = ("logp_ref",),
    source: str = str(papers.KL_APPROX),
) -> Component:
    return Component(
        "kl_estimator",
        name,
        MODULE,
        params=KLParams,
        summary=summary,
        formula=formula + _STRAIGHT_THROUGH,
        requires=requires,
        source=source,
    )


K1 = _estimator("k1", "Log-ratio: unbiased, high variance", "k1 = logp - logp_ref")
K2 = _estimator(
    "k2", "Half squared log-ratio: biased, low variance", "k2 = 0.5 (logp - logp_ref)^2"
)
#: k3 is clamped to at most this value.
K3_MAX = 10.0
K3 = _estimator(
    "k3",
    "exp(d) - d - 1: unbiased and non-negative",
    f"k3 = clamp(exp(d) - d - 1, 0, {K3_MAX:g}), "
    f"d = clamp(logp_ref - logp, -{LOG_RATIO_BOUND:g}, {LOG_RATIO_BOUND:g})",
)
ABS = _estimator("abs", "Absolute log-ratio", "|logp - logp_ref|")
K3_IS = _estimator(
    "k3_is",
    "k3 weighted by the ratio π/π_old: unbiased for KL(π || π_ref) on tokens sampled from π_old",
    "k3_is = exp(clamp(logp - logp_old, -B, B)) · k3, the ratio not detached, "
    f"B = {LOG_RATIO_BOUND:g}",
    requires=("logp_ref", "logp_old"),
    source=papers.cite(
        ("the unbiased KL estimate", papers.DEEPSEEK_V32), "TRL's use_bias_correction_kl"
    ),
)

#: Every built-in kl_estimator component, registered by the default plugin.
ENTRIES: tuple[Component, ...] = (K1, K2, K3, ABS, K3_IS)
