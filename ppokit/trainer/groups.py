"""What a round's generation batches add up to (DAPO's dynamic sampling, arXiv:2503.14476,
section 3.2, fills a round batch after batch: :func:`~ppokit.trainer.producers.filling.fill`):
:class:`GroupBatch`, groups of ``rollout.n`` responses with their rewards and the groups the
filter passed; :class:`Generated`, every generated response's sums in fixed size;
:class:`Filled`, the round's kept groups and the filter's counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ppokit import distributed
from ppokit.metrics_table import FLOPS_GENERATE
from ppokit.trainer.flops import Shape
from ppokit.trainer.rollout import Rollout
from ppokit.trainer.scoring import Scores

__all__ = ["Filled", "Generated", "GroupBatch"]


@dataclass
class GroupBatch:
    """Groups of ``rollout.n`` responses, in order: their data ``rows`` and ``formatted``
    prompts, the responses, their rewards (R [B], each reward's scores and flags) and
    texts, and ``keep``: the indices of the groups that passed the filter."""

    rows: list[dict[str, Any]]
    formatted: list[str]
    rollout: Rollout
    scores: Scores
    texts: list[str]
    keep: list[int]


class Generated:
    """What every generated response of a round's batches adds up to, on this process, in
    sums of fixed size (memory stays flat over any number of generation batches): how
    many, R's sum and its sum of squares about the first score (its shift), R's least and
    largest values, the lengths and truncations summed, the positions generation ran and
    their causal attention pairs (for its FLOPs: :mod:`~ppokit.trainer.flops`), the groups
    and those whose rewards are all equal, the responses scored below and above their
    group's mean R and their lengths, each reward's scores summed and each flag a reward
    raised counted (``names``, ``flags``: those of the first batch). :meth:`metrics`
    combines the processes' sums (one gather) into the round's statistics."""

    #: The sums' fields, then one sum per reward.
    FIELDS = (
        "count",
        "shift",
        "sum",
        "sumsq",
        "min",
        "max",
        "length",
        "truncated",
        "positions",
        "pairs",
    )
    GROUP_FIELDS = ("groups", "equal", "below", "below_length", "above", "above_length")

    def __init__(self, n: int, names: list[str], flags: list[str], device: torch.device) -> None:
        self.n = n
        self.names = names
        self.flags = flags
        dtype = torch.float32 if device.type == "mps" else torch.float64
        width = len(self.FIELDS) + len(self.GROUP_FIELDS) + len(names) + len(flags)
        self.sums = torch.zeros(width, dtype=dtype, device=device)
        self.first = True

    def add(self, scores: Scores, lengths: Tensor, truncated: Tensor, positions: Tensor) -> None:
        """Fold one batch's responses in (no host read); ``positions``: per row, the
        positions its generation ran the model at (prompt + response − 1, 0 for an empty
        response: the last token is sampled, never fed)."""
        s = scores.total.detach().to(self.sums.dtype)
        if self.first:
            self.sums[1] = s[0]
            self.sums[4], self.sums[5] = s.min(), s.max()
            self.first = False
        shifted = s - self.sums[1]
        groups = s.view(-1, self.n)
        equal = (groups.amax(1) == groups.amin(1)).sum()
        centred = groups - groups.mean(1, keepdim=True)
        varies = groups.amax(1, keepdim=True) > groups.amin(1, keepdim=True)  # 0.1 * 8 / 8
        below, above = ((centred < 0) & varies).to(s.dtype), ((centred > 0) & varies).to(s.dtype)
        grouped = lengths.to(s.dtype).view(-1, self.n)
        batch = [
            s.new_tensor(float(s.numel())),
            s.new_zeros(()),
            shifted.sum(),
            (shifted * shifted).sum(),
            s.new_zeros(()),
            s.new_zeros(()),
            lengths.to(s.dtype).sum(),
            truncated.to(s.dtype).sum(),
            positions.to(s.dtype).sum(),
            (positions.to(s.dtype) * (positions.to(s.dtype) + 1) / 2).sum(),
            s.new_tensor(float(groups.shape[0])),
            equal.to(s.dtype),
            below.sum(),
            (below * grouped).sum(),
            above.sum(),
            (above * grouped).sum(),
            *(scores.parts[name].detach().to(s.dtype).sum() for name in self.names),
            *(
                scores.flags[name].detach().to(s.dtype).sum()
                if name in scores.flags
                else s.new_zeros(())
                for name in self.flags
            ),
        ]
        self.sums += torch.stack(batch)
        self.sums[4] = torch.minimum(self.sums[4], s.min())
        self.sums[5] = torch.maximum(self.sums[5], s.max())

    def metrics(self, groups: bool, shape: Shape | None = None) -> dict[str, Tensor]:
        """The round's ``reward_mean``, ``reward_std``, ``response_length_mean``,
        ``truncated_frac``, ``tokens``; with the actor's ``shape``, ``flops_generate``; with
        ``groups`` ``rollout/zero_variance_groups`` and
        ``response_length_below_group`` / ``_above_group`` (the mean length of the responses
        scored below / above their group's mean R: negative / positive advantage under a
        group baseline; NaN, logged as null, in a round without any);
        with several rewards each one's mean (``reward/<name>``); each flag a reward raised,
        the fraction of the responses it was raised on (``reward/<name>/<flag>_frac``): over
        every process."""
        rows = self.sums[None]
        if distributed.world().distributed:
            rows = distributed.gather_rows(rows)
        count, shift, total, squares, low, high = (rows[:, i] for i in range(6))
        n = count.sum()
        means = shift + total / count
        mean = (count * means).sum() / n
        within = squares - total * total / count
        spread = (within + count * (means - mean) ** 2).sum().clamp(min=0)
        std = (spread / (n - 1).clamp(min=1)).sqrt()
        std = torch.where(low.min() == high.max(), std.new_zeros(()), std)
        summed = rows[:, 6:].sum(0)
        metrics = {
            "reward_mean": mean,
            "reward_std": std,
            "response_length_mean": summed[0] / n,
            "truncated_frac": summed[1] / n,
            "tokens": summed[0],
        }
        if shape is not None:
            metrics[FLOPS_GENERATE] = shape.of_sums(summed[2], summed[3])
        if groups:
            metrics["rollout/zero_variance_groups"] = summed[5] / summed[4]
            for side, i in (("below", 6), ("above", 8)):
                length = torch.where(summed[i] > 0, summed[i + 1] / summed[i], torch.nan)
                metrics[f"response_length_{side}_group"] = length
        parts = len(self.FIELDS) - 6 + len(self.GROUP_FIELDS)  # the sums after the first six
        if len(self.names) > 1:
            for i, name in enumerate(self.names):
                metrics[f"reward/{name}"] = summed[parts + i] / n
        for i, name in enumerate(self.flags):
            metrics[f"reward/{name}_frac"] = summed[parts + len(self.names) + i] / n
        return {k: v.float() for k, v in metrics.items()}


@dataclass
class Filled:
    """The round's kept groups (``kept``: None when no group passed) and what was generated
    to find them."""

    kept: GroupBatch | None
    #: every generated response of this process: R, each reward's scores, lengths, truncation
    generated: Generated
    #: whole-round counts, the same on every process
    kept_groups: int = 0
    passed_groups: int = 0
    generated_groups: int = 0
    batches: int = 0
    #: the bound stopped the drawing before the round was full
    exhausted: bool = False
    #: a filter ran (False for one that keeps every group: no counts to report)
    filtered: bool = True

    def metrics(self, device: torch.device) -> dict[str, Tensor]:
        """``rollout/kept_groups``, ``_passed_groups``, ``_generated_groups``,
        ``_generation_batches`` and ``_exhausted`` (whole-round), when a filter ran."""
        if not self.filtered:
            return {}
        values = {
            "rollout/kept_groups": self.kept_groups,
            "rollout/passed_groups": self.passed_groups,
            "rollout/generated_groups": self.generated_groups,
            "rollout/generation_batches": self.batches,
            "rollout/exhausted": float(self.exhausted),
        }
        return {k: torch.full((), float(v), device=device) for k, v in values.items()}
