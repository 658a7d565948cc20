"""The plugin's catalogue: the ``lite_ppo`` advantage's params and entry. Torch-free: the
math (``ppokit_example.advantage``) is imported only when a run creates the component."""

from __future__ import annotations

from pydantic import Field

import ppokit
from ppokit.hookspecs import Register


class LitePPOParams(ppokit.Params):
    """Parameters of the Lite PPO advantage."""

    eps: float = Field(1e-6, gt=0.0, description="added to the batch standard deviation")


LITE_PPO = ppokit.Component(
    "advantage",
    "lite_ppo",
    "ppokit_example.advantage",
    params=LitePPOParams,
    summary="Outcome reward minus the group mean, divided by the batch std (Lite PPO)",
    formula=(
        "A_{i,t} = (R_i − mean_{j∈G(i)} R_j) / (std_batch(R) + ε) on response tokens, "
        "0 elsewhere; std_batch over the rows with response tokens"
    ),
    requires=("group_ids",),
    source="Part I: Tricks or Traps? A Deep Dive into RL for LLM Reasoning "
    "(Liu et al., 2025), arXiv:2508.08221",
)


@ppokit.hookimpl
def ppokit_register(register: Register) -> None:
    register(LITE_PPO)
