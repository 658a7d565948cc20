"""Tensor code of the truncation rules (catalogue: :mod:`ppokit.components.truncation`)."""

from __future__ import annotations

import torch
from torch import Tensor

from ppokit.batch import RolloutBatch
from ppokit.components import truncation as catalogue

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


@catalogue.TERMINAL.implementation
class Terminal:
    def __call__(self, batch: RolloutBatch) -> RolloutBatch:
        return batch.replace(bootstrap_values=None)


@catalogue.BOOTSTRAP.implementation
class Bootstrap:
    """Keeps ``bootstrap_values``: partial-episode bootstrapping."""

    def __call__(self, batch: RolloutBatch) -> RolloutBatch:
        _truncated(batch, "bootstrap")
        if batch.bootstrap_values is None:
            raise ValueError("the 'bootstrap' truncation rule needs batch.bootstrap_values")
        return batch


@catalogue.EXCLUDE.implementation
class Exclude:
    """A removed row is no response: it counts in no group statistic."""

    def __call__(self, batch: RolloutBatch) -> RolloutBatch:
        keep = ~_truncated(batch, "exclude")
        return batch.replace(
            response_mask=batch.response_mask & keep[:, None], bootstrap_values=None
        )


@catalogue.PENALTY.implementation
class Penalty:
    """The row's token_rewards become 0 except ``value`` at its last True position."""

    def __init__(self, *, value: float) -> None:
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


@catalogue.SOFT_OVERLONG.implementation
class SoftOverlong:
    """Added at each row's last True position, every row, truncated or not."""

    def __init__(self, *, max_length: int, buffer: int, factor: float) -> None:
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
