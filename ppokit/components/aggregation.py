"""Aggregations: ``agg(L, mask, denom=None) -> scalar`` float32.

Each aggregation is ``numerator(L, mask) / denominator(mask)``. The numerator is a sum over
rows, so for any split of the rows into micro-batches

    sum_k agg(L_k, mask_k, denom=agg.denominator(mask)) == agg(L, mask)

and gradient accumulation is exact. Masked positions never contribute (even NaN/inf there),
and an all-masked input gives 0 (denominators are clamped at >= 1).

Masks are bool or float [B, T]; a float mask weights each position (0 = masked).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "Aggregation",
    "SeqMeanTokenMean",
    "SeqMeanTokenSum",
    "SeqMeanTokenSumNorm",
    "TokenMean",
]


def _weights(mask: Tensor) -> Tensor:
    return mask.to(torch.float32)


def _row_sums(values: Tensor, mask: Tensor) -> Tensor:
    """sum_t mask * L per row, float32 [B]; masked positions contribute exactly 0."""
    keep = mask if mask.dtype == torch.bool else mask != 0
    weighted = values.float() * _weights(mask)
    return torch.where(keep, weighted, torch.zeros_like(weighted)).sum(dim=1)


def _nonempty_rows(mask: Tensor) -> Tensor:
    """Number of rows with at least one unmasked position, float32 scalar."""
    return (mask != 0).any(dim=1).sum().to(torch.float32)


class Aggregation:
    """Base: ``agg(L, mask, denom=None) = numerator(L, mask) / (denom or denominator(mask))``."""

    def numerator(self, values: Tensor, mask: Tensor) -> Tensor:
        raise NotImplementedError

    def denominator(self, mask: Tensor) -> Tensor:
        raise NotImplementedError

    def __call__(self, values: Tensor, mask: Tensor, denom: Tensor | float | None = None) -> Tensor:
        if denom is None:
            denom = self.denominator(mask)
        return self.numerator(values, mask) / denom


class TokenMean(Aggregation):
    """Mean over every unmasked token of the batch: sum(mask L) / max(sum(mask), 1).

    Proximal Policy Optimization Algorithms (Schulman et al., 2017), arXiv:1707.06347;
    token-level averaging as in DAPO (Yu et al., 2025), arXiv:2503.14476.
    """

    def numerator(self, values: Tensor, mask: Tensor) -> Tensor:
        return _row_sums(values, mask).sum()

    def denominator(self, mask: Tensor) -> Tensor:
        return _weights(mask).sum().clamp_min(1.0)


class SeqMeanTokenMean(Aggregation):
    """Mean over non-empty rows of each row's token mean:
    (1 / #rows) sum_i [sum_t m_{i,t} L_{i,t} / max(sum_t m_{i,t}, 1)].

    The per-sequence average of GRPO: DeepSeekMath (Shao et al., 2024), arXiv:2402.03300.
    """

    def numerator(self, values: Tensor, mask: Tensor) -> Tensor:
        counts = _weights(mask).sum(dim=1).clamp_min(1.0)
        return (_row_sums(values, mask) / counts).sum()

    def denominator(self, mask: Tensor) -> Tensor:
        return _nonempty_rows(mask).clamp_min(1.0)


class SeqMeanTokenSum(Aggregation):
    """Mean over non-empty rows of each row's token sum: (1 / #rows) sum_i sum_t m_{i,t} L_{i,t}.

    Understanding R1-Zero-Like Training: A Critical Perspective (Liu et al., 2025),
    arXiv:2503.20783.
    """

    def numerator(self, values: Tensor, mask: Tensor) -> Tensor:
        return _row_sums(values, mask).sum()

    def denominator(self, mask: Tensor) -> Tensor:
        return _nonempty_rows(mask).clamp_min(1.0)


class SeqMeanTokenSumNorm(Aggregation):
    """seq_mean_token_sum divided by a constant: (1 / (#rows * norm)) sum_i sum_t m L,
    norm defaulting to T = mask.shape[1] (Dr. GRPO's length-unbiased constant).

    Understanding R1-Zero-Like Training: A Critical Perspective (Liu et al., 2025),
    arXiv:2503.20783.
    """

    def __init__(self, norm: float | None = None) -> None:
        self.norm = norm

    def numerator(self, values: Tensor, mask: Tensor) -> Tensor:
        return _row_sums(values, mask).sum()

    def denominator(self, mask: Tensor) -> Tensor:
        norm = float(max(mask.shape[1], 1)) if self.norm is None else float(self.norm)
        return _nonempty_rows(mask).clamp_min(1.0) * norm
