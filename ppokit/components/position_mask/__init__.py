"""Position masks of the critic loss: ``m(batch) -> float32 [B, T]`` in {0, 1}.

This module is the torch-free catalogue; the tensor code is
:mod:`ppokit.components.position_mask.impl`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from ppokit import papers
from ppokit.catalogue import Component, Contract, NoParams

if TYPE_CHECKING:
    from torch import Tensor

    from ppokit.batch import RolloutBatch


class PositionMask(Protocol):
    """``m(batch) -> m^V [B, T]`` float32 in {0, 1}."""

    def __call__(self, batch: RolloutBatch) -> Tensor: ...


CONTRACT = Contract("position_mask")
MODULE = "ppokit.components.position_mask.impl"


RESPONSE = Component(
    "position_mask",
    "response",
    MODULE,
    params=NoParams,
    summary="Every response token",
    formula="m_t = response_mask_t",
    source=papers.cite("the general critic loss of ppokit's docs/concepts.md", papers.PPO),
)


COMPLETED = Component(
    "position_mask",
    "completed",
    MODULE,
    params=NoParams,
    summary="Response tokens of rows that ended with EOS (truncated rows get 0)",
    formula="m_t = response_mask_t * (1 - truncated)",
    requires=("truncated",),
    source=papers.cite(papers.TIME_LIMITS, "no value regression on cut-off returns"),
)


LAST_TOKEN = Component(
    "position_mask",
    "last_token",
    MODULE,
    params=NoParams,
    summary="Only each row's last response token",
    formula="m_t = 1 if t is the row's last response position else 0",
    source="ppokit: train the critic on the final state only (an outcome-value critic)",
)

#: Every built-in position_mask component, registered by the default plugin.
ENTRIES: tuple[Component, ...] = (
    RESPONSE,
    COMPLETED,
    LAST_TOKEN,
)
