"""Each row of docs/from-trl-verl.md that maps a verl option onto a ppokit spec, held
against verl 0.9.1's own ``verl.trainer.ppo.core_algos`` (the GRPO advantage estimator, the
vanilla (dual-clip) policy loss, ``agg_loss``'s modes with the minibatch's
``global_batch_info``, ``kl_penalty``) on generated batches: the loss and its gradient
w.r.t. the policy's log-probs, summed over the micro-batches of a minibatch as verl's actor
backpropagates them."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers.peers import Case, cases, ppokit_loss, spec_of

pytest.importorskip("verl")
core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")


class Config(dict):  # type: ignore[type-arg]
    """The actor config's fields the policy losses read (``config.x`` and ``config.get``)."""

    __getattr__ = dict.__getitem__


N, T = 4, 6
FAST = settings(max_examples=12, deadline=None, derandomize=True)
MICRO = st.sampled_from([2, 4])


def verl_loss(
    case: Case, micro: int, mode: str, *, norm_by_std: bool = True, kl: str | None = None,
    kl_coef: float = 0.0, entropy_coeff: float = 0.0, scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """verl's advantage on the whole batch, then its actor's loss of each micro-batch."""
    batch = case.batch()
    mask = batch.response_mask.float()
    adv, _ = core_algos.compute_grpo_outcome_advantage(
        batch.token_rewards, mask, np.asarray(batch.group_ids), 1e-6, norm_by_std
    )
    info = {
        "dp_size": 1, "batch_num_tokens": mask.sum(), "global_batch_size": (mask.sum(-1) > 0).sum(),
        "loss_scale_factor": scale,
    }  # fmt: skip
    config = Config(
        clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0,
        global_batch_info=info,
    )  # fmt: skip
    logp = case.fresh()
    total = torch.zeros(())
    for j in torch.arange(case.b).split(micro):
        pg, _ = core_algos.compute_policy_loss_vanilla(
            case.logp_old[j], logp[j], adv[j], mask[j], mode, config
        )
        total = total + pg
        if kl is not None:
            estimate = core_algos.kl_penalty(logp[j], case.logp_ref[j], kl)
            total = total + kl_coef * core_algos.agg_loss(estimate, mask[j], mode, **info)
        if entropy_coeff:
            ent = core_algos.agg_loss(case.entropy[j], mask[j], mode, **info)
            total = total - entropy_coeff * ent
    total.backward()
    assert logp.grad is not None
    return total.detach(), logp.grad


def ours(case: Case, micro: int, **sections: Any) -> tuple[torch.Tensor, torch.Tensor]:
    logp = case.fresh()
    total = ppokit_loss(spec_of(**sections), case, logp, micro)
    total.backward()
    assert logp.grad is not None
    return total.detach(), logp.grad


def same(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> None:
    torch.testing.assert_close(a[0], b[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(a[1], b[1], rtol=1e-5, atol=1e-6)


CLIP = {"name": "ppo_clip", "clip_low": 0.2, "clip_high": 0.28, "dual_clip": 3.0}
AGGREGATIONS = {
    "token-mean": "token_mean",
    "seq-mean-token-mean": "seq_mean_token_mean",
    "seq-mean-token-sum": "seq_mean_token_sum",
}


@FAST
@given(cases(n=N, t=T, spread=1.0), MICRO, st.sampled_from(sorted(AGGREGATIONS)))
def test_grpo_clip_and_loss_agg_mode(case: Case, micro: int, mode: str) -> None:
    """``adv_estimator: grpo``, ``clip_ratio_low``/``_high``, ``clip_ratio_c`` and each
    ``loss_agg_mode``: advantage ``grpo`` (ε 1e-6), ``ppo_clip`` with ``dual_clip``, the
    aggregation of the same name."""
    policy = {"loss": CLIP, "aggregation": AGGREGATIONS[mode]}
    same(verl_loss(case, micro, mode), ours(case, micro, advantage="grpo", policy=policy))


@FAST
@given(cases(n=N, t=T), MICRO)
def test_seq_mean_token_sum_norm(case: Case, micro: int) -> None:
    """``seq-mean-token-sum-norm`` with ``loss_scale_factor: L``: ``norm: L``."""
    agg = {"name": "seq_mean_token_sum_norm", "norm": 8.0}
    mine = ours(case, micro, advantage="grpo", policy={"loss": CLIP, "aggregation": agg})
    same(verl_loss(case, micro, "seq-mean-token-sum-norm", scale=8.0), mine)


@FAST
@given(cases(n=N, t=T), MICRO)
def test_norm_adv_by_std_false_is_dr_grpo(case: Case, micro: int) -> None:
    """``norm_adv_by_std_in_grpo: false``: advantage ``dr_grpo``."""
    policy = {"loss": CLIP, "aggregation": "token_mean"}
    theirs = verl_loss(case, micro, "token-mean", norm_by_std=False)
    same(theirs, ours(case, micro, advantage="dr_grpo", policy=policy))


KL = {"low_var_kl": "k3", "kl": "k1", "mse": "k2"}


@FAST
@given(cases(n=N, t=T), MICRO, st.sampled_from(sorted(KL)))
def test_kl_loss_type(case: Case, micro: int, kind: str) -> None:
    """``use_kl_loss``, ``kl_loss_coef: β``, ``kl_loss_type``: ``kl: {estimator, coef: β,
    placement: loss}`` (``low_var_kl`` k3, ``kl`` k1, ``mse`` k2)."""
    theirs = verl_loss(case, micro, "token-mean", kl=kind, kl_coef=0.1)
    kl = {"estimator": KL[kind], "coef": 0.1, "placement": "loss"}
    policy = {"loss": CLIP, "aggregation": "token_mean"}
    same(theirs, ours(case, micro, advantage="grpo", kl=kl, policy=policy))


@FAST
@given(cases(n=N, t=T), MICRO)
def test_entropy_coeff(case: Case, micro: int) -> None:
    """``actor.entropy_coeff``: ``policy.entropy_coef`` (the loss's aggregation)."""
    policy = {"loss": CLIP, "aggregation": "token_mean", "entropy_coef": 0.05}
    theirs = verl_loss(case, micro, "token-mean", entropy_coeff=0.05)
    same(theirs, ours(case, micro, advantage="grpo", policy=policy))
