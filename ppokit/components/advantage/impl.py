"""Tensor code of the advantage estimators (catalogue: :mod:`ppokit.components.advantage`)."""

from __future__ import annotations

import torch
from torch import Tensor

from ppokit.batch import RolloutBatch
from ppokit.components import advantage as catalogue
from ppokit.ops import GroupStats, broadcast_rows, gae, returns_to_go, whiten_rows

__all__ = [
    "GAE",
    "GRPO",
    "OPO",
    "RLOO",
    "DrGRPO",
    "LengthAdaptiveGAE",
    "MonteCarlo",
    "ReMax",
    "ReinforcePP",
    "ReinforcePPBaseline",
]


@catalogue.GAE.implementation
class GAE:
    def __init__(self, *, gamma: float, lam: float, whiten: bool) -> None:
        self.gamma, self.lam, self.whiten = gamma, lam, whiten

    def __call__(self, batch: RolloutBatch) -> Tensor:
        return gae(batch, self.gamma, self.lam, whiten=self.whiten)


@catalogue.MC.implementation
class MonteCarlo:
    """G after the last token is the terminal value (the critic's, on a bootstrapped row)."""

    def __init__(self, *, gamma: float, whiten: bool) -> None:
        self.gamma, self.whiten = gamma, whiten

    def __call__(self, batch: RolloutBatch) -> Tensor:
        return returns_to_go(
            batch, self.gamma, bootstrap=True, minus_values=True, whiten=self.whiten
        )


@catalogue.LENGTH_ADAPTIVE_GAE.implementation
class LengthAdaptiveGAE:
    def __init__(self, *, gamma: float, alpha: float, whiten: bool) -> None:
        self.gamma, self.alpha, self.whiten = gamma, alpha, whiten

    def lam(self, batch: RolloutBatch) -> Tensor:
        """The per-row lam, float32 [B] (0 for an empty row)."""
        lengths = batch.lengths.float()
        return (1.0 - 1.0 / (self.alpha * lengths)).clamp(0.0, 1.0)

    def __call__(self, batch: RolloutBatch) -> Tensor:
        return gae(batch, self.gamma, self.lam(batch), whiten=self.whiten)


@catalogue.GRPO.implementation
class GRPO:
    """std is unbiased, over the group's non-empty rows (1 with fewer than two)."""

    def __init__(self, *, eps: float) -> None:
        self.eps = eps

    def __call__(self, batch: RolloutBatch) -> Tensor:
        stats = GroupStats(batch)
        adv = stats.centred() / (stats.std() + self.eps)
        return broadcast_rows(adv, batch.response_mask)


@catalogue.DR_GRPO.implementation
class DrGRPO:
    def __call__(self, batch: RolloutBatch) -> Tensor:
        return broadcast_rows(GroupStats(batch).centred(), batch.response_mask)


@catalogue.RLOO.implementation
class RLOO:
    """A group with one non-empty row has A_i = R_i."""

    def __call__(self, batch: RolloutBatch) -> Tensor:
        stats = GroupStats(batch)
        n = stats.count
        scale = torch.where(n > 1, n / (n - 1).clamp_min(1), 1.0)
        return broadcast_rows(scale * stats.centred(), batch.response_mask)


@catalogue.REINFORCE_PP.implementation
class ReinforcePP:
    """G = 0 after the last token (no critic)."""

    def __init__(self, *, gamma: float) -> None:
        self.gamma = gamma

    def __call__(self, batch: RolloutBatch) -> Tensor:
        return returns_to_go(batch, self.gamma, bootstrap=False, whiten=True)


@catalogue.REINFORCE_PP_BASELINE.implementation
class ReinforcePPBaseline:
    def __call__(self, batch: RolloutBatch) -> Tensor:
        centred = GroupStats(batch).centred()
        return broadcast_rows(whiten_rows(centred, batch.lengths), batch.response_mask)


@catalogue.REMAX.implementation
class ReMax:
    def __call__(self, batch: RolloutBatch) -> Tensor:
        return returns_to_go(batch, 1.0, bootstrap=False, baseline=batch.baseline_rewards)


@catalogue.OPO.implementation
class OPO:
    """The length-weighted baseline is optimal for sequence-level rewards; a group with one
    non-empty row has baseline 0."""

    def __call__(self, batch: RolloutBatch) -> Tensor:
        adv = GroupStats(batch, weights=batch.lengths).centred()
        return broadcast_rows(adv, batch.response_mask)
