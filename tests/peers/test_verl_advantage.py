"""Each row of docs/from-trl-verl.md that maps a verl ``algorithm.adv_estimator`` onto a
ppokit ``advantage``, held against verl 0.9.1's own estimator in
``verl.trainer.ppo.core_algos`` (called as ``ray_trainer.compute_advantage`` calls it) on
generated batches: groups of 1, 2 or 4 responses, lengths 1..T (a response of T tokens is
truncated), groups whose rewards are all equal. ppokit's side is the advantage component
the spec assembles, after the spec's truncation rule, as the trainer runs them."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from ppokit.batch import RolloutBatch
from ppokit.trainer.assembly import Assembly
from tests.helpers.peers import Case, cases, fixed, spec_of

pytest.importorskip("verl")
core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")

T = 6
FAST = settings(max_examples=15, deadline=None, derandomize=True)
#: groups of 1 (verl: baseline 0, GRPO's std 1), 2 and 4 responses, at least two rows (verl's
#: whitening refuses a batch of one token)
BATCHES = st.sampled_from([(1, 2), (2, 1), (4, 1)]).flatmap(
    lambda n: cases(groups=(n[1], 3), n=n[0], t=T)
)
GAMMA = st.sampled_from([1.0, 0.9])
CRITIC = {"model": {"actor": "demo", "critic": "separate"}}


def values_of(case: Case, seed: int = 0) -> Tensor:
    """A critic's values, nonzero on the padding too (neither side may read them there)."""
    return torch.randn(case.b, case.t, generator=torch.Generator().manual_seed(seed))


def baselines_of(case: Case) -> Tensor:
    """The greedy responses' scores (ReMax), one per row."""
    return case.rewards.flip(0) * 0.75


def verl_advantage(case: Case, estimator: str, **kw: Any) -> tuple[Tensor, Tensor]:
    """verl's ``(advantages, returns)`` of ``estimator`` on the case's outcome rewards."""
    batch = case.batch()
    rewards, mask = batch.token_rewards.clone(), batch.response_mask.float()
    index = np.asarray(batch.group_ids)
    config = SimpleNamespace(gamma=kw.get("gamma", 1.0))
    if estimator == "gae":
        return core_algos.compute_gae_advantage_return(
            rewards, values_of(case), mask, kw["gamma"], kw["lam"]
        )
    if estimator == "grpo":
        return core_algos.compute_grpo_outcome_advantage(
            rewards, mask, index, norm_adv_by_std_in_grpo=kw.get("norm_by_std", True)
        )
    if estimator == "remax":
        return core_algos.compute_remax_outcome_advantage(
            rewards, baselines_of(case), mask, config=config
        )
    fn = core_algos.get_adv_estimator_fn(estimator)
    return fn(token_level_rewards=rewards, response_mask=mask, index=index, config=config)


def ppokit_batch(case: Case, advantage: Any) -> RolloutBatch:
    batch = case.batch()
    name = advantage if isinstance(advantage, str) else advantage["name"]
    if name == "gae":
        batch = batch.replace(values=values_of(case))
    if name == "remax":
        batch = batch.replace(baseline_rewards=baselines_of(case))
    return batch


def ours(case: Case, advantage: Any, **sections: Any) -> Tensor:
    """The advantage the spec assembles, after its truncation rule."""
    parts = Assembly.from_spec(spec_of(advantage=advantage, **sections))
    return parts.advantage(parts.truncation(ppokit_batch(case, advantage)))


def same(theirs: Tensor, mine: Tensor, mask: Tensor) -> None:
    torch.testing.assert_close(mine, theirs.float() * mask, rtol=1e-5, atol=1e-5)


@FAST
@given(BATCHES)
def test_rloo(case: Case) -> None:
    """``adv_estimator: rloo``: ``advantage: rloo`` (n/(n−1)·(R − group mean); a group of
    one keeps R)."""
    same(verl_advantage(case, "rloo")[0], ours(case, "rloo"), case.mask)


@FAST
@given(BATCHES, GAMMA)
def test_reinforce_plus_plus(case: Case, gamma: float) -> None:
    """``adv_estimator: reinforce_plus_plus``, ``algorithm.gamma``: ``advantage:
    {name: reinforce_pp, gamma}`` (the discounted reward-to-go whitened over the batch's
    tokens: both with the unbiased variance and 1e-8 under the root)."""
    theirs = verl_advantage(case, "reinforce_plus_plus", gamma=gamma)[0]
    same(theirs, ours(case, {"name": "reinforce_pp", "gamma": gamma}), case.mask)


@FAST
@given(BATCHES)
def test_reinforce_plus_plus_baseline(case: Case) -> None:
    """``adv_estimator: reinforce_plus_plus_baseline``: ``advantage: reinforce_pp_baseline``
    (R − group mean, whitened over the batch's tokens)."""
    theirs = verl_advantage(case, "reinforce_plus_plus_baseline")[0]
    same(theirs, ours(case, "reinforce_pp_baseline"), case.mask)


@FAST
@given(BATCHES)
def test_remax(case: Case) -> None:
    """``adv_estimator: remax`` with the greedy responses' rewards as
    ``reward_baselines``: ``advantage: remax`` (``baseline_rewards``)."""
    same(verl_advantage(case, "remax")[0], ours(case, "remax"), case.mask)


@FAST
@given(BATCHES)
def test_opo(case: Case) -> None:
    """``adv_estimator: opo``: ``advantage: opo`` (R − Σ l_j R_j / Σ l_j over the group)."""
    same(verl_advantage(case, "opo")[0], ours(case, "opo"), case.mask)


@FAST
@given(BATCHES)
def test_grpo_without_std_is_dr_grpo(case: Case) -> None:
    """``adv_estimator: grpo`` with ``norm_adv_by_std_in_grpo: false``: ``advantage:
    dr_grpo``; with true, ``grpo`` (ε 1e-6 added to the unbiased group std, a group of one:
    std 1)."""
    theirs = verl_advantage(case, "grpo", norm_by_std=False)[0]
    same(theirs, ours(case, "dr_grpo"), case.mask)
    same(verl_advantage(case, "grpo")[0], ours(case, "grpo"), case.mask)


@FAST
@given(BATCHES, GAMMA, st.sampled_from([1.0, 0.95, 0.0]))
def test_gae(case: Case, gamma: float, lam: float) -> None:
    """``adv_estimator: gae``, ``algorithm.gamma``, ``algorithm.lam``: ``advantage: {name:
    gae, gamma, lam}`` (whitened over the batch's tokens, ppokit's default ``whiten: true``)
    and ``truncation: terminal`` (verl bootstraps no truncated response); verl's returns
    are ``critic.target: {name: lambda_return, gamma, lam}``."""
    theirs, returns = verl_advantage(case, "gae", gamma=gamma, lam=lam)
    adv = {"name": "gae", "gamma": gamma, "lam": lam}
    critic = {"target": {"name": "lambda_return", "gamma": gamma, "lam": lam}}
    same(theirs, ours(case, adv, truncation="terminal", critic=critic, **CRITIC), case.mask)
    spec = spec_of(advantage=adv, truncation="terminal", critic=critic, **CRITIC)
    parts = Assembly.from_spec(spec)
    assert parts.critic_target is not None
    targets = parts.critic_target(ppokit_batch(case, adv))
    same(returns, targets, case.mask)


def test_grpo_eps_differs_from_trls() -> None:
    """verl's group std ε is 1e-6 (ppokit's default), TRL's 1e-4: the advantages of a group
    of std s differ by the factor (s + 1e-4)/(s + 1e-6), 0.8% at s = 0.013."""
    case = fixed([2, 3, 4, 5], n=4)
    case.rewards = torch.tensor([0.0, 0.01, 0.02, 0.03])
    theirs = verl_advantage(case, "grpo")[0]
    same(theirs, ours(case, "grpo"), case.mask)
    trls = ours(case, {"name": "grpo", "eps": 1e-4})
    s = float(case.rewards.std())
    factor = (s + 1e-4) / (s + 1e-6)
    torch.testing.assert_close(theirs, trls * factor, rtol=1e-5, atol=1e-6)
    assert factor > 1.007
