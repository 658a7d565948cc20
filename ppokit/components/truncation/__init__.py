"""Truncation rules: ``rule(batch) -> new batch``, deciding what happens to rows that hit the
length limit without EOS (``batch.truncated``). Every rule but ``bootstrap`` drops
``bootstrap_values``, so ``batch.terminal_values`` is 0 after it.

This module is the torch-free catalogue; the tensor code is
:mod:`ppokit.components.truncation.impl`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from pydantic import Field, model_validator

from ppokit import papers
from ppokit.catalogue import Component, Contract, NoParams, Params

if TYPE_CHECKING:
    from ppokit.batch import RolloutBatch


class Truncation(Protocol):
    """``rule(batch) -> batch``: a new batch; the input is never changed."""

    def __call__(self, batch: RolloutBatch) -> RolloutBatch: ...


CONTRACT = Contract("batch")
MODULE = "ppokit.components.truncation.impl"


class PenaltyParams(Params):
    value: float = Field(-1.0, description="outcome reward of a truncated response")


class SoftOverlongParams(Params):
    max_length: int = Field(..., gt=0, description="hard length limit L_max")
    buffer: int = Field(..., gt=0, description="punishment ramps up over the last `buffer` tokens")
    factor: float = Field(1.0, description="punishment at and beyond max_length")

    @model_validator(mode="after")
    def _buffer_below_max(self) -> SoftOverlongParams:
        if self.buffer >= self.max_length:
            raise ValueError(
                f"buffer must be smaller than max_length, got buffer={self.buffer}, "
                f"max_length={self.max_length}"
            )
        return self


TERMINAL = Component(
    "truncation",
    "terminal",
    MODULE,
    params=NoParams,
    summary="Truncated rows are treated as ended (value after the last token is 0)",
    formula="V(s_{L+1}) = 0 for every row, truncated or not",
    source=papers.cite(papers.TIME_LIMITS, "the time-limit-as-terminal baseline"),
)


BOOTSTRAP = Component(
    "truncation",
    "bootstrap",
    MODULE,
    params=NoParams,
    summary="Truncated rows bootstrap from the critic's value of the next state",
    formula="V(s_after_last) = bootstrap_value on truncated rows",
    requires=("truncated", "bootstrap_values"),
    source=str(papers.TIME_LIMITS),
)


EXCLUDE = Component(
    "truncation",
    "exclude",
    MODULE,
    params=NoParams,
    summary="Truncated rows are removed from the actor and critic losses (overlong filtering)",
    formula="response_mask[i, :] := False for truncated i",
    requires=("truncated",),
    source=str(papers.DAPO),
)


PENALTY = Component(
    "truncation",
    "penalty",
    MODULE,
    params=PenaltyParams,
    summary="A truncated row's outcome reward is replaced by a fixed value",
    formula="r_{i,t} := value at the row's last position, else 0, for truncated i",
    requires=("truncated",),
    source=str(papers.N_PLUS),
)


SOFT_OVERLONG = Component(
    "truncation",
    "soft_overlong",
    MODULE,
    params=SoftOverlongParams,
    summary="DAPO's soft overlong punishment added to the outcome reward, by length",
    formula=(
        "L_c = max_length - buffer; R += 0 if L <= L_c; "
        "(L_c - L) / buffer * factor if L_c < L <= max_length; -factor if L > max_length"
    ),
    source=str(papers.DAPO),
)

#: Every built-in truncation component, registered by the default plugin.
ENTRIES: tuple[Component, ...] = (
    TERMINAL,
    BOOTSTRAP,
    EXCLUDE,
    PENALTY,
    SOFT_OVERLONG,
)
