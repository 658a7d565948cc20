"""The Lite PPO advantage: group-level mean, batch-level standard deviation."""

from __future__ import annotations

import torch
from torch import Tensor

from ppokit.batch import RolloutBatch


class LitePPOAdvantage:
    """A_{i,t} = (R_i − mean_{j∈G(i)} R_j) / (std_batch(R) + ε), broadcast over the response.

    R_i is the row's score (``batch.scores``), G(i) its group (``group_ids``), and
    std_batch the unbiased standard deviation of R over the rows that have response tokens
    (0 with fewer than two such rows). Positions outside the response are 0.

    Source: Part I: Tricks or Traps? A Deep Dive into RL for LLM Reasoning (Liu et al., 2025),
    arXiv:2508.08221 ("Lite PPO": group-level mean with batch-level standard deviation).
    """

    requires = ("group_ids",)

    def __init__(self, eps: float = 1e-6) -> None:
        self.eps = eps

    def __call__(self, batch: RolloutBatch) -> Tensor:
        scores = batch.scores
        valid = (batch.lengths > 0).float()
        count = valid.sum()
        mean = (scores * valid).sum() / count.clamp_min(1.0)
        var = ((scores - mean) ** 2 * valid).sum() / (count - 1.0).clamp_min(1.0)
        adv = (scores - batch.group_mean(scores)) / (var.sqrt() + self.eps)
        return torch.where(batch.response_mask, adv[:, None], torch.zeros((), device=adv.device))
