"""Catalogue of the built-in regression_loss components (torch-free)."""

from __future__ import annotations

from pydantic import Field

from ppokit.builtins._base import Params
from ppokit.hookspecs import Register

MODULE = "ppokit.components.regression_loss"
PPO = "Proximal Policy Optimization Algorithms (Schulman et al., 2017), arXiv:1707.06347"


class MSEParams(Params):
    pass


class ClippedMSEParams(Params):
    clip: float = Field(0.2, gt=0, description="V stays within V_old +- clip in the clipped branch")


class HuberParams(Params):
    delta: float = Field(1.0, gt=0, description="quadratic below |V - Y| = delta, linear above")


def register_components(register: Register) -> None:
    register(
        "regression_loss",
        "mse",
        f"{MODULE}:MSE",
        params=MSEParams,
        summary="Squared error",
        formula="0.5 (V - Y)^2",
        source=PPO,
    )
    register(
        "regression_loss",
        "clipped_mse",
        f"{MODULE}:ClippedMSE",
        params=ClippedMSEParams,
        summary="PPO value clipping: the worse of the plain and the clipped squared error",
        formula="0.5 max((V - Y)^2, (V_old + clamp(V - V_old, -clip, clip) - Y)^2)",
        requires=("values",),
        source=PPO,
    )
    register(
        "regression_loss",
        "huber",
        f"{MODULE}:Huber",
        params=HuberParams,
        summary="Huber loss: quadratic near the target, linear far from it",
        formula="x = V - Y: 0.5 x^2 if |x| <= delta, else delta (|x| - 0.5 delta)",
        source="Robust Estimation of a Location Parameter (P. J. Huber, 1964)",
    )
