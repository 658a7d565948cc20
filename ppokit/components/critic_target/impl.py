"""Tensor code of the critic targets (catalogue: :mod:`ppokit.components.critic_target`)."""

from __future__ import annotations

from torch import Tensor

from ppokit.batch import RolloutBatch
from ppokit.components import critic_target as catalogue
from ppokit.ops import gae, returns_to_go

__all__ = ["TD0", "LambdaReturn", "MonteCarloReturn"]


@catalogue.LAMBDA_RETURN.implementation
class LambdaReturn:
    """The critic's lam may differ from the actor's (VC-PPO's decoupled lambda)."""

    def __init__(self, *, gamma: float, lam: float) -> None:
        self.gamma, self.lam = gamma, lam

    def __call__(self, batch: RolloutBatch) -> Tensor:
        return gae(batch, self.gamma, self.lam, plus_values=True)


@catalogue.MC_RETURN.implementation
class MonteCarloReturn:
    def __init__(self, *, gamma: float) -> None:
        self.gamma = gamma

    def __call__(self, batch: RolloutBatch) -> Tensor:
        return returns_to_go(batch, self.gamma, bootstrap=True)


@catalogue.TD0.implementation
class TD0:
    def __init__(self, *, gamma: float) -> None:
        self.gamma = gamma

    def __call__(self, batch: RolloutBatch) -> Tensor:
        # the lambda-return with lam = 0: V_t + delta_t = r_t + gamma * V(next state)
        return gae(batch, self.gamma, 0.0, plus_values=True)
