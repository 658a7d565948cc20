"""Advantage estimators: ``est(batch) -> A [B, T]`` float32, detached, 0 at masked positions.

Token-level estimators run the reverse discounted scan of :mod:`ppokit.components._scan`
(whitening, when asked, happens in the scan's compacted layout). Group estimators compare
each response's score R_i = batch.scores with statistics of its group and broadcast the
result over the row. Group statistics count only the responses with at least one token: an
empty row (all of its mask False, e.g. one cleared by the ``exclude`` truncation rule) is not
a response with reward 0. A group with a single non-empty response has baseline 0 (and, for
GRPO, standard deviation 1).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ppokit.batch import RolloutBatch
from ppokit.components._scan import broadcast_rows, gae, returns_to_go, whiten_rows

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


class GroupStats:
    """Statistics of the scores over each row's group, counting non-empty rows only.

    ``weights`` [B] (default: 1 per non-empty row) weight the mean; rows without tokens
    always weigh 0. All results are per row, float32 [B].
    """

    def __init__(self, batch: RolloutBatch, weights: Tensor | None = None) -> None:
        self.batch = batch
        self.nonempty = batch.nonempty
        live = self.nonempty.float()
        #: number of non-empty rows in the row's group
        self.count = batch.group_sum(live)
        self.weights = live if weights is None else weights.float() * live
        self.scores = batch.scores

    def centred(self) -> Tensor:
        """R_i - (weighted) mean_g R; R_i itself when the group has one non-empty row.

        The mean is taken of R - max_g R and shifted back, so that a group of equal scores
        gives exactly 0 (a rounded mean would leave a residue that GRPO's 1/std turns into
        noise). 0 on empty rows.
        """
        batch, scores = self.batch, self.scores
        shift = batch.group_max(torch.where(self.nonempty, scores, -torch.inf))
        shift = torch.where(self.count > 0, shift, torch.zeros_like(shift))
        shifted = torch.where(self.nonempty, scores - shift, torch.zeros_like(scores))
        centred = shifted - batch.group_mean(shifted, weights=self.weights)
        centred = torch.where(self.count > 1, centred, scores)
        return torch.where(self.nonempty, centred, torch.zeros_like(centred))

    def std(self) -> Tensor:
        """Unbiased std of R over the group's non-empty rows; 1 with fewer than two."""
        centred = self.centred()
        n = self.count
        var = self.batch.group_sum(centred * centred) / (n - 1).clamp_min(1)
        return torch.where(n > 1, var.sqrt(), torch.ones_like(var))


class GAE:
    """A_t = delta_t + gamma * lam * A_next, delta_t = r_t + gamma * V(next) - V_t.

    Batch-whitened when ``whiten``. Source: High-Dimensional Continuous Control Using
    Generalized Advantage Estimation (Schulman et al., 2015), arXiv:1506.02438.
    """

    requires = ("values",)

    def __init__(self, gamma: float = 1.0, lam: float = 0.95, whiten: bool = True) -> None:
        self.gamma, self.lam, self.whiten = gamma, lam, whiten

    def __call__(self, batch: RolloutBatch) -> Tensor:
        return gae(batch, self.gamma, self.lam, whiten=self.whiten)


class MonteCarlo:
    """A_t = G_t - V_t, G_t = r_t + gamma * G_next, G after the last token = terminal value.

    Batch-whitened when ``whiten``. Source: Proximal Policy Optimization Algorithms
    (Schulman et al., 2017), arXiv:1707.06347 (Monte-Carlo advantage with a value baseline).
    """

    requires = ("values",)

    def __init__(self, gamma: float = 1.0, whiten: bool = False) -> None:
        self.gamma, self.whiten = gamma, whiten

    def __call__(self, batch: RolloutBatch) -> Tensor:
        return returns_to_go(
            batch, self.gamma, bootstrap=True, minus_values=True, whiten=self.whiten
        )


class LengthAdaptiveGAE:
    """GAE with a per-row lam = clamp(1 - 1 / (alpha * length), 0, 1).

    Batch-whitened when ``whiten``. Source: VAPO: Efficient and Reliable Reinforcement Learning
    for Advanced Reasoning Tasks (Yue et al., 2025), arXiv:2504.05118.
    """

    requires = ("values",)

    def __init__(self, gamma: float = 1.0, alpha: float = 0.05, whiten: bool = True) -> None:
        self.gamma, self.alpha, self.whiten = gamma, alpha, whiten

    def lam(self, batch: RolloutBatch) -> Tensor:
        """The per-row lam, float32 [B] (0 for an empty row)."""
        lengths = batch.lengths.float()
        return (1.0 - 1.0 / (self.alpha * lengths)).clamp(0.0, 1.0)

    def __call__(self, batch: RolloutBatch) -> Tensor:
        return gae(batch, self.gamma, self.lam(batch), whiten=self.whiten)


class GRPO:
    """A_i = (R_i - mean_g R) / (std_g R + eps), std unbiased, broadcast over the row.

    Group statistics over the non-empty rows. Source: DeepSeekMath: Pushing the Limits of
    Mathematical Reasoning in Open Language Models (Shao et al., 2024), arXiv:2402.03300.
    """

    requires = ("group_ids",)

    def __init__(self, eps: float = 1e-6) -> None:
        self.eps = eps

    def __call__(self, batch: RolloutBatch) -> Tensor:
        stats = GroupStats(batch)
        adv = stats.centred() / (stats.std() + self.eps)
        return broadcast_rows(adv, batch.response_mask)


class DrGRPO:
    """A_i = R_i - mean_g R, broadcast over the row (GRPO without the std normalisation).

    Group mean over the non-empty rows. Source: Understanding R1-Zero-Like Training: A
    Critical Perspective (Liu et al., 2025), arXiv:2503.20783.
    """

    requires = ("group_ids",)

    def __call__(self, batch: RolloutBatch) -> Tensor:
        return broadcast_rows(GroupStats(batch).centred(), batch.response_mask)


class RLOO:
    """A_i = R_i - mean_{j != i} R_j = n / (n - 1) * (R_i - mean_g R); A_i = R_i alone.

    n counts the group's non-empty rows. Source: Back to Basics: Revisiting REINFORCE Style
    Optimization for Learning from Human Feedback in LLMs (Ahmadian et al., 2024),
    arXiv:2402.14740.
    """

    requires = ("group_ids",)

    def __call__(self, batch: RolloutBatch) -> Tensor:
        stats = GroupStats(batch)
        n = stats.count
        scale = torch.where(n > 1, n / (n - 1).clamp_min(1), 1.0)
        return broadcast_rows(scale * stats.centred(), batch.response_mask)


class ReinforcePP:
    """A_t = batch-whitened reward-to-go G_t = r_t + gamma * G_next (G = 0 after the last token).

    Source: REINFORCE++: A Simple and Efficient Approach for Aligning Large Language Models
    (Hu, 2025), arXiv:2501.03262.
    """

    def __init__(self, gamma: float = 1.0) -> None:
        self.gamma = gamma

    def __call__(self, batch: RolloutBatch) -> Tensor:
        return returns_to_go(batch, self.gamma, bootstrap=False, whiten=True)


class ReinforcePPBaseline:
    """A_i = R_i - mean_g R broadcast over the row, then batch-whitened over all tokens.

    Group mean over the non-empty rows. Source: REINFORCE++: A Simple and Efficient Approach
    for Aligning Large Language Models (Hu, 2025), arXiv:2501.03262 (the group-baseline
    variant).
    """

    requires = ("group_ids",)

    def __call__(self, batch: RolloutBatch) -> Tensor:
        centred = GroupStats(batch).centred()
        return broadcast_rows(whiten_rows(centred, batch.lengths), batch.response_mask)


class ReMax:
    """A_t = sum_{s >= t} r_s - b_i, with b_i the score of the greedy baseline response.

    Source: ReMax: A Simple, Effective, and Efficient Reinforcement Learning Method for Aligning
    Large Language Models (Li et al., 2024), arXiv:2310.10505.
    """

    requires = ("baseline_rewards",)

    def __call__(self, batch: RolloutBatch) -> Tensor:
        return returns_to_go(batch, 1.0, bootstrap=False, baseline=batch.baseline_rewards)


class OPO:
    """A_i = R_i - sum_j l_j R_j / sum_j l_j over the group, l = response length.

    The length-weighted baseline is optimal for sequence-level rewards; a group with one
    non-empty row has baseline 0. Source: On-Policy RL with Optimal Reward Baseline (Hao et
    al., 2025), arXiv:2505.23585.
    """

    requires = ("group_ids",)

    def __call__(self, batch: RolloutBatch) -> Tensor:
        adv = GroupStats(batch, weights=batch.lengths).centred()
        return broadcast_rows(adv, batch.response_mask)
