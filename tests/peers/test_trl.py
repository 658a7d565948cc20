"""Each row of docs/from-trl-verl.md that maps a TRL ``GRPOConfig`` option onto a ppokit spec,
held against TRL 1.16's own ``GRPOTrainer`` code (its advantage in
``_generate_and_score_completions`` and its loss in ``_compute_loss``; tests/peers/trl_run.py)
on generated batches: the loss and its gradient w.r.t. the policy's log-probs, summed over
the micro-batches of one generation batch, as each trainer backpropagates them. A row whose
mapping is not exact has a test that shows the difference the page states."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers.peers import Case, cases, fixed, ppokit_loss, spec_of

trl = pytest.importorskip("trl", minversion="1.16")
from tests.peers import trl_run  # noqa: E402

N, T = 4, 6
FAST = settings(max_examples=12, deadline=None, derandomize=True)


def config(case: Case, micro: int, steps: int = 1, **kw: Any) -> Any:
    """One generation batch (the case) in ``steps`` optimizer steps of micro-batches of
    ``micro`` responses (TRL's ``steps_per_generation`` counts micro-batches);
    ``max_completion_length`` the case's width unless given."""
    micros = case.b // micro
    kw.setdefault("max_completion_length", case.t)
    return trl.GRPOConfig(
        output_dir="/nonexistent", report_to=[], use_cpu=True, num_generations=case.n,
        per_device_train_batch_size=micro, gradient_accumulation_steps=micros // steps,
        steps_per_generation=micros, **kw,
    )  # fmt: skip


def trl_loss(
    case: Case, micro: int, steps: int = 1, **kw: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    tr = trl_run.trainer(config(case, micro, steps, **kw), case)
    out = trl_run.generation_batch(tr, case)
    logp = case.fresh()
    total = sum(
        trl_run.loss(tr, case, out, logp, rows) for rows in torch.arange(case.b).split(micro)
    )
    assert isinstance(total, torch.Tensor)
    total.backward()
    assert logp.grad is not None
    return total.detach(), logp.grad


def ours(
    case: Case, micro: int, minibatches: int = 1, **sections: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    logp = case.fresh()
    total = ppokit_loss(spec_of(**sections), case, logp, micro, minibatches)
    total.backward()
    assert logp.grad is not None
    return total.detach(), logp.grad


def same(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> None:
    torch.testing.assert_close(a[0], b[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(a[1], b[1], rtol=1e-5, atol=1e-6)


def gap(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> float:
    return float((a[1] - b[1]).abs().max())


GRPO: dict[str, Any] = {"advantage": {"name": "grpo", "eps": 1e-4}}
CLIP = {"name": "ppo_clip", "clip_low": 0.2, "clip_high": 0.28}
MICRO = st.sampled_from([2, 4])


@FAST
@given(cases(n=N, t=T), MICRO)
def test_grpo_loss_is_seq_mean_token_mean(case: Case, micro: int) -> None:
    """``loss_type: grpo``, ``scale_rewards: group``, ``epsilon``/``epsilon_high``: grpo
    (ε 1e-4), ``ppo_clip``, ``seq_mean_token_mean``."""
    theirs = trl_loss(case, micro, loss_type="grpo", epsilon=0.2, epsilon_high=0.28)
    mine = ours(case, micro, **GRPO, policy={"loss": CLIP, "aggregation": "seq_mean_token_mean"})
    same(theirs, mine)


@FAST
@given(cases(n=N, t=T), MICRO)
def test_dapo_loss_is_token_mean(case: Case, micro: int) -> None:
    """``loss_type: dapo`` (one optimizer step a generation batch): ``token_mean``."""
    theirs = trl_loss(case, micro, loss_type="dapo", epsilon_high=0.28)
    mine = ours(case, micro, **GRPO, policy={"loss": CLIP, "aggregation": "token_mean"})
    same(theirs, mine)


@FAST
@given(cases(n=N, t=T), MICRO)
def test_dr_grpo_is_seq_mean_token_sum_norm(case: Case, micro: int) -> None:
    """``loss_type: dr_grpo`` with ``scale_rewards: none``: advantage ``dr_grpo``,
    ``seq_mean_token_sum_norm`` with ``norm: max_completion_length``."""
    theirs = trl_loss(case, micro, loss_type="dr_grpo", scale_rewards="none")
    agg = {"name": "seq_mean_token_sum_norm", "norm": T}
    mine = ours(case, micro, advantage="dr_grpo", policy={"loss": "ppo_clip", "aggregation": agg})
    same(theirs, mine)


@FAST
@given(cases(n=N, t=T, spread=1.0), MICRO)
def test_delta_is_dual_clip(case: Case, micro: int) -> None:
    """``delta: δ`` (two-sided GRPO) is ``ppo_clip``'s ``dual_clip: δ``."""
    theirs = trl_loss(case, micro, loss_type="dapo", delta=1.5)
    loss = {"name": "ppo_clip", "dual_clip": 1.5}
    same(theirs, ours(case, micro, **GRPO, policy={"loss": loss, "aggregation": "token_mean"}))


@FAST
@given(cases(n=N, t=T, spread=0.01), MICRO)
def test_sequence_level_is_gspo(case: Case, micro: int) -> None:
    """``importance_sampling_level: sequence`` with ``loss_type: grpo``: ``gspo`` with the
    same clip range, ``seq_mean_token_mean``."""
    theirs = trl_loss(
        case, micro, loss_type="grpo", importance_sampling_level="sequence",
        epsilon=3e-3, epsilon_high=4e-3,
    )  # fmt: skip
    loss = {"name": "gspo", "clip_low": 3e-3, "clip_high": 4e-3}
    mine = ours(case, micro, **GRPO, policy={"loss": loss, "aggregation": "seq_mean_token_mean"})
    same(theirs, mine)


@FAST
@given(cases(n=N, t=T, spread=0.5), MICRO)
def test_cispo_cap_is_clip_high_plus_one(case: Case, micro: int) -> None:
    """``loss_type: cispo``: TRL's ``epsilon_high`` is the cap of the IS weight itself,
    ppokit's ``clip_high`` is cap − 1 (``epsilon_high: 5.0`` is ``clip_high: 4.0``)."""
    theirs = trl_loss(case, micro, loss_type="cispo", epsilon_high=1.3)
    loss = {"name": "cispo", "clip_high": 0.3}
    same(theirs, ours(case, micro, **GRPO, policy={"loss": loss, "aggregation": "token_mean"}))


@FAST
@given(cases(n=N, t=T), MICRO)
def test_k3_kl_without_bias_correction(case: Case, micro: int) -> None:
    """``beta: β`` with ``use_bias_correction_kl: false``: ``kl: {estimator: k3, coef: β,
    placement: loss}``."""
    theirs = trl_loss(case, micro, loss_type="dapo", beta=0.04, use_bias_correction_kl=False)
    kl = {"estimator": "k3", "coef": 0.04, "placement": "loss"}
    mine = ours(
        case, micro, **GRPO, kl=kl, policy={"loss": "ppo_clip", "aggregation": "token_mean"}
    )
    same(theirs, mine)


@FAST
@given(cases(n=N, t=T), MICRO)
def test_bias_corrected_kl_is_k3_is(case: Case, micro: int) -> None:
    """``beta: β`` with TRL's default ``use_bias_correction_kl: true``: ``kl: {estimator:
    k3_is, coef: β, placement: loss}`` (k3 weighted by π/π_old)."""
    theirs = trl_loss(case, micro, loss_type="dapo", beta=0.04)
    kl = {"estimator": "k3_is", "coef": 0.04, "placement": "loss"}
    mine = ours(
        case, micro, **GRPO, kl=kl, policy={"loss": "ppo_clip", "aggregation": "token_mean"}
    )
    same(theirs, mine)


def test_bias_corrected_kl_differs() -> None:
    """TRL's default ``use_bias_correction_kl: true`` weighs k3 by π/π_old (DeepSeek-V3.2):
    ppokit's ``k3`` is not weighted (``k3_is`` is), the two differ by β·(ρ − 1)·k3 a token."""
    case = fixed(spread=0.5)
    theirs = trl_loss(case, 2, loss_type="dapo", beta=0.5)
    kl = {"estimator": "k3", "coef": 0.5, "placement": "loss"}
    mine = ours(case, 2, **GRPO, kl=kl, policy={"loss": "ppo_clip", "aggregation": "token_mean"})
    assert gap(theirs, mine) > 1e-3


@FAST
@given(cases(n=N, t=T))
def test_entropy_bonus_one_micro_batch(case: Case) -> None:
    """``entropy_coef`` is ``policy.entropy_coef`` under ``dapo`` with one micro-batch an
    optimizer step (TRL averages the bonus over each micro-batch's tokens)."""
    theirs = trl_loss(case, case.b, loss_type="dapo", entropy_coef=0.1)
    mine = ours(case, case.b, **GRPO, policy={"aggregation": "token_mean", "entropy_coef": 0.1})
    same(theirs, mine)


def test_entropy_bonus_per_micro_batch_differs() -> None:
    """Over several micro-batches TRL's bonus is the mean of their per-micro-batch token
    means; ppokit's is the minibatch's token mean (the same aggregation as the loss)."""
    case = fixed([1, 1, 1, 1, 6, 6, 6, 6, 3, 2, 5, 4])
    theirs = trl_loss(case, 4, loss_type="dapo", entropy_coef=1.0)
    mine = ours(case, 4, **GRPO, policy={"aggregation": "token_mean", "entropy_coef": 1.0})
    assert abs(float(theirs[0] - mine[0])) > 1e-3


def test_dapo_several_steps_differs() -> None:
    """``loss_type: dapo`` over several optimizer steps of one generation batch: TRL divides
    each step by (the batch's tokens) / (steps), ppokit by the step's own tokens."""
    case = fixed([1, 1, 1, 1, 6, 6, 5, 6])
    theirs = trl_loss(case, 4, steps=2, loss_type="dapo")
    mine = ours(
        case, 4, minibatches=2, **GRPO, policy={"loss": "ppo_clip", "aggregation": "token_mean"}
    )
    assert gap(theirs, mine) > 1e-3
    one = ours(
        case, 4, minibatches=1, **GRPO, policy={"loss": "ppo_clip", "aggregation": "token_mean"}
    )
    # each TRL step divides by the batch's tokens / 2: its two steps sum to twice the
    # batch's token mean
    same((theirs[0] / 2, theirs[1] / 2), one)


def test_mask_truncated_completions_differs() -> None:
    """``mask_truncated_completions`` with ``dr_grpo``: TRL keeps the truncated rows in the
    group statistics and in the row count of the normaliser; ``truncation: exclude`` takes
    them out of both."""
    case = fixed([6, 2, 3, 4, 1, 6, 6, 2])
    theirs = trl_loss(
        case, 4, loss_type="dr_grpo", scale_rewards="none", mask_truncated_completions=True
    )
    agg = {"name": "seq_mean_token_sum_norm", "norm": T}
    mine = ours(case, 4, advantage="dr_grpo", truncation="exclude", policy={"aggregation": agg})
    assert gap(theirs, mine) > 1e-4


@FAST
@given(cases(n=N, t=T), st.sampled_from(["grpo", "dr_grpo"]))
def test_mask_truncated_completions_is_untruncated_weight(case: Case, loss_type: str) -> None:
    """``mask_truncated_completions: true``: ``policy.weight: untruncated`` (the rows out of
    the loss, in their group's statistics) and, under ``grpo`` and ``dr_grpo``, the
    aggregation's ``rows: all`` (the rows still in the row count)."""
    scale = "none" if loss_type == "dr_grpo" else "group"
    theirs = trl_loss(
        case, 4, loss_type=loss_type, scale_rewards=scale, mask_truncated_completions=True
    )
    if loss_type == "dr_grpo":
        adv: dict[str, Any] = {"advantage": "dr_grpo"}
        agg: dict[str, Any] = {"name": "seq_mean_token_sum_norm", "norm": T, "rows": "all"}
    else:
        adv, agg = GRPO, {"name": "seq_mean_token_mean", "rows": "all"}
    policy = {"loss": "ppo_clip", "aggregation": agg, "weight": "untruncated"}
    same(theirs, ours(case, 4, **adv, policy=policy))


MASK_MODES = {"token_mask": "token_mis", "sequence_mask": "seq_mis"}


@FAST
@given(cases(n=N, t=T, mismatch=0.6), MICRO, st.sampled_from(sorted(MASK_MODES)))
def test_vllm_mask_modes_are_mis_rejected_zero(case: Case, micro: int, mode: str) -> None:
    """``use_vllm`` with ``vllm_importance_sampling_mode: token_mask`` / ``sequence_mask``,
    ``_clip_max: C`` and no ``_clip_min``: ``token_mis`` / ``seq_mis`` with ``low: null``,
    ``high: C``, ``rejected: zero`` (a rejected token stays in the normaliser)."""
    theirs = trl_loss(
        case, micro, loss_type="dapo", use_vllm=True, vllm_importance_sampling_mode=mode,
        vllm_importance_sampling_clip_max=1.5,
    )  # fmt: skip
    correction = {"name": MASK_MODES[mode], "low": None, "high": 1.5, "rejected": "zero"}
    policy = {"loss": "ppo_clip", "aggregation": "token_mean", "correction": correction}
    same(theirs, ours(case, micro, **GRPO, policy=policy))


def test_vllm_mask_mode_dropped_differs() -> None:
    """ppokit's default ``rejected: dropped`` takes a rejected token out of the normaliser
    where TRL's ``*_mask`` modes keep it."""
    case = fixed(spread=0.3)
    case.logp_rollout = case.logp_old + 0.8 * torch.randn(case.b, case.t, generator=torch.Generator().manual_seed(1))  # fmt: skip
    theirs = trl_loss(
        case, 4, loss_type="dapo", use_vllm=True, vllm_importance_sampling_mode="token_mask",
        vllm_importance_sampling_clip_max=1.5,
    )  # fmt: skip
    correction = {"name": "token_mis", "low": None, "high": 1.5}
    policy = {"loss": "ppo_clip", "aggregation": "token_mean", "correction": correction}
    assert gap(theirs, ours(case, 4, **GRPO, policy=policy)) > 1e-4


TRUNCATE_MODES = {"token_truncate": "token_tis", "sequence_truncate": "seq_tis"}


@FAST
@given(cases(n=N, t=T, mismatch=0.6), MICRO, st.sampled_from(sorted(TRUNCATE_MODES)))
def test_vllm_truncate_modes_are_tis(case: Case, micro: int, mode: str) -> None:
    """``use_vllm`` with ``vllm_importance_sampling_mode: token_truncate`` /
    ``sequence_truncate``, ``_clip_max: C`` and no ``_clip_min``: ``token_tis`` / ``seq_tis``
    with ``cap: C``."""
    theirs = trl_loss(
        case, micro, loss_type="dapo", use_vllm=True, vllm_importance_sampling_mode=mode,
        vllm_importance_sampling_clip_max=1.5,
    )  # fmt: skip
    correction = {"name": TRUNCATE_MODES[mode], "cap": 1.5}
    policy = {"loss": "ppo_clip", "aggregation": "token_mean", "correction": correction}
    same(theirs, ours(case, micro, **GRPO, policy=policy))


def test_vllm_truncate_clip_min_differs() -> None:
    """TRL's ``*_truncate`` with ``_clip_min: m`` raises a ratio below m to m; ppokit's
    ``*_tis`` truncate from above only: a token of ratio r < m weighs r, not m."""
    case = fixed(spread=0.3)
    gen = torch.Generator().manual_seed(1)
    case.logp_rollout = case.logp_old + 0.8 * torch.randn(case.b, case.t, generator=gen)
    theirs = trl_loss(
        case, 4, loss_type="dapo", use_vllm=True, vllm_importance_sampling_mode="token_truncate",
        vllm_importance_sampling_clip_max=1.5, vllm_importance_sampling_clip_min=0.5,
    )  # fmt: skip
    correction = {"name": "token_tis", "cap": 1.5}
    policy = {"loss": "ppo_clip", "aggregation": "token_mean", "correction": correction}
    assert gap(theirs, ours(case, 4, **GRPO, policy=policy)) > 1e-3
    assert bool(((case.logp_old - case.logp_rollout).exp() < 0.5)[case.mask].any())


@FAST
@given(cases(n=N, t=T))
def test_bnpo_one_micro_batch_is_token_mean(case: Case) -> None:
    """``loss_type: bnpo`` with one micro-batch an optimizer step
    (``gradient_accumulation_steps: 1``): ``token_mean``."""
    theirs = trl_loss(case, case.b, loss_type="bnpo")
    mine = ours(case, case.b, **GRPO, policy={"loss": "ppo_clip", "aggregation": "token_mean"})
    same(theirs, mine)


def test_bnpo_several_micro_batches_differs() -> None:
    """``bnpo`` over k micro-batches an optimizer step is the mean of their own token means;
    ``token_mean`` divides by the step's tokens: the same when the micro-batches hold as
    many tokens each, otherwise a micro-batch of fewer tokens weighs more in TRL's."""
    uneven = fixed([1, 1, 1, 1, 6, 6, 5, 6])
    policy = {"loss": "ppo_clip", "aggregation": "token_mean"}
    theirs = trl_loss(uneven, 4, loss_type="bnpo")
    assert gap(theirs, ours(uneven, 4, **GRPO, policy=policy)) > 1e-3
    even = fixed([1, 6, 2, 5, 6, 1, 5, 2])  # 14 tokens in each half
    same(trl_loss(even, 4, loss_type="bnpo"), ours(even, 4, **GRPO, policy=policy))


@FAST
@given(cases(n=N, t=T), MICRO)
def test_scale_rewards_batch_is_grpo_with_the_batch_std(case: Case, micro: int) -> None:
    """``scale_rewards: batch``: ``advantage: {name: grpo, std: batch, eps: 1e-4}`` (R − group
    mean, over the batch's unbiased std + 1e-4: Lite PPO)."""
    theirs = trl_loss(case, micro, loss_type="grpo", scale_rewards="batch")
    adv = {"name": "grpo", "std": "batch", "eps": 1e-4}
    policy = {"loss": "ppo_clip", "aggregation": "seq_mean_token_mean"}
    same(theirs, ours(case, micro, advantage=adv, policy=policy))


@FAST
@given(cases(n=N, t=T), MICRO)
def test_scale_rewards_batch_is_lite_ppo(case: Case, micro: int) -> None:
    """``scale_rewards: batch``: the example plugin's ``advantage: {name: lite_ppo, eps:
    1e-4}`` (R − group mean, over the batch's unbiased std + 1e-4)."""
    pytest.importorskip("ppokit_example")
    theirs = trl_loss(case, micro, loss_type="grpo", scale_rewards="batch")
    adv = {"name": "lite_ppo", "eps": 1e-4}
    policy = {"loss": "ppo_clip", "aggregation": "seq_mean_token_mean"}
    same(theirs, ours(case, micro, advantage=adv, policy=policy))
