"""Prompt weights for the actor loss (``policy.weight``) and the critic loss (``critic.weight``):
``w(batch) -> float32 [B]``, one weight per response (responses to one prompt share it)."""

from __future__ import annotations

import torch
from torch import Tensor

from ppokit.batch import RolloutBatch

__all__ = ["InformativeGroups", "PassRateVariance", "Uniform"]


class Uniform:
    """w = 1 for every response."""

    def __call__(self, batch: RolloutBatch) -> Tensor:
        return torch.ones(batch.batch_size, dtype=torch.float32, device=batch.device)


class PassRateVariance:
    """w = p (1 - p), p = clamp(mean reward of the group, 0, 1): the variance of a Bernoulli
    reward with pass rate p, largest for prompts solved about half the time. With
    ``normalize`` the weights are rescaled to mean 1 over the batch (all-zero weights stay 0).
    """

    def __init__(self, normalize: bool = True) -> None:
        self.normalize = normalize

    def __call__(self, batch: RolloutBatch) -> Tensor:
        p = batch.group_mean(batch.scores).clamp(0.0, 1.0)
        weights = p * (1.0 - p)
        if not self.normalize:
            return weights
        mean = weights.mean()
        return torch.where(mean > 0, weights / mean.clamp_min(1e-30), torch.zeros_like(weights))


class InformativeGroups:
    """w = 1 for rows whose group rewards are not all equal, else 0: DAPO's dynamic sampling
    expressed as a weight.

    DAPO: An Open-Source LLM Reinforcement Learning System at Scale (Yu et al., 2025),
    arXiv:2503.14476.
    """

    def __call__(self, batch: RolloutBatch) -> Tensor:
        scores = batch.scores
        return (batch.group_max(scores) > batch.group_min(scores)).to(torch.float32)
