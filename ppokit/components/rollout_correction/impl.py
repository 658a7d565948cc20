"""Rollout corrections: the tensor code (catalogue: :mod:`ppokit.components.rollout_correction`).

Δ_t = logp_old − logp_rollout over the response mask (0 elsewhere), r_t = exp Δ_t. A ratio
is computed from Δ clamped to ±MAX_LOG_RATIO so that exp never overflows; a clamped ratio is
far outside every bound and cap, so the result is the same.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ppokit.batch import RolloutBatch
from ppokit.components.rollout_correction import (
    GEO_MASK,
    NONE,
    SEQ_MIS,
    SEQ_TIS,
    TOKEN_MIS,
    TOKEN_TIS,
)

#: |log ratio| beyond which exp is not taken (e^30 ≈ 1e13, far beyond any cap or bound).
MAX_LOG_RATIO = 30.0


def log_ratio(batch: RolloutBatch) -> Tensor:
    """Δ_t = logp_old − logp_rollout, float32 [B, T], 0 at masked positions."""
    assert batch.logp_old is not None and batch.logp_rollout is not None
    delta = batch.logp_old.float() - batch.logp_rollout.float()
    return torch.where(batch.response_mask, delta, 0.0)


def _ratio(delta: Tensor) -> Tensor:
    return delta.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp()


def _rows(value: Tensor, batch: RolloutBatch) -> Tensor:
    """A per-row value on every response position of its row, 0 elsewhere."""
    return torch.where(batch.response_mask, value[:, None], 0.0)


class _Reports:
    """What a correction did over the response positions (the catalogue's ``METRICS``): the
    mean weight, the fraction of tokens it zeroed and the fraction of (non-empty) rows it
    zeroed whole."""

    def metrics(self, batch: RolloutBatch, weights: Tensor) -> dict[str, Tensor]:
        mask = batch.response_mask
        tokens = batch.lengths.sum().clamp_min(1)
        zeroed = mask & (weights <= 0)
        rows = batch.nonempty
        whole = rows & (zeroed.sum(1) == batch.lengths)
        return {
            "rollout/correction_weight_mean": torch.where(mask, weights, 0.0).sum() / tokens,
            "rollout/correction_masked_frac": zeroed.sum() / tokens,
            "rollout/correction_masked_rows": whole.sum() / rows.sum().clamp_min(1),
        }


@NONE.implementation
class NoCorrection(_Reports):
    def __call__(self, batch: RolloutBatch) -> Tensor:
        return batch.maskf


@TOKEN_TIS.implementation
class TokenTIS(_Reports):
    def __init__(self, *, cap: float) -> None:
        self.cap = cap

    def __call__(self, batch: RolloutBatch) -> Tensor:
        weights = _ratio(log_ratio(batch)).clamp_max(self.cap)
        return torch.where(batch.response_mask, weights, 0.0)


@TOKEN_MIS.implementation
class TokenMIS(_Reports):
    def __init__(self, *, low: float | None, high: float, rejected: str) -> None:
        self.low = -math.inf if low is None else low
        self.high = high
        self.keeps_rejected = rejected == "zero"

    def __call__(self, batch: RolloutBatch) -> Tensor:
        r = _ratio(log_ratio(batch))
        kept = batch.response_mask & (r >= self.low) & (r <= self.high)
        return torch.where(kept, r, 0.0)


@SEQ_TIS.implementation
class SeqTIS(_Reports):
    def __init__(self, *, cap: float) -> None:
        self.cap = cap

    def __call__(self, batch: RolloutBatch) -> Tensor:
        rho = _ratio(log_ratio(batch).sum(1)).clamp_max(self.cap)
        return _rows(rho, batch)


@SEQ_MIS.implementation
class SeqMIS(_Reports):
    def __init__(self, *, low: float | None, high: float, rejected: str) -> None:
        self.low = -math.inf if low is None else low
        self.high = high
        self.keeps_rejected = rejected == "zero"

    def __call__(self, batch: RolloutBatch) -> Tensor:
        rho = _ratio(log_ratio(batch).sum(1))
        kept = (rho >= self.low) & (rho <= self.high)
        return _rows(torch.where(kept, rho, 0.0), batch)


@GEO_MASK.implementation
class GeoMask(_Reports):
    def __init__(self, *, low: float, high: float) -> None:
        self.low, self.high = low, high

    def __call__(self, batch: RolloutBatch) -> Tensor:
        mean = log_ratio(batch).sum(1) / batch.lengths.clamp_min(1)
        g = _ratio(mean)
        kept = (g >= self.low) & (g <= self.high)
        return _rows(kept.float(), batch)
