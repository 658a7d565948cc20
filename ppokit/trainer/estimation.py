"""From a round's responses to what the update reads: the round's
:class:`~ppokit.batch.RolloutBatch` (:func:`round_batch`: rewards on the last token and the
no-grad forward passes π_old, V_old, π_ref) and the estimates (:func:`estimate`: truncation
rule, KL in the reward, advantages, critic targets, position mask, prompt weights).

:func:`estimate` is a pure function of the batch and the assembled components (and β):
on several processes it runs on the whole round's batch (:func:`gather_batch`) on every
process, which keeps its own rows (:meth:`UpdateData.own_rows`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
from torch import Tensor

from ppokit import distributed
from ppokit.batch import FIELDS as BATCH_FIELDS
from ppokit.batch import PART_FIELDS, RolloutBatch, take_rows
from ppokit.errors import ComponentError
from ppokit.spec import Spec
from ppokit.trainer.assembly import Assembly, optional
from ppokit.trainer.checks import count
from ppokit.trainer.forwards import Forwards
from ppokit.trainer.microbatches import MicroBatches
from ppokit.trainer.rollout import Rollout

__all__ = [
    "DEFAULT_CLIP",
    "UpdateData",
    "clip_band",
    "estimate",
    "estimate_round",
    "explained_variance",
    "gather_batch",
    "kl_controller_step",
    "kl_to_reference",
    "log_band",
    "mismatch_metrics",
    "round_batch",
]


def explained_variance(target: Tensor, pred: Tensor, mask: Tensor) -> Tensor:
    """1 − Var[Y − V] / Var[Y] over the masked positions.

    NaN when the targets have (next to) no variance, Var[Y] <= 1e-6·mean(Y²) + 1e-12: the
    ratio then says nothing (it reached -200 on the demo once rewards saturate).
    """
    m = mask.float()
    n = m.sum().clamp_min(1.0)

    def var(x: Tensor) -> Tensor:
        mu = (x * m).sum() / n
        return ((x - mu) ** 2 * m).sum() / n

    vy = var(target.float())
    resid = var(target.float() - pred.float())
    second = (target.float() ** 2 * m).sum() / n
    informative = vy > 1e-6 * second + 1e-12
    return torch.where(informative, 1 - resid / vy.clamp_min(1e-30), torch.full_like(vy, math.nan))


def kl_controller_step(
    beta: Tensor, kl: Tensor, target: float, horizon: int, n_samples: int
) -> Tensor:
    """Adaptive KL coefficient (Ziegler et al., 2019): β ← β·(1 + clip(KL/target − 1,
    −0.2, 0.2)·n/horizon), with KL the mean per-sequence KL of the last rollout."""
    error = (kl / target - 1.0).clamp(-0.2, 0.2)
    return beta * (1.0 + error * n_samples / horizon)


@dataclass
class UpdateData:
    """The tensors of one round the updates read (all ``[B, ...]`` on the device): the
    rollout (the models' inputs), the estimated batch and the estimates the batch does not
    hold. Its rows are taken one way, :meth:`rows`."""

    rollout: Rollout | None  # None: rows whose rollout is cut apart (a micro-batch's)
    batch: RolloutBatch
    advantages: Tensor
    actor_mask: Tensor  # bool [B, T]: mask' = response mask · [ω > 0] · [c > 0]
    policy_weights: Tensor  # ω [B]
    correction: Tensor  # c [B, T]: the rollout correction's weights
    nll_mask: Tensor | None  # bool [B, T]: mask' · [R > 0], when the NLL term is on
    targets: Tensor | None = None
    value_mask: Tensor | None = None  # bool [B, T]
    value_weights: Tensor | None = None
    #: on several processes: the round's longest response, the width every process's
    #: masks are gathered at (None: one process)
    round_width: int | None = None

    def rows(
        self, index: Tensor | slice, width: int | None = None, rollout: Rollout | None = None
    ) -> UpdateData:
        """The rows ``index`` of the batch and of every estimate
        (:func:`~ppokit.batch.take_rows`), their positions cut to ``width``, with
        ``rollout`` as theirs (None: a micro-batch's, cut apart by
        :meth:`~ppokit.trainer.microbatches.Micro.rollout`)."""
        taken: dict[str, Any] = {
            f.name: take_rows(getattr(self, f.name), index, width)
            for f in fields(self)
            if f.name not in ("rollout", "batch", "round_width")
        }
        batch = self.batch.rows(index, width)
        return replace(self, rollout=rollout, batch=batch, **taken)

    def own_rows(self, rollout: Rollout, rows: slice) -> UpdateData:
        """This process's ``rows`` of data estimated on the whole round, with its own
        ``rollout`` (whose responses may be shorter than the round's longest)."""
        mine = self.rows(rows, rollout.response_mask.shape[1], rollout)
        return replace(mine, round_width=self.batch.seq_len)


def gather_batch(batch: RolloutBatch, rows: int) -> RolloutBatch:
    """The whole round's batch from every process's ``batch`` (``rows`` rows each), padded
    to the round's longest response; group ids are made unique across processes."""
    length = distributed.max_over_processes(batch.seq_len, batch.device)
    gathered: dict[str, Any] = {}
    for name in BATCH_FIELDS:
        x = getattr(batch, name)
        if x is None:
            continue
        if name == "group_ids":
            x = x + distributed.world().rank * rows
        # a [B, K] field has the same K on every process: nothing to pad
        gathered[name] = distributed.gather_rows(x, x.shape[1] if name in PART_FIELDS else length)
    return RolloutBatch(**gathered)


def round_batch(
    ro: Rollout,
    scores: Tensor,
    baseline: Tensor | None,
    *,
    n: int,
    forwards: Forwards,
    assembly: Assembly,
    recompute_logp_old: bool,
    parts: tuple[Tensor, Tensor] | None = None,
    micro: MicroBatches | None = None,
) -> RolloutBatch:
    """The round's batch: R on each response's last token (a multi-turn episode's turn
    rewards on its turns' last tokens, the rest of its R on its last token; its
    environment's tokens as ``env_mask``), the engine's log μ, groups of
    ``n`` responses, and (no-grad forwards) log π_old (the engine's log μ unless
    ``recompute_logp_old``), the critic's values with the value after each row's last token,
    and log π_ref; ``parts``: each reward's scores and weights, ``[B, K]`` each (the
    batch's ``reward_parts`` and ``reward_weights``); by a token budget (``micro``),
    each pass over its micro-batches."""
    mask = ro.response_mask
    b = mask.shape[0]
    device = mask.device
    batch = RolloutBatch(
        response_mask=mask,
        token_rewards=torch.zeros(mask.shape, dtype=torch.float32, device=device),
        logp_old=ro.logp_rollout,
        logp_rollout=ro.logp_rollout,
        group_ids=torch.arange(b, device=device) // n,
        truncated=ro.truncated,
        baseline_rewards=baseline,
        env_mask=ro.env_mask,
        reward_parts=None if parts is None else parts[0],
        reward_weights=None if parts is None else parts[1],
        weight_version=ro.version,
    )
    if ro.turn_rewards is None:
        rewards = torch.where(batch.last_mask, scores[:, None], 0.0)
    else:  # the turn rewards where they happened, the spec's rewards at the end
        outcome = scores - ro.turn_rewards.sum(1)
        rewards = ro.turn_rewards + torch.where(batch.last_mask, outcome[:, None], 0.0)
    batch = batch.replace(token_rewards=rewards)
    with torch.no_grad():
        return _forward_passes(batch, ro, micro, forwards, assembly, recompute_logp_old)


def _forward_passes(
    batch: RolloutBatch,
    ro: Rollout,
    micro: MicroBatches | None,
    forwards: Forwards,
    assembly: Assembly,
    recompute_logp_old: bool,
) -> RolloutBatch:
    """:func:`round_batch`'s no-grad passes, in one pass over the whole round or, by a token
    budget (``micro``), over its micro-batches, each cut to its own rows' lengths; the
    results placed in the round's ``[B, T]``: log π_old, the critic's values V_old with the
    value after each row's last token, log π_ref."""
    models, mask = forwards.models, ro.response_mask
    b, t = mask.shape
    logp_old = mask.new_zeros((b, t), dtype=torch.float32) if recompute_logp_old else None
    logp_ref = mask.new_zeros((b, t), dtype=torch.float32) if models.has_reference else None
    head_out = None
    if logp_old is None and logp_ref is None and models.critic is None:
        return batch  # no pass to run
    passes: list[tuple[Tensor | slice, Rollout]]
    if micro is not None and micro.budget is not None:
        passes = [(m.index, m.rollout(ro)) for m in micro.whole(b, mask.device)]
    else:  # the whole round in one pass
        passes = [(slice(None), ro)]
    for rows, part in passes:
        width = part.response_ids.shape[1]
        if logp_old is not None:
            logp_old[rows, :width] = forwards.policy_logprobs(part)
        if models.critic is not None:
            shared = forwards.hidden(models.actor, part) if models.shared_critic else None
            out = forwards.critic_head_out(part, shared)
            if head_out is None:
                head_out = out.new_zeros((b, t + 1, out.shape[-1]))
            head_out[rows, : width + 1] = out
        if logp_ref is not None:
            logp_ref[rows, :width] = forwards.reference_logprobs(part)
    if logp_old is not None:
        batch = batch.replace(logp_old=logp_old * mask)
    if head_out is not None:
        v_all = assembly.value(head_out)  # [B, T+1]
        batch = batch.replace(
            values=v_all[:, :-1] * mask,
            bootstrap_values=v_all.gather(1, batch.last_index[:, None] + 1).squeeze(1),
        )
    if logp_ref is not None:
        batch = batch.replace(logp_ref=logp_ref * mask)
    return batch


def kl_to_reference(
    batch: RolloutBatch,
    spec: Spec,
    assembly: Assembly,
    kl_coef: Tensor,
    metrics: dict[str, Tensor],
) -> tuple[RolloutBatch, Tensor]:
    """KL(π_old ‖ π_ref) per sequence (the ``kl`` metric); with the ``reward`` placement
    r_t ← r_t − β·kl_t; then the adaptive controller's step of β. Returns the batch and β."""
    kl = spec.kl
    assert kl is not None and assembly.kl is not None
    assert batch.logp_old is not None and batch.logp_ref is not None
    estimate_ = assembly.kl(batch.logp_old, batch.logp_ref).float()
    kl_tok = estimate_ * batch.maskf
    kl_seq = kl_tok.sum(1).mean()
    metrics["kl"] = kl_seq
    metrics["kl_coef"] = kl_coef.clone()
    if kl.placement == "reward":
        batch = batch.replace(token_rewards=batch.token_rewards - kl_coef * kl_tok)
    if kl.target is not None:
        kl_coef = kl_controller_step(kl_coef, kl_seq, kl.target, kl.horizon, batch.batch_size)
    return batch, kl_coef


#: The band of the ratios π_old/μ and π/π_old that ``rollout/mismatch_outside`` and
#: ``ratio_outside`` count outside, [1 − clip_low, 1 + clip_high], where the spec's policy
#: loss has no ``clip_low`` or ``clip_high`` of its own: PPO's default 0.2 each side.
DEFAULT_CLIP = 0.2


def clip_band(spec: Spec) -> tuple[float, float]:
    """[1 − clip_low, 1 + clip_high] of the spec's policy loss (its parameters with their
    defaults), each side :data:`DEFAULT_CLIP` where the loss has no such parameter."""
    from ppokit.registry import get_registry

    loss = spec.policy.loss
    params = get_registry().info("policy_loss", loss.name).validate(loss.params)
    low = getattr(params, "clip_low", None)
    high = getattr(params, "clip_high", None)
    low = DEFAULT_CLIP if not isinstance(low, (int, float)) else float(low)
    high = DEFAULT_CLIP if not isinstance(high, (int, float)) else float(high)
    return 1.0 - low, 1.0 + high


def log_band(band: tuple[float, float]) -> tuple[float, float]:
    """The logs of a ratio band's ends (−inf for a lower end of 0: nothing is below it)."""
    low, high = band
    return (math.log(low) if low > 0 else -math.inf), math.log(high)


def mismatch_metrics(
    batch: RolloutBatch, band: tuple[float, float] = (1.0 - DEFAULT_CLIP, 1.0 + DEFAULT_CLIP)
) -> dict[str, Tensor]:
    """How far the engine's μ is from π_old on the sampled tokens, Δ_t = log π_old − log μ
    over the response mask: ``rollout/mismatch_k1`` = mean(−Δ) and ``rollout/mismatch_k3``
    = mean(e^Δ − 1 − Δ), two estimates of KL(μ ‖ π_old) per token,
    ``rollout/mismatch_max`` = max |Δ|, ``rollout/mismatch_outside`` the fraction of tokens
    whose ratio w = π_old/μ = e^Δ lies outside ``band`` (the policy loss's clip band,
    :func:`clip_band`), and ``rollout/mismatch_ess`` = (Σw)² / (N Σw²), the effective
    sample size of the importance weights over the N tokens as a fraction of N (1: μ = π_old
    up to a constant). Empty without both log-probs."""
    if batch.logp_old is None or batch.logp_rollout is None:
        return {}
    mask = batch.response_mask
    delta = torch.where(mask, batch.logp_old.float() - batch.logp_rollout.float(), 0.0)
    tokens = batch.lengths.sum().clamp_min(1)
    k3 = delta.clamp(max=30.0).exp() - 1 - delta
    # w / max w: the ESS is scale-free, and the shift keeps e^Δ finite
    top = torch.where(mask, delta, -math.inf).amax() if delta.numel() else delta.new_zeros(())
    w = torch.where(mask, (delta - top).exp(), 0.0)
    ess = w.sum() ** 2 / (tokens * (w**2).sum()).clamp_min(1e-30)
    low, high = log_band(band)
    outside = mask & ((delta < low) | (delta > high))
    return {
        "rollout/mismatch_k1": (-delta).sum() / tokens,
        "rollout/mismatch_k3": torch.where(mask, k3, 0.0).sum() / tokens,
        "rollout/mismatch_max": delta.abs().max() if delta.numel() else delta.new_zeros(()),
        "rollout/mismatch_outside": outside.sum() / tokens,
        "rollout/mismatch_ess": torch.where(mask.any(), ess, 1.0),
    }


def reported(slot: str, component: Any, batch: RolloutBatch, out: Tensor) -> dict[str, Tensor]:
    """The diagnostics a component reports on the round (its optional ``metrics(batch,
    out)`` member, declared in its catalogue entry): each a one-element tensor."""
    report = getattr(component, "metrics", None)
    if not callable(report):
        return {}
    values = report(batch, out)
    for name, value in dict(values).items():
        if not isinstance(name, str) or not isinstance(value, Tensor) or value.numel() != 1:
            raise ComponentError(
                f"{slot} reported metric {name!r} as {type(value).__name__}: expected a "
                "one-element tensor per metric name"
            )
    return dict(values)


def estimate(
    ro: Rollout,
    batch: RolloutBatch,
    scores: Tensor,
    *,
    spec: Spec,
    assembly: Assembly,
    kl_coef: Tensor,
) -> tuple[UpdateData, dict[str, Tensor], Tensor]:
    """Truncation rule → KL in the reward → what the updates read: advantages A, prompt
    weights ω and rollout-correction weights c with the actor's masks
    mask' = mask·[ω > 0]·[c > 0] (a correction that ``keeps_rejected``: mask·[ω > 0]) and
    mask'·[R > 0]; critic
    targets Y, position mask m^V and weights. Returns them with their metrics and β after
    the adaptive controller's step (each component counts its estimates into the round's
    non-finite counter; the critic's values V_old are counted here)."""
    parts, metrics = assembly, {}
    for values in (batch.values, batch.bootstrap_values):
        if values is not None:
            count("the critic's forward pass", values, "values")
    metrics.update(mismatch_metrics(batch, clip_band(spec)))
    batch = parts.truncation(batch)
    if spec.kl is not None:
        batch, kl_coef = kl_to_reference(batch, spec, parts, kl_coef, metrics)
    adv = parts.advantage(batch).float().detach()
    weights = parts.policy_weight(batch).float().detach()
    correction = parts.correction(batch).float().detach()
    kept = batch.response_mask
    if not optional(parts.correction, "rollout_correction", "keeps_rejected"):
        kept = kept & (correction > 0)
    actor_mask = kept & (weights > 0)[:, None]
    nll_mask = actor_mask & (scores > 0)[:, None] if spec.policy.nll_coef > 0 else None
    data = UpdateData(ro, batch, adv, actor_mask, weights, correction, nll_mask)
    for slot, component, out in (
        ("advantage", parts.advantage, adv),
        ("policy.weight", parts.policy_weight, weights),
        ("policy.correction", parts.correction, correction),
    ):
        metrics.update(reported(str(parts.name(slot)), component, batch, out))
    tokens = batch.lengths.sum().clamp_min(1)  # positions the estimators saw
    metrics["advantage_mean"] = (adv * batch.maskf).sum() / tokens
    if parts.critic_target is not None:
        assert parts.critic_mask and parts.critic_weight and batch.values is not None
        data.targets = parts.critic_target(batch).float().detach()
        data.value_mask = parts.critic_mask(batch).detach().float() > 0
        data.value_weights = parts.critic_weight(batch).float().detach()
        for slot, component, out in (
            ("critic.target", parts.critic_target, data.targets),
            ("critic.mask", parts.critic_mask, data.value_mask),
            ("critic.weight", parts.critic_weight, data.value_weights),
        ):
            metrics.update(reported(str(parts.name(slot)), component, batch, out))
        metrics["explained_variance"] = explained_variance(
            data.targets, batch.values, batch.response_mask
        )
        # mean |Y - V_old|: stays meaningful when Var[Y] is near 0 and EV is not
        value_error = ((data.targets - batch.values).abs() * batch.maskf).sum()
        metrics["value_error"] = value_error / tokens
    return data, metrics, kl_coef


def estimate_round(
    ro: Rollout,
    batch: RolloutBatch,
    scores: Tensor,
    *,
    spec: Spec,
    assembly: Assembly,
    kl_coef: Tensor,
) -> tuple[UpdateData, dict[str, Tensor], Tensor, Tensor]:
    """:func:`estimate` on the whole round: on several processes every process estimates
    the gathered round (every process's ``batch`` and ``scores``) and keeps its own rows.
    Returns the data, the metrics, β after the controller's step and the round's scores."""
    world = distributed.world()
    b = batch.batch_size  # this process's rows
    if world.distributed:
        batch, scores = gather_batch(batch, b), distributed.gather_rows(scores)
    data, metrics, kl_coef = estimate(
        ro, batch, scores, spec=spec, assembly=assembly, kl_coef=kl_coef
    )
    if world.distributed:
        data = data.own_rows(ro, slice(world.rank * b, (world.rank + 1) * b))
    return data, metrics, kl_coef, scores
