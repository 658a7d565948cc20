"""Tensor code of the Lite PPO advantage (catalogue: ``ppokit_example.plugin``)."""

from __future__ import annotations

import torch
from torch import Tensor

from ppokit.batch import RolloutBatch
from ppokit.ops import broadcast_rows
from ppokit_example.plugin import LITE_PPO


@LITE_PPO.implementation
class LitePPOAdvantage:
    """R_i is the row's score (``batch.scores``) and G(i) its group (``group_ids``); the
    batch std is unbiased, 0 with fewer than two rows that have response tokens."""

    def __init__(self, *, eps: float) -> None:
        self.eps = eps

    def __call__(self, batch: RolloutBatch) -> Tensor:
        valid = batch.nonempty.float()
        scores = batch.scores
        count = valid.sum()
        mean = (scores * valid).sum() / count.clamp_min(1.0)
        var = ((scores - mean) ** 2 * valid).sum() / (count - 1.0).clamp_min(1.0)
        # centred about the group's largest score first: a group of nearly equal scores
        # then leaves no rounding residue for a small batch std to magnify
        top = batch.group_max(torch.where(batch.nonempty, scores, -torch.inf))
        shifted = scores - torch.where(torch.isfinite(top), top, 0.0)
        adv = (shifted - batch.group_mean(shifted)) / (var.sqrt() + self.eps)
        return broadcast_rows(adv, batch.response_mask)
