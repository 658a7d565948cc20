"""Regression losses of the critic: ``loss(pred, target, old) -> elementwise [B, T]`` float32,
differentiable in ``pred`` (target and old values are constants). Called without a mask: the
aggregation that consumes them does the masking. A loss whose catalogue entry declares
``metrics`` is called with a keyword ``metrics``, a dict its call fills with its per-position
diagnostics ``{name: [B, T] tensor}``, which the trainer averages over m^V (``clipped_mse``
reports ``vf_clipfrac``: where the value clip is active).

The implementations' base class ``RegressionLoss`` (in the ``impl`` module) holds the optional
members the trainer reads: ``head_size`` (width of the value head), ``value(head_out)`` and
``prediction(head_out)``. A plugin may subclass it to change the critic's head (e.g. a
categorical value head).

This module is the torch-free catalogue; the tensor code is
:mod:`ppokit.components.regression_loss.impl`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from pydantic import Field

from ppokit import papers
from ppokit.catalogue import Component, Contract, NoParams, Params
from ppokit.metrics_table import Metric

if TYPE_CHECKING:
    from torch import Tensor


class RegressionLoss(Protocol):
    """``loss(pred, target, old) -> [B, T]`` float32, differentiable in pred.

    A loss whose entry declares ``metrics`` takes ``metrics=``, a dict it fills with its
    per-position diagnostics ``{name: [B, T]}``. Optional: ``head_size: int`` (default 1),
    ``value(head_out) -> [B, T]``, ``prediction(head_out)``, ``clipped(pred, target, old) ->
    bool [B, T]`` (the vf_clipfrac metric of a loss that declares no metrics)."""

    def __call__(self, pred: Tensor, target: Tensor, old: Tensor) -> Tensor: ...


CONTRACT = Contract(
    "elementwise",
    like=(1, "target"),
    differentiable="pred",
    optional={
        "head_size": "int, the width of the value head (default 1)",
        "value": "V [B, T] from the head's output (default head_out[..., 0])",
        "prediction": "what the loss takes as pred (default value(head_out))",
        "clipped": "bool [B, T]: where the value clip is active (the vf_clipfrac metric of a "
        "loss that declares no metrics)",
    },
)
MODULE = "ppokit.components.regression_loss.impl"


class ClippedMSEParams(Params):
    clip: float = Field(0.2, gt=0, description="V stays within V_old +- clip in the clipped branch")


class HuberParams(Params):
    delta: float = Field(1.0, gt=0, description="quadratic below |V - Y| = delta, linear above")


MSE = Component(
    "regression_loss",
    "mse",
    MODULE,
    params=NoParams,
    summary="Squared error",
    formula="0.5 (V - Y)^2",
    source=str(papers.PPO),
)


CLIPPED_MSE = Component(
    "regression_loss",
    "clipped_mse",
    MODULE,
    params=ClippedMSEParams,
    summary="PPO value clipping: the worse of the plain and the clipped squared error",
    formula="0.5 max((V - Y)^2, (V_old + clamp(V - V_old, -clip, clip) - Y)^2)",
    requires=("values",),
    metrics=(Metric("vf_clipfrac", "fraction of positions"),),
    source=str(papers.PPO),
)


HUBER = Component(
    "regression_loss",
    "huber",
    MODULE,
    params=HuberParams,
    summary="Huber loss: quadratic near the target, linear far from it",
    formula="x = V - Y: 0.5 x^2 if |x| <= delta, else delta (|x| - 0.5 delta)",
    source=str(papers.HUBER),
)

#: Every built-in regression_loss component, registered by the default plugin.
ENTRIES: tuple[Component, ...] = (
    MSE,
    CLIPPED_MSE,
    HUBER,
)
