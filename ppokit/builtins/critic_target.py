"""Catalogue of the built-in critic_target components (torch-free)."""

from __future__ import annotations

from pydantic import Field

from ppokit.builtins._base import Params
from ppokit.hookspecs import Register

MODULE = "ppokit.components.critic_target"

Gamma = Field(default=1.0, ge=0.0, le=1.0, description="discount factor gamma in [0, 1]")


class LambdaReturnParams(Params):
    gamma: float = Gamma
    lam: float = Field(
        default=1.0, ge=0.0, le=1.0, description="the critic's lambda (may differ from the actor's)"
    )


class GammaParams(Params):
    gamma: float = Gamma


def register_components(register: Register) -> None:
    register(
        "critic_target",
        "lambda_return",
        f"{MODULE}:LambdaReturn",
        params=LambdaReturnParams,
        summary="Lambda-return: old value plus unwhitened GAE",
        formula="Y_t = V_old(s_t) + GAE_t(γ, λ)",
        requires=("values",),
        source="What's Behind PPO's Collapse in Long-CoT? Value Optimization Holds the Secret "
        "(Yuan et al., 2025), arXiv:2503.01491",
    )
    register(
        "critic_target",
        "mc_return",
        f"{MODULE}:MonteCarloReturn",
        params=GammaParams,
        summary="Discounted return-to-go, bootstrapped on truncated rows",
        formula="Y_t = Σ_{s≥t} γ^{s−t} r_s + γ^{T−t} V_T",
        source="Reinforcement Learning: An Introduction (Sutton and Barto, 2018)",
    )
    register(
        "critic_target",
        "td0",
        f"{MODULE}:TD0",
        params=GammaParams,
        summary="One-step temporal-difference target",
        formula="Y_t = r_t + γ V_old(s_{t+1}), V after the last token = terminal value",
        requires=("values",),
        source="Learning to Predict by the Methods of Temporal Differences (Sutton, 1988)",
    )
