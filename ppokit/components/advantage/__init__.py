"""Advantage estimators: ``est(batch) -> A [B, T]`` float32, detached, 0 at masked positions.

Token-level estimators run the reverse discounted scans of :mod:`ppokit.ops` (whitening,
when asked, happens in the scan's compacted layout). Group estimators compare each response's
score R_i = batch.scores with statistics of its group (:class:`ppokit.ops.GroupStats`) and
broadcast the result over the row. Group statistics count only the responses with at least
one token: an empty row (e.g. one cleared by the ``exclude`` truncation rule) is not a
response with reward 0. A group with a single non-empty response has baseline 0 (and, for
GRPO, standard deviation 1).

This module is the torch-free catalogue (params, formulas, papers); the tensor code is
:mod:`ppokit.components.advantage.impl`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, Protocol

from pydantic import Field

from ppokit import papers
from ppokit.catalogue import Component, Contract, Gamma, NoParams, Params

if TYPE_CHECKING:
    from torch import Tensor

    from ppokit.batch import RolloutBatch


class Advantage(Protocol):
    """``est(batch) -> A [B, T]`` float32, detached, 0 where ``batch.response_mask`` is False."""

    def __call__(self, batch: RolloutBatch) -> Tensor: ...


CONTRACT = Contract("estimate")
MODULE = "ppokit.components.advantage.impl"


class GAEParams(Gamma):
    lam: float = Field(default=0.95, ge=0.0, le=1.0, description="GAE lambda in [0, 1]")
    whiten: bool = Field(default=True, description="batch-whiten over all response tokens")


class MonteCarloParams(Gamma):
    whiten: bool = Field(default=False, description="batch-whiten over all response tokens")


class LengthAdaptiveGAEParams(Gamma):
    alpha: float = Field(default=0.05, gt=0.0, description="lam = 1 - 1/(alpha * length)")
    whiten: bool = Field(default=True, description="batch-whiten over all response tokens")


class GroupEpsParams(Params):
    eps: float = Field(
        default=1e-6,
        gt=0.0,
        description="added to the group std (> 0: a group of equal rewards has std 0)",
    )


class GRPOParams(GroupEpsParams):
    std: Literal["group", "batch"] = Field(
        default="group",
        description="the std the centred reward is divided by: the group's (GRPO) or the "
        "batch's (Lite PPO; TRL's scale_rewards: batch)",
    )


GAE = Component(
    "advantage",
    "gae",
    MODULE,
    params=GAEParams,
    summary="Generalized advantage estimation with a critic",
    formula="A_t = δ_t + γλ A_{t+1}, δ_t = r_t + γ V(s_{t+1}) − V(s_t); batch-whitened if whiten",
    requires=("values",),
    source=str(papers.GAE),
)


MC = Component(
    "advantage",
    "mc",
    MODULE,
    params=MonteCarloParams,
    summary="Monte-Carlo return-to-go minus the critic's value",
    formula="A_t = Σ_{s≥t} γ^{s−t} r_s + γ^{T−t} V_T − V(s_t); batch-whitened if whiten",
    requires=("values",),
    source=str(papers.PPO),
)


LENGTH_ADAPTIVE_GAE = Component(
    "advantage",
    "length_adaptive_gae",
    MODULE,
    params=LengthAdaptiveGAEParams,
    summary="GAE whose lambda grows with the response length (VAPO)",
    formula="GAE with λ_i = clamp(1 − 1/(α l_i), 0, 1), l_i = response length; batch-whitened if whiten",
    requires=("values",),
    source=str(papers.VAPO),
)


GRPO = Component(
    "advantage",
    "grpo",
    MODULE,
    params=GRPOParams,
    summary="Group-normalised outcome reward (GRPO)",
    formula="A_i = (R_i − mean_g R) / (std_g R + ε), broadcast over the response; g: the group's non-empty responses; std: batch divides by std_B R, over the batch's non-empty responses",
    requires=("group_ids",),
    source=papers.cite(papers.GRPO, ("std: batch", papers.LITE_PPO)),
)


GDPO = Component(
    "advantage",
    "gdpo",
    MODULE,
    params=GroupEpsParams,
    summary="Each reward normalised within its group apart, then their weighted sum, "
    "batch-normalised (GDPO)",
    formula="A_{k,i} = (r_{k,i} − mean_g r_k) / (std_g r_k + ε) for each reward part k; "
    "S_i = Σ_k w_k A_{k,i}; A_i = (S_i − mean_B S) / sqrt(var_B S + 1e-8) over the batch's "
    "non-empty responses, broadcast over the response",
    requires=("group_ids", "reward_parts", "reward_weights"),
    source=str(papers.GDPO),
)


DR_GRPO = Component(
    "advantage",
    "dr_grpo",
    MODULE,
    params=NoParams,
    summary="Group-centred outcome reward without std normalisation (Dr. GRPO)",
    formula="A_i = R_i − mean_g R, broadcast over the response; g: the group's non-empty responses",
    requires=("group_ids",),
    source=str(papers.DR_GRPO),
)


RLOO = Component(
    "advantage",
    "rloo",
    MODULE,
    params=NoParams,
    summary="REINFORCE leave-one-out baseline",
    formula="A_i = R_i − mean_{j≠i} R_j = n/(n−1) (R_i − mean_g R); n: the group's non-empty responses",
    requires=("group_ids",),
    source=str(papers.RLOO),
)


REINFORCE_PP = Component(
    "advantage",
    "reinforce_pp",
    MODULE,
    params=Gamma,
    summary="Batch-whitened discounted reward-to-go (REINFORCE++)",
    formula="A_t = whiten(Σ_{s≥t} γ^{s−t} r_s) over all response tokens of the batch",
    source=str(papers.REINFORCE_PP),
)


REINFORCE_PP_BASELINE = Component(
    "advantage",
    "reinforce_pp_baseline",
    MODULE,
    params=NoParams,
    summary="Group-centred outcome reward, batch-whitened (REINFORCE++ with baseline)",
    formula="A_t = whiten(R_i − mean_g R) over all response tokens of the batch; g: non-empty responses",
    requires=("group_ids",),
    source=str(papers.REINFORCE_PP),
)


REMAX = Component(
    "advantage",
    "remax",
    MODULE,
    params=NoParams,
    summary="Reward-to-go minus the greedy baseline response's score (ReMax)",
    formula="A_t = Σ_{s≥t} r_s − R(greedy response)",
    requires=("baseline_rewards",),
    source=str(papers.REMAX),
)


OPO = Component(
    "advantage",
    "opo",
    MODULE,
    params=NoParams,
    summary="Outcome reward minus the length-weighted group mean (optimal baseline)",
    formula="A_i = R_i − Σ_j l_j R_j / Σ_j l_j over the group, l = response length (empty rows weigh 0)",
    requires=("group_ids",),
    source=str(papers.OPO),
)

#: Every built-in advantage component, registered by the default plugin.
ENTRIES: tuple[Component, ...] = (
    GAE,
    MC,
    LENGTH_ADAPTIVE_GAE,
    GRPO,
    GDPO,
    DR_GRPO,
    RLOO,
    REINFORCE_PP,
    REINFORCE_PP_BASELINE,
    REMAX,
    OPO,
)
