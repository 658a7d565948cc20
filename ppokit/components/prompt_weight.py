"""Prompt weights for the actor loss (``policy.weight``) and the critic loss (``critic.weight``):
``w(batch) -> float32 [B]``, one weight per response (responses to one prompt share it).

A row without tokens is no response: it weighs 0 and does not count in its group."""

from __future__ import annotations

import torch
from torch import Tensor

from ppokit.batch import RolloutBatch

__all__ = ["InformativeGroups", "PassRateVariance", "Uniform"]


class Uniform:
    """w = 1 for every response (0 for an empty row)."""

    def __call__(self, batch: RolloutBatch) -> Tensor:
        return batch.nonempty.to(torch.float32)


class PassRateVariance:
    """w = p (1 - p), p = clamp(mean reward of the group, 0, 1): the variance of a Bernoulli
    reward with pass rate p, largest for prompts solved about half the time. With
    ``normalize`` the weights are rescaled to mean 1 over the batch's non-empty rows
    (all-zero weights stay 0).
    """

    def __init__(self, normalize: bool = True) -> None:
        self.normalize = normalize

    def __call__(self, batch: RolloutBatch) -> Tensor:
        live = batch.nonempty.to(torch.float32)
        p = batch.group_mean(batch.scores, weights=live).clamp(0.0, 1.0)
        weights = p * (1.0 - p) * live
        if not self.normalize:
            return weights
        mean = weights.sum() / live.sum().clamp_min(1.0)
        return torch.where(mean > 0, weights / mean.clamp_min(1e-30), torch.zeros_like(weights))


class InformativeGroups:
    """w = 1 for rows whose group rewards are not all equal, else 0: DAPO's dynamic sampling
    expressed as a weight.

    DAPO: An Open-Source LLM Reinforcement Learning System at Scale (Yu et al., 2025),
    arXiv:2503.14476.
    """

    def __call__(self, batch: RolloutBatch) -> Tensor:
        scores, live = batch.scores, batch.nonempty
        high = batch.group_max(torch.where(live, scores, -torch.inf))
        low = batch.group_min(torch.where(live, scores, torch.inf))
        return ((high > low) & live).to(torch.float32)
