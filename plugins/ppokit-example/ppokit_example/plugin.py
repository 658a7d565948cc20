"""Registers the ``lite_ppo`` advantage. Torch-free: the math is imported on creation."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

import ppokit
from ppokit.hookspecs import Register

FORMULA = (
    "A_{i,t} = (R_i − mean_{j∈G(i)} R_j) / (std_batch(R) + ε) on response tokens, "
    "0 elsewhere; std_batch over the rows with response tokens"
)
SOURCE = (
    "Part I: Tricks or Traps? A Deep Dive into RL for LLM Reasoning "
    "(Liu et al., 2025), arXiv:2508.08221"
)


class LitePPOParams(BaseModel):
    """Parameters of the Lite PPO advantage."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    eps: float = Field(1e-6, gt=0.0, description="added to the batch standard deviation")


@ppokit.hookimpl
def ppokit_register(register: Register) -> None:
    register(
        "advantage",
        "lite_ppo",
        "ppokit_example.advantage:LitePPOAdvantage",
        params=LitePPOParams,
        summary="Outcome reward minus the group mean, divided by the batch std (Lite PPO)",
        formula=FORMULA,
        requires=("group_ids",),
        source=SOURCE,
    )
