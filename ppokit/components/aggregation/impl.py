"""Tensor code of the aggregations (catalogue: :mod:`ppokit.components.aggregation`)."""

from __future__ import annotations

import torch
from torch import Tensor

from ppokit.components import aggregation as catalogue
from ppokit.ops import bool_mask

__all__ = [
    "RatioAggregation",
    "SeqMeanTokenMean",
    "SeqMeanTokenSum",
    "SeqMeanTokenSumNorm",
    "TokenMean",
]


def _weights(mask: Tensor) -> Tensor:
    return mask.to(torch.float32)


def _row_sums(values: Tensor, mask: Tensor) -> Tensor:
    """sum_t mask * L per row, float32 [B]; masked positions contribute exactly 0."""
    keep = bool_mask(mask)
    weighted = values.float() * _weights(mask)
    return torch.where(keep, weighted, torch.zeros_like(weighted)).sum(dim=1)


def _nonempty_rows(mask: Tensor) -> Tensor:
    """Number of rows with at least one unmasked position, float32 scalar."""
    return (mask != 0).any(dim=1).sum().to(torch.float32)


class _Rows:
    """#rows of a seq-mean: the non-empty rows of the mask, or all of them."""

    def __init__(self, *, rows: str) -> None:
        self.rows = rows

    def count(self, mask: Tensor) -> Tensor:
        if self.rows == "all":
            return torch.tensor(float(mask.shape[0]), device=mask.device)
        return _nonempty_rows(mask)


class RatioAggregation:
    """Base: ``agg(L, mask, denom=None) = numerator(L, mask) / (denom or denominator(mask))``."""

    def numerator(self, values: Tensor, mask: Tensor) -> Tensor:
        raise NotImplementedError

    def denominator(self, mask: Tensor) -> Tensor:
        raise NotImplementedError

    def __call__(self, values: Tensor, mask: Tensor, denom: Tensor | float | None = None) -> Tensor:
        if denom is None:
            denom = self.denominator(mask)
        return self.numerator(values, mask) / denom


@catalogue.TOKEN_MEAN.implementation
class TokenMean(RatioAggregation):
    def numerator(self, values: Tensor, mask: Tensor) -> Tensor:
        return _row_sums(values, mask).sum()

    def denominator(self, mask: Tensor) -> Tensor:
        return _weights(mask).sum().clamp_min(1.0)


@catalogue.SEQ_MEAN_TOKEN_MEAN.implementation
class SeqMeanTokenMean(_Rows, RatioAggregation):
    """The per-sequence average of GRPO."""

    def numerator(self, values: Tensor, mask: Tensor) -> Tensor:
        counts = _weights(mask).sum(dim=1).clamp_min(1.0)
        return (_row_sums(values, mask) / counts).sum()

    def denominator(self, mask: Tensor) -> Tensor:
        return self.count(mask).clamp_min(1.0)


@catalogue.SEQ_MEAN_TOKEN_SUM.implementation
class SeqMeanTokenSum(_Rows, RatioAggregation):
    def numerator(self, values: Tensor, mask: Tensor) -> Tensor:
        return _row_sums(values, mask).sum()

    def denominator(self, mask: Tensor) -> Tensor:
        return self.count(mask).clamp_min(1.0)


@catalogue.SEQ_MEAN_TOKEN_SUM_NORM.implementation
class SeqMeanTokenSumNorm(_Rows, RatioAggregation):
    """Dr. GRPO's length-unbiased constant; norm = None is T = mask.shape[1]."""

    def __init__(self, *, norm: float | None, rows: str) -> None:
        super().__init__(rows=rows)
        self.norm = norm

    def numerator(self, values: Tensor, mask: Tensor) -> Tensor:
        return _row_sums(values, mask).sum()

    def denominator(self, mask: Tensor) -> Tensor:
        norm = float(max(mask.shape[1], 1)) if self.norm is None else float(self.norm)
        return self.count(mask).clamp_min(1.0) * norm
