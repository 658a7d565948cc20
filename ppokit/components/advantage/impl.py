"""Tensor code of the advantage estimators (catalogue: :mod:`ppokit.components.advantage`)."""

from __future__ import annotations

import torch
from torch import Tensor

from ppokit.batch import RolloutBatch
from ppokit.components import advantage as catalogue
from ppokit.ops import GroupStats, broadcast_rows, gae, returns_to_go, whiten_rows

__all__ = [
    "GAE",
    "GDPO",
    "GRPO",
    "OPO",
    "RLOO",
    "DrGRPO",
    "LengthAdaptiveGAE",
    "MonteCarlo",
    "ReMax",
    "ReinforcePP",
    "ReinforcePPBaseline",
    "batch_std",
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
    """std is unbiased, over the group's non-empty rows (1 with fewer than two); with
    ``std: batch`` over the batch's non-empty rows (0 with fewer than two, so that a
    batch of one response gets its centred reward / ε, as TRL's)."""

    def __init__(self, *, eps: float, std: str) -> None:
        self.eps = eps
        self.batch_std = std == "batch"

    def __call__(self, batch: RolloutBatch) -> Tensor:
        stats = GroupStats(batch)
        std = batch_std(batch) if self.batch_std else stats.std()
        adv = stats.centred() / (std + self.eps)
        return broadcast_rows(adv, batch.response_mask)


def batch_std(batch: RolloutBatch) -> Tensor:
    """The unbiased std of the scores over the batch's non-empty rows (0-d)."""
    live = batch.nonempty.float()
    count = live.sum()
    mean = (batch.scores * live).sum() / count.clamp_min(1.0)
    var = ((batch.scores - mean) ** 2 * live).sum() / (count - 1.0).clamp_min(1.0)
    return var.sqrt()


@catalogue.GDPO.implementation
class GDPO:
    """r_k are the batch's ``reward_parts`` (each reward's own score, an environment's turn
    rewards last) and w_k its ``reward_weights``; each A_k follows GRPO's group convention
    (std unbiased over the group's non-empty rows, 1 with fewer than two; a group of equal
    scores gives 0), so a reward every response of a group got alike adds nothing there,
    however the others vary. The batch normalisation counts each non-empty response once.
    Equal to GRPO followed by the batch normalisation when there is one reward."""

    def __init__(self, *, eps: float) -> None:
        self.eps = eps

    def parts(self, batch: RolloutBatch) -> Tensor:
        """A_k, each reward normalised within its groups, float32 [B, K] (0 on empty rows)."""
        parts = batch.reward_parts
        assert parts is not None  # required
        columns = []
        for k in range(parts.shape[1]):  # K reward parts: a few
            stats = GroupStats(batch, values=parts[:, k])
            columns.append(stats.centred() / (stats.std() + self.eps))
        return torch.stack(columns, 1)

    def __call__(self, batch: RolloutBatch) -> Tensor:
        weights = batch.reward_weights
        assert weights is not None  # required
        summed = (self.parts(batch) * weights.float()).sum(1)
        live = batch.nonempty
        adv = whiten_rows(summed, live.long())
        return broadcast_rows(torch.where(live, adv, 0.0), batch.response_mask)


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
