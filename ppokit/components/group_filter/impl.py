"""Group filters: the tensor code (catalogue: :mod:`ppokit.components.group_filter`).

Each returns bool [G] on the rewards' device, without a host read.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ppokit.components.group_filter import (
    INFORMATIVE,
    NONE,
    NOT_ALL_TRUNCATED,
    PASS_RATE,
    Groups,
)


@NONE.implementation
class KeepAll:
    keeps_all = True  # the trainer need not call it

    def __call__(self, groups: Groups) -> Tensor:
        return torch.ones(groups.rewards.shape[0], dtype=torch.bool, device=groups.rewards.device)


@INFORMATIVE.implementation
class Informative:
    def __init__(self, *, tolerance: float) -> None:
        self.tolerance = tolerance

    def __call__(self, groups: Groups) -> Tensor:
        # float64: n equal float32 rewards give a std of exactly 0 (their mean is exact)
        r = groups.rewards.double()
        if r.shape[1] < 2:  # a group of one has no spread
            return torch.zeros(r.shape[0], dtype=torch.bool, device=r.device)
        keep = r.std(dim=1) > self.tolerance  # NaN rewards: not kept
        if groups.parts is not None and groups.weights is not None:
            # a part of weight 0 is in no estimate: its spread informs nothing
            spread = groups.parts.double().std(dim=1) > self.tolerance  # [G, K]
            keep = keep | (spread & (groups.weights != 0)).any(dim=1)
        return keep


@NOT_ALL_TRUNCATED.implementation
class NotAllTruncated:
    def __call__(self, groups: Groups) -> Tensor:
        return ~groups.truncated.all(dim=1)


@PASS_RATE.implementation
class PassRate:
    def __init__(self, *, low: float, high: float, correct_at: float) -> None:
        self.low, self.high, self.correct_at = low, high, correct_at

    def __call__(self, groups: Groups) -> Tensor:
        rate = (groups.rewards >= self.correct_at).double().mean(dim=1)
        return (rate >= self.low) & (rate <= self.high)
