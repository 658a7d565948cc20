"""Critic targets: ``tgt(batch) -> Y [B, T]`` float32, detached, 0 at masked positions.

The value after a row's last token is ``batch.terminal_values``; masked gaps inside a row are
skipped (the next state of a position is the next True position of its row).

This module is the torch-free catalogue; the tensor code is
:mod:`ppokit.components.critic_target.impl`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from pydantic import Field

from ppokit import papers
from ppokit.catalogue import Component, Contract, Gamma

if TYPE_CHECKING:
    from torch import Tensor

    from ppokit.batch import RolloutBatch


class CriticTarget(Protocol):
    """``tgt(batch) -> Y [B, T]`` float32, detached, 0 at masked positions."""

    def __call__(self, batch: RolloutBatch) -> Tensor: ...


CONTRACT = Contract("estimate")
MODULE = "ppokit.components.critic_target.impl"


class LambdaReturnParams(Gamma):
    lam: float = Field(
        default=1.0, ge=0.0, le=1.0, description="the critic's lambda (may differ from the actor's)"
    )


LAMBDA_RETURN = Component(
    "critic_target",
    "lambda_return",
    MODULE,
    params=LambdaReturnParams,
    summary="Lambda-return: old value plus unwhitened GAE",
    formula="Y_t = V_old(s_t) + GAE_t(γ, λ)",
    requires=("values",),
    source=str(papers.VC_PPO),
)


MC_RETURN = Component(
    "critic_target",
    "mc_return",
    MODULE,
    params=Gamma,
    summary="Discounted return-to-go, bootstrapped on truncated rows",
    formula="Y_t = Σ_{s≥t} γ^{s−t} r_s + γ^{T−t} V_T",
    source=str(papers.SUTTON_BARTO),
)


TD0 = Component(
    "critic_target",
    "td0",
    MODULE,
    params=Gamma,
    summary="One-step temporal-difference target",
    formula="Y_t = r_t + γ V_old(s_{t+1}), V after the last token = terminal value",
    requires=("values",),
    source=str(papers.TD),
)

#: Every built-in critic_target component, registered by the default plugin.
ENTRIES: tuple[Component, ...] = (
    LAMBDA_RETURN,
    MC_RETURN,
    TD0,
)
