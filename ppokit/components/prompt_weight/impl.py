"""Tensor code of the prompt weights (catalogue: :mod:`ppokit.components.prompt_weight`)."""

from __future__ import annotations

import torch
from torch import Tensor

from ppokit.batch import RolloutBatch
from ppokit.components import prompt_weight as catalogue

__all__ = ["InformativeGroups", "PassRateVariance", "Uniform", "Untruncated"]


@catalogue.UNIFORM.implementation
class Uniform:
    def __call__(self, batch: RolloutBatch) -> Tensor:
        return batch.nonempty.to(torch.float32)


@catalogue.PASS_RATE_VARIANCE.implementation
class PassRateVariance:
    """All-zero weights stay 0 under ``normalize``."""

    def __init__(self, *, normalize: bool) -> None:
        self.normalize = normalize

    def __call__(self, batch: RolloutBatch) -> Tensor:
        live = batch.nonempty.to(torch.float32)
        p = batch.group_mean(batch.scores, weights=live).clamp(0.0, 1.0)
        weights = p * (1.0 - p) * live
        if not self.normalize:
            return weights
        mean = weights.sum() / live.sum().clamp_min(1.0)
        return torch.where(mean > 0, weights / mean.clamp_min(1e-30), torch.zeros_like(weights))


@catalogue.INFORMATIVE_GROUPS.implementation
class InformativeGroups:
    def __call__(self, batch: RolloutBatch) -> Tensor:
        scores, live = batch.scores, batch.nonempty
        high = batch.group_max(torch.where(live, scores, -torch.inf))
        low = batch.group_min(torch.where(live, scores, torch.inf))
        return ((high > low) & live).to(torch.float32)


@catalogue.UNTRUNCATED.implementation
class Untruncated:
    def __call__(self, batch: RolloutBatch) -> Tensor:
        if batch.truncated is None:
            raise ValueError("the 'untruncated' prompt weight needs batch.truncated")
        return (batch.nonempty & ~batch.truncated.bool()).to(torch.float32)
