"""Catalogue of the built-in prompt_weight components (torch-free)."""

from __future__ import annotations

from pydantic import Field

from ppokit.builtins._base import NoParams, Params
from ppokit.hookspecs import Register

MODULE = "ppokit.components.prompt_weight"
DAPO = (
    "DAPO: An Open-Source LLM Reinforcement Learning System at Scale (Yu et al., 2025), "
    "arXiv:2503.14476"
)


class PassRateVarianceParams(Params):
    normalize: bool = Field(True, description="rescale the weights to mean 1 over the batch")


def register_components(register: Register) -> None:
    register(
        "prompt_weight",
        "uniform",
        f"{MODULE}:Uniform",
        params=NoParams,
        summary="Every prompt weighs 1",
        formula="w = 1 (0 for a row without tokens)",
        source="the general critic loss of ppokit's docs/concepts.md",
    )
    register(
        "prompt_weight",
        "pass_rate_variance",
        f"{MODULE}:PassRateVariance",
        params=PassRateVarianceParams,
        summary="Bernoulli variance of the group's pass rate: prompts solved half the time weigh most",
        formula="p = clamp(group mean of R, 0, 1); w = p (1 - p), divided by mean(w) if normalize; over non-empty rows",
        requires=("group_ids",),
        source="ppokit: the variance p(1-p) of a Bernoulli reward, largest for prompts solved half the time",
    )
    register(
        "prompt_weight",
        "informative_groups",
        f"{MODULE}:InformativeGroups",
        params=NoParams,
        summary="1 for groups whose rewards are not all equal, else 0 (dynamic sampling as a weight)",
        formula="w = 1[max_group R > min_group R] over the group's non-empty rows",
        requires=("group_ids",),
        source=DAPO,
    )
