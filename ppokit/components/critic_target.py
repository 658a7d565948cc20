"""Critic targets: ``tgt(batch) -> Y [B, T]`` float32, detached, 0 at masked positions.

The value after a row's last token is ``batch.terminal_values``; masked gaps inside a row are
skipped (the next state of a position is the next True position of its row).
"""

from __future__ import annotations

from torch import Tensor

from ppokit.batch import RolloutBatch
from ppokit.components._scan import gae, returns_to_go

__all__ = ["TD0", "LambdaReturn", "MonteCarloReturn"]


class LambdaReturn:
    """Y_t = V_t + GAE_t(gamma, lam), unwhitened (lam may differ from the actor's).

    Source: What's Behind PPO's Collapse in Long-CoT? Value Optimization Holds the Secret
    (Yuan et al., 2025), arXiv:2503.01491 (VC-PPO: decoupled lam for the critic).
    """

    requires = ("values",)

    def __init__(self, gamma: float = 1.0, lam: float = 1.0) -> None:
        self.gamma, self.lam = gamma, lam

    def __call__(self, batch: RolloutBatch) -> Tensor:
        return gae(batch, self.gamma, self.lam, plus_values=True)


class MonteCarloReturn:
    """Y_t = G_t = r_t + gamma * G_next, G after the last token = terminal value.

    Source: Reinforcement Learning: An Introduction (Sutton and Barto, 2018), chapter 5.
    """

    def __init__(self, gamma: float = 1.0) -> None:
        self.gamma = gamma

    def __call__(self, batch: RolloutBatch) -> Tensor:
        return returns_to_go(batch, self.gamma, bootstrap=True)


class TD0:
    """Y_t = r_t + gamma * V(next state), V after the last token = terminal value.

    Source: Learning to Predict by the Methods of Temporal Differences (Sutton, 1988).
    """

    requires = ("values",)

    def __init__(self, gamma: float = 1.0) -> None:
        self.gamma = gamma

    def __call__(self, batch: RolloutBatch) -> Tensor:
        # the lambda-return with lam = 0: V_t + delta_t = r_t + gamma * V(next state)
        return gae(batch, self.gamma, 0.0, plus_values=True)
