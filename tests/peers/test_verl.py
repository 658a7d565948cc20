"""Each row of docs/from-trl-verl.md that maps a verl option onto a ppokit spec, held
against verl 0.9.1's own ``verl.trainer.ppo.core_algos`` (the GRPO advantage estimator, the
vanilla (dual-clip) policy loss, ``agg_loss``'s modes with the minibatch's
``global_batch_info``, ``kl_penalty``, the critic's ``compute_value_loss``) on generated
batches: the loss and its gradient w.r.t. the policy's log-probs (the critic's: w.r.t. its
values), summed over the micro-batches of a minibatch as verl's actor and critic
backpropagate them."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers.peers import Case, cases, fixed, ppokit_critic_loss, ppokit_loss, spec_of
from tests.peers.test_verl_advantage import values_of

pytest.importorskip("verl")
core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")

N, T = 4, 6
FAST = settings(max_examples=12, deadline=None, derandomize=True)
MICRO = st.sampled_from([2, 4])


def actor_config(info: dict[str, Any], **kw: Any) -> Any:
    """verl's ``ActorConfig`` (GSPO's and CISPO's losses require one) with the minibatch's
    ``global_batch_info``."""
    from verl.workers.config.actor import ActorConfig

    fields = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0, **kw}
    config = ActorConfig(strategy="fsdp", ppo_micro_batch_size_per_gpu=2, rollout_n=N, **fields)
    config.global_batch_info.update(info)
    return config


def verl_loss(
    case: Case, micro: int, mode: str, *, norm_by_std: bool = True, kl: str | None = None,
    kl_coef: float = 0.0, entropy_coeff: float = 0.0, scale: float | None = None,
    loss_mode: str = "vanilla", adv: torch.Tensor | None = None, **config: Any,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """verl's advantage on the whole batch (GRPO's unless ``adv`` is given), then its
    actor's loss of each micro-batch (``workers/utils/losses.py``'s ``ppo_loss``)."""
    batch = case.batch()
    mask = batch.response_mask.float()
    if adv is None:
        adv, _ = core_algos.compute_grpo_outcome_advantage(
            batch.token_rewards, mask, np.asarray(batch.group_ids), 1e-6, norm_by_std
        )
    info = {
        "dp_size": 1, "batch_num_tokens": mask.sum(), "global_batch_size": (mask.sum(-1) > 0).sum(),
        "loss_scale_factor": scale,
    }  # fmt: skip
    actor = actor_config(info, **config)
    policy_loss = core_algos.get_policy_loss_fn(loss_mode)
    logp = case.fresh()
    total = torch.zeros(())
    for j in torch.arange(case.b).split(micro):
        pg, _ = policy_loss(case.logp_old[j], logp[j], adv[j], mask[j].bool(), mode, actor)
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


#: verl's ``kl_loss_type`` / ``kl_penalty`` -> ppokit's estimator (a trailing ``+``: the
#: straight-through gradient of k2, ppokit's ``straight_through: true``)
KL = {"low_var_kl": "k3", "k3": "k3", "kl": "k1", "k1": "k1", "mse": "k2", "k2": "k2",
      "abs": "abs", "low_var_kl+": "k3+", "k3+": "k3+", "kl+": "k1+", "abs+": "abs+"}  # fmt: skip


def estimator(kind: str) -> dict[str, Any]:
    name = KL[kind]
    return {"name": name.rstrip("+"), "straight_through": name.endswith("+")}


@FAST
@given(cases(n=N, t=T), MICRO, st.sampled_from(sorted(KL)))
def test_kl_loss_type(case: Case, micro: int, kind: str) -> None:
    """``use_kl_loss``, ``kl_loss_coef: β``, ``kl_loss_type``: ``kl: {estimator, coef: β,
    placement: loss}`` (``low_var_kl``/``k3`` k3, ``kl``/``k1`` k1, ``mse``/``k2`` k2,
    ``abs`` abs; a trailing ``+``: the estimator's ``straight_through: true``)."""
    theirs = verl_loss(case, micro, "token-mean", kl=kind, kl_coef=0.1)
    kl = {"estimator": estimator(kind), "coef": 0.1, "placement": "loss"}
    policy = {"loss": CLIP, "aggregation": "token_mean"}
    same(theirs, ours(case, micro, advantage="grpo", kl=kl, policy=policy))


@FAST
@given(cases(n=N, t=T, spread=0.01), MICRO, st.sampled_from(["seq-mean-token-mean", "token-mean"]))
def test_gspo_loss_mode(case: Case, micro: int, mode: str) -> None:
    """``policy_loss.loss_mode: gspo`` with ``clip_ratio_low``/``_high``: ``policy.loss:
    {name: gspo, clip_low, clip_high}``, under the aggregation of ``loss_agg_mode``."""
    theirs = verl_loss(
        case, micro, mode, loss_mode="gspo", clip_ratio_low=3e-3, clip_ratio_high=4e-3
    )
    loss = {"name": "gspo", "clip_low": 3e-3, "clip_high": 4e-3}
    policy = {"loss": loss, "aggregation": AGGREGATIONS[mode]}
    same(theirs, ours(case, micro, advantage="grpo", policy=policy))


@FAST
@given(cases(n=N, t=T, spread=0.5), MICRO)
def test_cispo_without_lower_clip(case: Case, micro: int) -> None:
    """``policy_loss.loss_mode: cispo`` with ``clip_ratio_low: 1`` (no lower bound) and
    ``clip_ratio_high: h``: ``policy.loss: {name: cispo, clip_high: h}``."""
    theirs = verl_loss(
        case, micro, "token-mean", loss_mode="cispo", clip_ratio_low=1.0, clip_ratio_high=0.3
    )
    policy = {"loss": {"name": "cispo", "clip_high": 0.3}, "aggregation": "token_mean"}
    same(theirs, ours(case, micro, advantage="grpo", policy=policy))


def test_cispo_lower_clip_differs() -> None:
    """verl's ``cispo`` clamps the IS weight below at 1 − ``clip_ratio_low`` too (0.2 by
    default: 0.8), ppokit's only above: a token of ratio ρ < 0.8 weighs ρ in ppokit, 0.8
    in verl."""
    case = fixed(spread=0.5)
    theirs = verl_loss(case, 4, "token-mean", loss_mode="cispo", clip_ratio_high=0.3)
    policy = {"loss": {"name": "cispo", "clip_high": 0.3}, "aggregation": "token_mean"}
    mine = ours(case, 4, advantage="grpo", policy=policy)
    assert float((theirs[1] - mine[1]).abs().max()) > 1e-2
    assert bool(((case.logp - case.logp_old).exp() < 0.8)[case.mask].any())


def apply_kl_penalty() -> Any:
    """verl's ``ray_trainer.apply_kl_penalty``, its own source (the module imports
    ``torchdata`` and Ray, which the function does not use)."""
    import ast
    import importlib.util
    from pathlib import Path

    from verl.utils.torch_functional import masked_mean

    spec = importlib.util.find_spec("verl.trainer.ppo.ray_trainer")
    assert spec is not None and spec.origin is not None
    tree = ast.parse(Path(spec.origin).read_text())
    fn = next(
        f for f in tree.body if isinstance(f, ast.FunctionDef) and f.name == "apply_kl_penalty"
    )
    scope = {"core_algos": core_algos, "torch": torch, "masked_mean": masked_mean, "DataProto": Any}
    exec(compile(ast.Module([fn], []), spec.origin, "exec"), scope)
    return scope["apply_kl_penalty"]


class Data:
    """The ``DataProto`` fields ``apply_kl_penalty`` reads and writes."""

    def __init__(self, case: Case) -> None:
        batch = case.batch()
        self.batch: Any = type("TensorDict", (dict,), {"batch_size": (case.b,)})(
            response_mask=batch.response_mask.float(), token_level_scores=batch.token_rewards,
            old_log_probs=case.logp_old, ref_log_prob=case.logp_ref,
        )  # fmt: skip


def reward_kl(case: Case, kl: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """ppokit's rewards after the ``reward`` placement's −β·kl, and the next β."""
    from ppokit.trainer.assembly import Assembly
    from ppokit.trainer.estimation import kl_to_reference

    spec = spec_of(advantage="grpo", kl=kl)
    batch, beta = kl_to_reference(
        case.batch(), spec, Assembly.from_spec(spec), torch.tensor(kl["coef"]), {}
    )
    return batch.token_rewards * case.mask, beta


REWARD_KL = ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"]


@FAST
@given(cases(n=N, t=T), st.sampled_from(REWARD_KL))
def test_kl_in_reward(case: Case, kind: str) -> None:
    """``use_kl_in_reward``, ``kl_penalty``, ``kl_ctrl.kl_coef: β`` (``kl_ctrl.type:
    fixed``): ``kl: {estimator, coef: β, placement: reward}`` (r_t − β·kl(π_old, π_ref)
    on each response token)."""
    data = Data(case)
    apply_kl_penalty()(data, core_algos.FixedKLController(0.1), kind)
    mine, beta = reward_kl(case, {"estimator": estimator(kind), "coef": 0.1, "placement": "reward"})  # fmt: skip
    torch.testing.assert_close(mine, data.batch["token_level_rewards"], rtol=1e-5, atol=1e-6)
    assert float(beta) == pytest.approx(0.1)


def test_adaptive_kl_target_is_per_sequence_sum() -> None:
    """``kl_ctrl.type: adaptive`` with ``target_kl: t``, ``horizon: h``: ``kl.target``,
    ``kl.horizon``; verl measures the KL as each response's token mean, ppokit as its token
    sum, so ppokit's ``target`` is verl's ``target_kl`` × the response length: the same β
    when every response has L tokens (``target: t·L``), another one when lengths vary."""
    kl = {"estimator": "k2", "coef": 0.1, "placement": "reward", "horizon": 100}
    for lengths, alike in (([4] * 8, True), ([1, 6, 2, 6, 1, 1, 1, 6], False)):
        case = fixed(lengths, t=T, seed=3)
        k2 = 0.5 * (case.logp_old - case.logp_ref).square() * case.mask
        per_token = float(k2.sum(1).div(case.lengths).mean())
        target = 1.1 * per_token  # inside the controller's ±20% band
        control = core_algos.AdaptiveKLController(0.1, target, 100)
        apply_kl_penalty()(Data(case), control, "mse")
        assert control.value != 0.1
        _, beta = reward_kl(case, {**kl, "target": target * 4})
        assert bool(abs(float(beta) - control.value) < 1e-7) is alike, (float(beta), control.value)


@FAST
@given(cases(n=N, t=T), MICRO)
def test_entropy_coeff(case: Case, micro: int) -> None:
    """``actor.entropy_coeff``: ``policy.entropy_coef`` (the loss's aggregation)."""
    policy = {"loss": CLIP, "aggregation": "token_mean", "entropy_coef": 0.05}
    theirs = verl_loss(case, micro, "token-mean", entropy_coeff=0.05)
    same(theirs, ours(case, micro, advantage="grpo", policy=policy))


def predictions(case: Case, seed: int = 1) -> torch.Tensor:
    """The critic's new values: V_old (``values_of``) moved by up to about ±1.5, so that
    some leave a clip range of 0.2..0.5 and some do not (a leaf)."""
    gen = torch.Generator().manual_seed(seed)
    moved = values_of(case) + 0.6 * torch.randn(case.b, case.t, generator=gen)
    return moved.requires_grad_(True)


def verl_value_loss(
    case: Case, micro: int, mode: str, clip: float, gamma: float = 1.0, lam: float = 1.0,
    scale: float | None = None, rewards: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """verl's critic loss (``workers/utils/losses.py``'s ``value_loss``: ``compute_value_loss``
    with the minibatch's ``global_batch_info``) of each micro-batch on the returns of
    ``compute_gae_advantage_return`` (of ``rewards``, default the case's outcome rewards),
    summed, and its gradient w.r.t. the predictions."""
    batch = case.batch()
    mask = batch.response_mask
    token_rewards = batch.token_rewards if rewards is None else rewards
    values = values_of(case)
    _, returns = core_algos.compute_gae_advantage_return(
        token_rewards, values, mask.float(), gamma, lam
    )
    info = {"dp_size": 1, "batch_num_tokens": mask.sum(), "global_batch_size": (mask.sum(-1) > 0).sum()}  # fmt: skip
    vpreds = predictions(case)
    total = torch.zeros(())
    for j in torch.arange(case.b).split(micro):
        loss, _ = core_algos.compute_value_loss(
            vpreds[j], returns[j], values[j], mask[j], clip, mode, loss_scale_factor=scale, **info
        )
        total = total + loss
    total.backward()
    assert vpreds.grad is not None
    return total.detach(), vpreds.grad


def our_value_loss(
    case: Case, micro: int, spec: Any, **fields: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    vpreds = predictions(case)
    total = ppokit_critic_loss(spec, case, vpreds, micro, values=values_of(case), **fields)
    total.backward()
    assert vpreds.grad is not None
    return total.detach(), vpreds.grad


def gae_spec(
    clip: float, aggregation: Any, gamma: float = 1.0, lam: float = 1.0, **train: Any
) -> Any:
    """``adv_estimator: gae``'s spec: the critic on λ-returns with ``clipped_mse``."""
    return spec_of(
        model={"actor": "demo", "critic": "separate"},
        advantage={"name": "gae", "gamma": gamma, "lam": lam},
        truncation="terminal",
        critic={"target": {"name": "lambda_return", "gamma": gamma, "lam": lam},
                "loss": {"name": "clipped_mse", "clip": clip}, "aggregation": aggregation},
        train=train,
    )  # fmt: skip


VALUE_MODES = {**AGGREGATIONS, "seq-mean-token-sum-norm": {"name": "seq_mean_token_sum_norm", "norm": 8.0}}  # fmt: skip


@FAST
@given(cases(n=N, t=T), MICRO, st.sampled_from(sorted(VALUE_MODES)), st.sampled_from([0.2, 0.5]))
def test_value_loss_is_clipped_mse_with_vf_coef_one(
    case: Case, micro: int, mode: str, clip: float
) -> None:
    """``critic.cliprange_value: c``, ``critic.loss_agg_mode`` (by default the actor's
    ``loss_agg_mode``; ``loss_scale_factor``): ``critic.loss: {name: clipped_mse, clip: c}``,
    ``critic.aggregation`` of the same name, ``train.vf_coef: 1`` (verl's value loss has no
    coefficient; ppokit's ``clipped_mse`` carries verl's ½)."""
    scale = 8.0 if mode == "seq-mean-token-sum-norm" else None
    theirs = verl_value_loss(case, micro, mode, clip, gamma=0.9, lam=0.95, scale=scale)
    spec = gae_spec(clip, VALUE_MODES[mode], gamma=0.9, lam=0.95, vf_coef=1.0)
    same(theirs, our_value_loss(case, micro, spec))


def test_value_loss_is_vf_coef_times_verls() -> None:
    """ppokit's critic loss is ``train.vf_coef`` × verl's: half of it at ppokit's default
    ``vf_coef: 0.5``, a tenth under the ``ppo`` variant's ``vf_coef: 0.1``; the gradient
    w.r.t. the values the same factor (``ppokit convert`` writes ``vf_coef: 1``)."""
    case = fixed()
    theirs = verl_value_loss(case, 4, "token-mean", 0.5)
    for coef in (0.5, 0.1):
        mine = our_value_loss(case, 4, gae_spec(0.5, "token_mean", vf_coef=coef))
        same((coef * theirs[0], coef * theirs[1]), mine)
        assert float((theirs[1] - mine[1]).abs().max()) > 1e-2
