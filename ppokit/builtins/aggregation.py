"""Catalogue of the built-in aggregation components (torch-free)."""

from __future__ import annotations

from pydantic import Field

from ppokit.builtins._base import NoParams, Params
from ppokit.hookspecs import Register

MODULE = "ppokit.components.aggregation"

DR_GRPO = (
    "Understanding R1-Zero-Like Training: A Critical Perspective (Liu et al., 2025), "
    "arXiv:2503.20783"
)


class SeqMeanTokenSumNormParams(Params):
    norm: float | None = Field(
        None, gt=0, description="constant divisor (None: T, the padded response length)"
    )


def register_components(register: Register) -> None:
    register(
        "aggregation",
        "token_mean",
        f"{MODULE}:TokenMean",
        params=NoParams,
        summary="Mean over every unmasked token of the batch",
        formula="sum(m L) / max(sum(m), 1)",
        source="DAPO: An Open-Source LLM Reinforcement Learning System at Scale "
        "(Yu et al., 2025), arXiv:2503.14476",
    )
    register(
        "aggregation",
        "seq_mean_token_mean",
        f"{MODULE}:SeqMeanTokenMean",
        params=NoParams,
        summary="Mean over non-empty rows of each row's token mean (GRPO)",
        formula="(1 / #rows) sum_i [sum_t m L / max(sum_t m, 1)]",
        source="DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language "
        "Models (Shao et al., 2024), arXiv:2402.03300",
    )
    register(
        "aggregation",
        "seq_mean_token_sum",
        f"{MODULE}:SeqMeanTokenSum",
        params=NoParams,
        summary="Mean over non-empty rows of each row's token sum",
        formula="(1 / #rows) sum_i sum_t m L",
        source=DR_GRPO,
    )
    register(
        "aggregation",
        "seq_mean_token_sum_norm",
        f"{MODULE}:SeqMeanTokenSumNorm",
        params=SeqMeanTokenSumNormParams,
        summary="Row token sums averaged, divided by a constant (Dr. GRPO)",
        formula="(1 / (#rows * norm)) sum_i sum_t m L, norm = T by default",
        source=DR_GRPO,
    )
