"""Catalogue of the built-in advantage components (torch-free)."""

from __future__ import annotations

from pydantic import Field

from ppokit.builtins._base import NoParams, Params
from ppokit.hookspecs import Register

MODULE = "ppokit.components.advantage"

Gamma = Field(default=1.0, ge=0.0, le=1.0, description="discount factor gamma in [0, 1]")


class GAEParams(Params):
    gamma: float = Gamma
    lam: float = Field(default=0.95, ge=0.0, le=1.0, description="GAE lambda in [0, 1]")
    whiten: bool = Field(default=True, description="batch-whiten over all response tokens")


class MonteCarloParams(Params):
    gamma: float = Gamma
    whiten: bool = Field(default=False, description="batch-whiten over all response tokens")


class LengthAdaptiveGAEParams(Params):
    gamma: float = Gamma
    alpha: float = Field(default=0.05, gt=0.0, description="lam = 1 - 1/(alpha * length)")
    whiten: bool = Field(default=True, description="batch-whiten over all response tokens")


class GRPOParams(Params):
    eps: float = Field(
        default=1e-6,
        gt=0.0,
        description="added to the group std (> 0: a group of equal rewards has std 0)",
    )


class GammaParams(Params):
    gamma: float = Gamma


def register_components(register: Register) -> None:
    register(
        "advantage",
        "gae",
        f"{MODULE}:GAE",
        params=GAEParams,
        summary="Generalized advantage estimation with a critic",
        formula="A_t = δ_t + γλ A_{t+1}, δ_t = r_t + γ V(s_{t+1}) − V(s_t); batch-whitened if whiten",
        requires=("values",),
        source="High-Dimensional Continuous Control Using Generalized Advantage Estimation "
        "(Schulman et al., 2015), arXiv:1506.02438",
    )
    register(
        "advantage",
        "mc",
        f"{MODULE}:MonteCarlo",
        params=MonteCarloParams,
        summary="Monte-Carlo return-to-go minus the critic's value",
        formula="A_t = Σ_{s≥t} γ^{s−t} r_s + γ^{T−t} V_T − V(s_t); batch-whitened if whiten",
        requires=("values",),
        source="Proximal Policy Optimization Algorithms (Schulman et al., 2017), arXiv:1707.06347",
    )
    register(
        "advantage",
        "length_adaptive_gae",
        f"{MODULE}:LengthAdaptiveGAE",
        params=LengthAdaptiveGAEParams,
        summary="GAE whose lambda grows with the response length (VAPO)",
        formula="GAE with λ_i = clamp(1 − 1/(α l_i), 0, 1), l_i = response length; batch-whitened if whiten",
        requires=("values",),
        source="VAPO: Efficient and Reliable Reinforcement Learning for Advanced Reasoning "
        "Tasks (Yue et al., 2025), arXiv:2504.05118",
    )
    register(
        "advantage",
        "grpo",
        f"{MODULE}:GRPO",
        params=GRPOParams,
        summary="Group-normalised outcome reward (GRPO)",
        formula="A_i = (R_i − mean_g R) / (std_g R + ε), broadcast over the response; g: the group's non-empty responses",
        requires=("group_ids",),
        source="DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language "
        "Models (Shao et al., 2024), arXiv:2402.03300",
    )
    register(
        "advantage",
        "dr_grpo",
        f"{MODULE}:DrGRPO",
        params=NoParams,
        summary="Group-centred outcome reward without std normalisation (Dr. GRPO)",
        formula="A_i = R_i − mean_g R, broadcast over the response; g: the group's non-empty responses",
        requires=("group_ids",),
        source="Understanding R1-Zero-Like Training: A Critical Perspective "
        "(Liu et al., 2025), arXiv:2503.20783",
    )
    register(
        "advantage",
        "rloo",
        f"{MODULE}:RLOO",
        params=NoParams,
        summary="REINFORCE leave-one-out baseline",
        formula="A_i = R_i − mean_{j≠i} R_j = n/(n−1) (R_i − mean_g R); n: the group's non-empty responses",
        requires=("group_ids",),
        source="Back to Basics: Revisiting REINFORCE Style Optimization for Learning from "
        "Human Feedback in LLMs (Ahmadian et al., 2024), arXiv:2402.14740",
    )
    register(
        "advantage",
        "reinforce_pp",
        f"{MODULE}:ReinforcePP",
        params=GammaParams,
        summary="Batch-whitened discounted reward-to-go (REINFORCE++)",
        formula="A_t = whiten(Σ_{s≥t} γ^{s−t} r_s) over all response tokens of the batch",
        source="REINFORCE++: A Simple and Efficient Approach for Aligning Large Language "
        "Models (Hu, 2025), arXiv:2501.03262",
    )
    register(
        "advantage",
        "reinforce_pp_baseline",
        f"{MODULE}:ReinforcePPBaseline",
        params=NoParams,
        summary="Group-centred outcome reward, batch-whitened (REINFORCE++ with baseline)",
        formula="A_t = whiten(R_i − mean_g R) over all response tokens of the batch; g: non-empty responses",
        requires=("group_ids",),
        source="REINFORCE++: A Simple and Efficient Approach for Aligning Large Language "
        "Models (Hu, 2025), arXiv:2501.03262",
    )
    register(
        "advantage",
        "remax",
        f"{MODULE}:ReMax",
        params=NoParams,
        summary="Reward-to-go minus the greedy baseline response's score (ReMax)",
        formula="A_t = Σ_{s≥t} r_s − R(greedy response)",
        requires=("baseline_rewards",),
        source="ReMax: A Simple, Effective, and Efficient Reinforcement Learning Method for "
        "Aligning Large Language Models (Li et al., 2024), arXiv:2310.10505",
    )
    register(
        "advantage",
        "opo",
        f"{MODULE}:OPO",
        params=NoParams,
        summary="Outcome reward minus the length-weighted group mean (optimal baseline)",
        formula="A_i = R_i − Σ_j l_j R_j / Σ_j l_j over the group, l = response length (empty rows weigh 0)",
        requires=("group_ids",),
        source="On-Policy RL with Optimal Reward Baseline (Hao et al., 2025), arXiv:2505.23585",
    )
