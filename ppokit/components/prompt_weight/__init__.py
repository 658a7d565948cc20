"""Prompt weights of the actor loss (``policy.weight``) and the critic loss (``critic.weight``):
``w(batch) -> float32 [B]``, one weight per response (responses to one prompt share it,
but for ``untruncated``, which weighs each response by its own truncation).

A row without tokens is no response: it weighs 0 and does not count in its group.

This module is the torch-free catalogue; the tensor code is
:mod:`ppokit.components.prompt_weight.impl`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from pydantic import Field

from ppokit import papers
from ppokit.catalogue import Component, Contract, NoParams, Params

if TYPE_CHECKING:
    from torch import Tensor

    from ppokit.batch import RolloutBatch


class PromptWeight(Protocol):
    """``w(batch) -> ω [B]`` float32, detached; 0 on empty rows."""

    def __call__(self, batch: RolloutBatch) -> Tensor: ...


CONTRACT = Contract("prompt_weight")
MODULE = "ppokit.components.prompt_weight.impl"


class PassRateVarianceParams(Params):
    normalize: bool = Field(True, description="rescale the weights to mean 1 over the batch")


UNIFORM = Component(
    "prompt_weight",
    "uniform",
    MODULE,
    params=NoParams,
    summary="Every prompt weighs 1",
    formula="w = 1 (0 for a row without tokens)",
    source="ppokit's docs/concepts.md: the actor's prompt weight (section 4) and the general "
    "critic loss (section 5)",
)


PASS_RATE_VARIANCE = Component(
    "prompt_weight",
    "pass_rate_variance",
    MODULE,
    params=PassRateVarianceParams,
    summary="Bernoulli variance of the group's pass rate: prompts solved half the time weigh most",
    formula="p = clamp(group mean of R, 0, 1); w = p (1 - p), divided by mean(w) if normalize; over non-empty rows",
    requires=("group_ids",),
    source="ppokit: the variance p(1-p) of a Bernoulli reward, largest for prompts solved half the time",
)


INFORMATIVE_GROUPS = Component(
    "prompt_weight",
    "informative_groups",
    MODULE,
    params=NoParams,
    summary="1 for groups whose rewards are not all equal, else 0 (dynamic sampling as a weight)",
    formula="w = 1[max_group R > min_group R] over the group's non-empty rows",
    requires=("group_ids",),
    source=str(papers.DAPO),
)

UNTRUNCATED = Component(
    "prompt_weight",
    "untruncated",
    MODULE,
    params=NoParams,
    summary="Truncated responses weigh 0: out of the loss, still in their group's statistics",
    formula="w = 1[not truncated] (0 for a row without tokens)",
    requires=("truncated",),
    source=papers.cite(("overlong filtering", papers.DAPO), "TRL's mask_truncated_completions"),
)

#: Every built-in prompt_weight component, registered by the default plugin.
ENTRIES: tuple[Component, ...] = (
    UNIFORM,
    PASS_RATE_VARIANCE,
    INFORMATIVE_GROUPS,
    UNTRUNCATED,
)
