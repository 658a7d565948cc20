"""Group filters (``rollout.filter``): which generated groups enter the round. A group is one
prompt's ``rollout.n`` responses; the round draws batches of prompts, generates and scores
them, and keeps drawing until ``rollout.prompts_per_round`` groups have passed the filter
(at most ``rollout.max_generation_batches`` batches), as DAPO's dynamic sampling does.

``keep(groups) -> bool [G]``: one flag per group of a :class:`Groups` (``[G, n]`` tensors of
the combined rewards R, response lengths and truncation flags, plus the G data rows and the
response texts), on the rewards' device, without grad. A group that fails the filter never
reaches the estimation or the update; its prompt is consumed from the data stream like any
other.

Optional member: ``keeps_all`` (default False), True for a filter that passes every group
(``none``): the trainer then neither calls it nor reads its flags back to the host.

This module is the torch-free catalogue; the tensor code is
:mod:`ppokit.components.group_filter.impl`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from pydantic import Field

from ppokit import papers
from ppokit.catalogue import Bounds, Component, Contract, NoParams, Params
from ppokit.papers import cite

if TYPE_CHECKING:
    from torch import Tensor


@dataclass(frozen=True)
class Groups:
    """G generated groups of n responses each, as a filter sees them."""

    #: the G prompts' data rows (``prompt`` and every other column, e.g. ``answer``)
    rows: list[dict[str, Any]]
    #: the G·n decoded responses, each prompt's n together
    responses: list[str]
    #: float32 [G, n]: the combined reward R = Σ_k weight_k · reward_k of each response
    rewards: Tensor
    #: long [G, n]: response tokens
    lengths: Tensor
    #: bool [G, n]: the response hit max_new_tokens without EOS
    truncated: Tensor
    #: float32 [G, n, K]: each reward's own score r_k (the batch's ``reward_parts``), when a
    #: component of the spec reads them (None otherwise)
    parts: Tensor | None = None
    #: float32 [K]: each part's weight w_k in R (with ``parts``)
    weights: Tensor | None = None

    @property
    def size(self) -> int:
        """G, the number of groups."""
        return int(self.rewards.shape[0])


class GroupFilter(Protocol):
    """``keep(groups) -> bool [G]``: True for the groups that enter the round."""

    def __call__(self, groups: Groups) -> Tensor: ...


CONTRACT = Contract(
    "group_keep",
    optional={"keeps_all": "True: the filter keeps every group (it is not called)"},
)
MODULE = "ppokit.components.group_filter.impl"
DAPO = cite(("dynamic sampling", papers.DAPO), "section 3.2")
DAPO_OVERLONG = cite(
    ("overlong filtering (truncated samples leave the loss), applied to whole groups", papers.DAPO),
    "section 3.4",
)
PRIME = cite(("online prompt filtering by accuracy, kept between 0.2 and 0.8", papers.PRIME))


class InformativeParams(Params):
    tolerance: float = Field(
        1e-4,
        ge=0.0,
        le=1e6,
        description="a group is informative when the std of its rewards exceeds this (well "
        "above float32 rounding of rewards up to about 100 in magnitude: rewards equal up to "
        "rounding count as equal)",
    )


class PassRateParams(Bounds):
    low: float = Field(0.2, ge=0.0, le=1.0, description="the smallest pass rate kept")
    high: float = Field(0.8, ge=0.0, le=1.0, description="the largest pass rate kept")
    correct_at: float = Field(
        1.0, le=1e9, description="a response passes when its reward R is at least this"
    )


NONE = Component(
    "group_filter",
    "none",
    MODULE,
    params=NoParams,
    summary="Every generated group enters the round (one generation batch a round)",
    formula="keep_g = 1",
    source=str(papers.PPO),
)

INFORMATIVE = Component(
    "group_filter",
    "informative",
    MODULE,
    params=InformativeParams,
    summary="Groups whose rewards are not all the same (DAPO's dynamic sampling); when a "
    "component reads each reward's scores (gdpo), groups that vary in any of them",
    formula="keep_g = 1[std_i R_{g,i} > tolerance], or with the reward parts read: "
    "1[std_i R_{g,i} > tolerance or ∃k: w_k ≠ 0 and std_i r_{k,g,i} > tolerance]; std "
    "unbiased, computed in float64",
    requires=("group_ids",),
    source=DAPO,
)

NOT_ALL_TRUNCATED = Component(
    "group_filter",
    "not_all_truncated",
    MODULE,
    params=NoParams,
    summary="Drops the groups whose every response was truncated (no response ever ended)",
    formula="keep_g = 1[∃ i: not truncated_{g,i}]",
    source=DAPO_OVERLONG,
)

PASS_RATE = Component(
    "group_filter",
    "pass_rate",
    MODULE,
    params=PassRateParams,
    summary="Groups whose pass rate lies in [low, high]: neither too easy nor too hard",
    formula="p_g = mean_i 1[R_{g,i} >= correct_at]; keep_g = 1[low <= p_g <= high]",
    requires=("group_ids",),
    source=PRIME,
)

#: Every built-in group filter, registered by the default plugin.
ENTRIES: tuple[Component, ...] = (NONE, INFORMATIVE, NOT_ALL_TRUNCATED, PASS_RATE)
