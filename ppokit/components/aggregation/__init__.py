"""Aggregations: ``agg(L, mask, denom=None) -> scalar`` float32.

Each aggregation is ``numerator(L, mask) / denominator(mask)``. The numerator is a sum over
rows, so for any split of the rows into micro-batches

    sum_k agg(L_k, mask_k, denom=agg.denominator(mask)) == agg(L, mask)

and gradient accumulation is exact. Masked positions never contribute (even NaN/inf there),
and an all-masked input gives 0 (denominators are clamped at >= 1). Masks are bool or float
[B, T]; a float mask weights each position (0 = masked).

This module is the torch-free catalogue; the tensor code is
:mod:`ppokit.components.aggregation.impl`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, Protocol

from pydantic import Field

from ppokit import papers
from ppokit.catalogue import Component, Contract, NoParams, Params

if TYPE_CHECKING:
    from torch import Tensor


class Aggregation(Protocol):
    """``agg(L, mask, denom=None) -> scalar``.

    Optional: ``denominator(mask) -> scalar``, so that ``agg(L, mask, denom=d)`` is
    ``numerator / d``: the trainer passes the whole minibatch's denominator to every
    micro-batch (exact gradient accumulation)."""

    def __call__(
        self, values: Tensor, mask: Tensor, denom: Tensor | float | None = None
    ) -> Tensor: ...


CONTRACT = Contract(
    "scalar",
    differentiable="values",
    optional={"denominator": "the scalar denominator of a mask: agg(L, mask, denom=d)"},
)
MODULE = "ppokit.components.aggregation.impl"


class SeqMeanParams(Params):
    rows: Literal["nonempty", "all"] = Field(
        "nonempty",
        description="#rows: the rows with a token in the mask (nonempty) or every row of the "
        "minibatch, rows out of the mask (excluded, weight 0, rejected) included (all: TRL's "
        "grpo and dr_grpo)",
    )


class SeqMeanTokenSumNormParams(SeqMeanParams):
    norm: float | None = Field(
        None, gt=0, description="constant divisor (None: T, the padded response length)"
    )


TOKEN_MEAN = Component(
    "aggregation",
    "token_mean",
    MODULE,
    params=NoParams,
    summary="Mean over every unmasked token of the batch",
    formula="sum(m L) / max(sum(m), 1)",
    source=str(papers.DAPO),
)


SEQ_MEAN_TOKEN_MEAN = Component(
    "aggregation",
    "seq_mean_token_mean",
    MODULE,
    params=SeqMeanParams,
    summary="Mean over the rows (non-empty ones by default: rows) of each row's token mean (GRPO)",
    formula="(1 / #rows) sum_i [sum_t m L / max(sum_t m, 1)]",
    source=str(papers.GRPO),
)


SEQ_MEAN_TOKEN_SUM = Component(
    "aggregation",
    "seq_mean_token_sum",
    MODULE,
    params=SeqMeanParams,
    summary="Mean over the rows (non-empty ones by default: rows) of each row's token sum",
    formula="(1 / #rows) sum_i sum_t m L",
    source=str(papers.DR_GRPO),
)


SEQ_MEAN_TOKEN_SUM_NORM = Component(
    "aggregation",
    "seq_mean_token_sum_norm",
    MODULE,
    params=SeqMeanTokenSumNormParams,
    summary="Row token sums averaged, divided by a constant (Dr. GRPO)",
    formula="(1 / (#rows * norm)) sum_i sum_t m L, norm = T by default",
    source=str(papers.DR_GRPO),
)

#: Every built-in aggregation component, registered by the default plugin.
ENTRIES: tuple[Component, ...] = (
    TOKEN_MEAN,
    SEQ_MEAN_TOKEN_MEAN,
    SEQ_MEAN_TOKEN_SUM,
    SEQ_MEAN_TOKEN_SUM_NORM,
)
