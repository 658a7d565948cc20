"""Position masks for the critic loss: ``m(batch) -> float32 [B, T]`` in {0, 1}."""

from __future__ import annotations

import torch
from torch import Tensor

from ppokit.batch import RolloutBatch

__all__ = ["CompletedMask", "LastTokenMask", "ResponseMask"]


class ResponseMask:
    """m_t = 1 on every response token (the response mask)."""

    def __call__(self, batch: RolloutBatch) -> Tensor:
        return batch.maskf


class CompletedMask:
    """m_t = 1 on the response tokens of rows that ended with EOS; truncated rows get 0.

    Truncated rows have no observed outcome, so their value targets are left out.
    """

    def __call__(self, batch: RolloutBatch) -> Tensor:
        if batch.truncated is None:
            raise ValueError("the 'completed' position mask needs batch.truncated")
        return batch.maskf * (~batch.truncated).to(torch.float32)[:, None]


class LastTokenMask:
    """m_t = 1 only on each row's last response token (the state whose value is the outcome)."""

    def __call__(self, batch: RolloutBatch) -> Tensor:
        return batch.last_mask.to(torch.float32)
