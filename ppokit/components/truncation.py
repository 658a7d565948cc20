"""Truncation rules: ``rule(batch) -> new batch``, deciding what happens to rows that hit the
length limit without EOS (``batch.truncated``). Every rule but ``bootstrap`` drops
``bootstrap_values``, so ``batch.terminal_values`` is 0 after it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ppokit.batch import RolloutBatch

__all__ = ["Bootstrap", "Exclude", "Penalty", "SoftOverlong", "Terminal"]


def _truncated(batch: RolloutBatch, rule: str) -> Tensor:
    if batch.truncated is None:
        raise ValueError(f"the '{rule}' truncation rule needs batch.truncated")
    return batch.truncated


def _add_outcome(batch: RolloutBatch, bonus: Tensor) -> Tensor:
    """token_rewards with ``bonus`` [B] added at each row's last True position (same dtype)."""
    rewards = batch.token_rewards
    added = (rewards.float() + bonus.float()[:, None]).to(rewards.dtype)
    return torch.where(batch.last_mask, added, rewards)


class Terminal:
    """Truncated rows are treated as ended: the value after their last token is 0."""

    def __call__(self, batch: RolloutBatch) -> RolloutBatch:
        return batch.replace(bootstrap_values=None)


class Bootstrap:
    """Truncated rows are continued by the critic: keeps ``bootstrap_values``, so the value
    after a truncated row's last token is V_old of the next state (partial-episode
    bootstrapping).

    Time Limits in Reinforcement Learning (Pardo et al., 2018), arXiv:1712.00378.
    """

    def __call__(self, batch: RolloutBatch) -> RolloutBatch:
        _truncated(batch, "bootstrap")
        if batch.bootstrap_values is None:
            raise ValueError("the 'bootstrap' truncation rule needs batch.bootstrap_values")
        return batch


class Exclude:
    """Truncated rows are removed from the actor and critic losses: their response_mask row is
    set to False (overlong filtering).

    DAPO: An Open-Source LLM Reinforcement Learning System at Scale (Yu et al., 2025),
    arXiv:2503.14476.
    """

    def __call__(self, batch: RolloutBatch) -> RolloutBatch:
        keep = ~_truncated(batch, "exclude")
        return batch.replace(
            response_mask=batch.response_mask & keep[:, None], bootstrap_values=None
        )


class Penalty:
    """A truncated row's outcome reward is replaced by ``value``: its token_rewards become 0
    except ``value`` at the row's last True position."""

    def __init__(self, value: float = -1.0) -> None:
        self.value = value

    def __call__(self, batch: RolloutBatch) -> RolloutBatch:
        truncated = _truncated(batch, "penalty")[:, None]
        rewards = batch.token_rewards
        penalty = torch.where(
            batch.last_mask,
            torch.full_like(rewards, self.value),
            torch.zeros_like(rewards),
        )
        return batch.replace(
            token_rewards=torch.where(truncated, penalty, rewards), bootstrap_values=None
        )


class SoftOverlong:
    """DAPO's soft overlong punishment, added to the outcome reward at each row's last True
    position by the row's length L (every row, truncated or not), with L_c = max_length - buffer:

        0                               if L <= L_c
        (L_c - L) / buffer * factor     if L_c < L <= max_length
        -factor                         if L > max_length

    DAPO: An Open-Source LLM Reinforcement Learning System at Scale (Yu et al., 2025),
    arXiv:2503.14476.
    """

    def __init__(self, max_length: int, buffer: int, factor: float = 1.0) -> None:
        self.max_length = max_length
        self.buffer = buffer
        self.factor = factor

    def penalty(self, lengths: Tensor) -> Tensor:
        """The punishment for responses of the given lengths, float32 [B]."""
        length = lengths.to(torch.float32)
        start = float(self.max_length - self.buffer)
        ramp = (start - length) / self.buffer * self.factor
        out = torch.where(length > start, ramp, torch.zeros_like(length))
        return torch.where(length > self.max_length, torch.full_like(length, -self.factor), out)

    def __call__(self, batch: RolloutBatch) -> RolloutBatch:
        bonus = self.penalty(batch.lengths)
        return batch.replace(token_rewards=_add_outcome(batch, bonus), bootstrap_values=None)
