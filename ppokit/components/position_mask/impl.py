"""Tensor code of the critic's position masks (catalogue: :mod:`ppokit.components.position_mask`)."""

from __future__ import annotations

import torch
from torch import Tensor

from ppokit.batch import RolloutBatch
from ppokit.components import position_mask as catalogue

__all__ = ["CompletedMask", "LastTokenMask", "ResponseMask"]


@catalogue.RESPONSE.implementation
class ResponseMask:
    def __call__(self, batch: RolloutBatch) -> Tensor:
        return batch.maskf


@catalogue.COMPLETED.implementation
class CompletedMask:
    """Truncated rows have no observed outcome, so their value targets are left out."""

    def __call__(self, batch: RolloutBatch) -> Tensor:
        if batch.truncated is None:
            raise ValueError("the 'completed' position mask needs batch.truncated")
        return batch.maskf * (~batch.truncated).to(torch.float32)[:, None]


@catalogue.LAST_TOKEN.implementation
class LastTokenMask:
    def __call__(self, batch: RolloutBatch) -> Tensor:
        return batch.last_mask.to(torch.float32)
