"""The update: ``ppo_epochs`` passes of shuffled minibatch steps over a round's
:class:`~ppokit.trainer.estimation.UpdateData`, each step the sum of its micro-batches'
losses (the actor and critic objectives of docs/design.md) and one optimizer step per model.

Every micro-batch uses the whole minibatch's aggregation denominators (on several
processes, the whole minibatch of every process), so gradient accumulation is exact. Before
each optimizer step the loss terms, losses and gradient norms are checked for NaN and inf
(one host read per step); a bad step changes no parameter.
"""

from __future__ import annotations

import math
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ppokit import distributed
from ppokit.spec import Spec
from ppokit.trainer.assembly import aggregate, denominator, optional
from ppokit.trainer.checks import NonFinite
from ppokit.trainer.estimation import UpdateData
from ppokit.trainer.metrics import Meter
from ppokit.trainer.models import Models
from ppokit.trainer.rollout import Rollout

if TYPE_CHECKING:
    from ppokit.trainer.round import Learner

__all__ = [
    "UpdateResult",
    "accumulate",
    "lr_factor",
    "optimizer_steps",
    "optimizers",
    "peak_memory_gb",
    "step",
    "update",
]


def optimizer_steps(spec: Spec) -> tuple[int, int]:
    """(the actor's, the critic's) optimizer steps in a run of ``spec`` with none skipped:
    ``ppo_epochs`` passes of ceil(responses of a round / minibatch) steps a round, the
    actor's none in the ``critic_warmup_rounds``."""
    t, r = spec.train, spec.rollout
    responses = r.prompts_per_round * r.n
    per_round = t.ppo_epochs * -(-responses // (t.minibatch_size or responses))
    actor_rounds = max(0, t.rounds - t.critic_warmup_rounds)
    return actor_rounds * per_round, t.rounds * per_round


def lr_factor(train: Any, steps: int) -> Callable[[int], float]:
    """``factor(k)``: the learning rate of optimizer step ``k + 1`` (``k`` steps taken) as
    a fraction of the spec's, for a run of ``steps`` steps: transformers' schedule of
    ``train.lr_schedule`` (``constant``: ``get_constant_schedule_with_warmup``;
    ``linear``: ``get_polynomial_decay_schedule_with_warmup`` with power 1, which is
    ``get_linear_schedule_with_warmup`` down to ``min_lr_ratio``; ``cosine``:
    ``get_cosine_with_min_lr_schedule_with_warmup``) evaluated at the step's number,
    1-based: the warm-up's first step is not a step at rate 0, and the run's last step has
    the rate ``min_lr_ratio`` (later steps, after a resume that added rounds, keep it)."""
    from transformers import (
        get_constant_schedule_with_warmup,
        get_cosine_with_min_lr_schedule_with_warmup,
        get_polynomial_decay_schedule_with_warmup,
    )

    warmup = train.warmup_steps
    total = max(steps, warmup + 1)
    probe = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)  # rate 1: factors
    if train.min_lr_ratio >= 1.0:  # no decay: the constant schedule
        made = get_constant_schedule_with_warmup(probe, warmup)
    elif train.lr_schedule == "linear":
        made = get_polynomial_decay_schedule_with_warmup(
            probe, warmup, total, lr_end=train.min_lr_ratio, power=1.0
        )
    elif train.lr_schedule == "cosine":
        made = get_cosine_with_min_lr_schedule_with_warmup(
            probe, warmup, total, min_lr_rate=train.min_lr_ratio
        )
    else:
        made = get_constant_schedule_with_warmup(probe, warmup)
    shape = made.lr_lambdas[0]

    def factor(k: int) -> float:
        return float(shape(min(k + 1, total)))

    return factor


def peak_memory_gb(device: torch.device) -> float:
    """Peak memory so far: the CUDA caching allocator's peak, else the process's max RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


Schedule = torch.optim.lr_scheduler.LambdaLR


def optimizers(
    spec: Spec, models: Models
) -> tuple[torch.optim.Optimizer, Schedule, torch.optim.Optimizer | None, Schedule | None]:
    """AdamW and its learning-rate schedule for the actor, and for the critic when there is
    one: ``(actor_opt, actor_sched, critic_opt, critic_sched)``; the schedules follow
    ``train.lr_schedule`` over the run's optimizer steps (:func:`lr_factor`)."""
    t = spec.train
    actor_steps, critic_steps = optimizer_steps(spec)

    def adamw(params: Any, lr: float, steps: int) -> tuple[torch.optim.Optimizer, Schedule]:
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=t.weight_decay)
        return opt, Schedule(opt, lr_factor(t, steps))

    actor_opt, actor_sched = adamw(models.actor_parameters(), t.actor_lr, actor_steps)
    if models.critic is None:
        return actor_opt, actor_sched, None, None
    critic = adamw(list(models.critic_parameters()), t.critic_lr, critic_steps)
    return (actor_opt, actor_sched, *critic)


@dataclass
class UpdateResult:
    """The update's metric tensors (read with the round's), the skipped steps' messages and
    its host-side measurements."""

    metrics: dict[str, Tensor] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)


def _merge(into: Meter, step_meter: Meter) -> None:
    """Add a step's metric sums and counts to the round's."""
    for name, totals in step_meter.totals.items():
        into.totals.setdefault(name, []).extend(totals)
        into.counts.setdefault(name, []).extend(step_meter.counts[name])


def update(lrn: Learner, data: UpdateData, train_actor: bool) -> UpdateResult:
    """``ppo_epochs`` passes of shuffled minibatch steps with gradient accumulation. A round
    whose rewards or estimates were bad (``data.skip``) has no update at all; a bad step is
    dropped and counted in ``skipped_steps`` (``on_nonfinite: skip``) or raises."""
    start = time.perf_counter()
    t = lrn.spec.train
    b = data.batch.batch_size  # this process's rows
    mb = t.minibatch_size // distributed.world().size if t.minibatch_size else b
    micro = t.micro_batch_size or mb
    meter = Meter()
    result = UpdateResult()
    if not data.skip:
        lrn.forwards.train_mode()
        for _epoch in range(t.ppo_epochs):
            perm = torch.randperm(b).to(lrn.device)
            for s in range(0, b, mb):
                message = step(lrn, data, perm[s : s + mb], micro, train_actor, meter)
                if message is not None:
                    result.skipped.append(message)
        skipped = float(len(result.skipped))
        result.metrics["skipped_steps"] = torch.full((), skipped, device=lrn.device)
    result.metrics.update(meter.means(distributed.all_sum))
    result.timings["time_update"] = time.perf_counter() - start
    result.timings["peak_memory_gb"] = peak_memory_gb(lrn.device)
    return result


def step(
    lrn: Learner, data: UpdateData, idx: Tensor, micro: int, train_actor: bool, meter: Meter
) -> str | None:
    """One optimizer step per model on the minibatch ``idx``, if its loss terms, losses
    and gradient norms are finite (one host read); else none, and the message of the
    skipped step (or NonFiniteError). The step's metrics go into ``meter`` only when it
    is taken."""
    checks = NonFinite()
    step_meter = Meter()
    accumulate(lrn, data, idx, micro, train_actor, step_meter, checks)
    parts = lrn.assembly
    limit = lrn.spec.train.max_grad_norm
    norms: list[tuple[str, torch.optim.Optimizer, Any, Tensor]] = []
    if train_actor:
        norm = _clip(lrn.actor_opt, limit)
        checks.add("the actor's gradient norm", norm, "scalar", parts.name("policy.loss").inline)
        norms.append(("grad_norm_actor", lrn.actor_opt, lrn.actor_sched, norm))
    if lrn.critic_opt is not None:
        norm = _clip(lrn.critic_opt, limit)
        source = parts.name("critic.loss").inline
        checks.add("the critic's gradient norm", norm, "scalar", source)
        norms.append(("grad_norm_critic", lrn.critic_opt, lrn.critic_sched, norm))
    problem = checks.read_problem()  # once per optimizer step
    if problem is not None:
        _zero_grad(lrn)
        return lrn.guard(lrn.round, problem, "the optimizer step is skipped")
    lrn.guard.good()
    for name, opt, sched, norm in norms:
        opt.step()
        sched.step()
        step_meter.mean(name, norm)
    _merge(meter, step_meter)
    return None


def accumulate(
    lrn: Learner,
    data: UpdateData,
    idx: Tensor,
    micro: int,
    train_actor: bool,
    meter: Meter | None = None,
    checks: NonFinite | None = None,
) -> Tensor:
    """Zero the gradients, then accumulate those of the minibatch ``idx`` over
    micro-batches of ``micro`` rows; every micro-batch uses the whole minibatch's
    aggregation denominators, so the sum is exactly the minibatch gradient. Returns the
    minibatch loss, the sum of the micro-batch losses (detached; on several processes
    this process's part of it). The non-finite counts of the loss terms go into
    ``checks``."""
    meter = meter if meter is not None else Meter()
    checks = checks if checks is not None else NonFinite()
    _zero_grad(lrn)
    denoms = _denominators(lrn, data, idx)
    mb = idx.shape[0]
    processes = distributed.world().size
    total = torch.zeros((), device=lrn.device)
    for u in range(0, mb, micro):
        j = idx[u : u + micro]
        share = j.shape[0] / (mb * processes)  # of the whole minibatch, every process's
        loss = _micro_loss(lrn, data, j, denoms, share, train_actor, meter, checks)
        # the gradient reduction averages over the processes; the sum is the objective's
        (loss * processes if processes > 1 else loss).backward()
        total = total + loss.detach()
    return total


def _zero_grad(lrn: Learner) -> None:
    lrn.actor_opt.zero_grad(set_to_none=True)
    if lrn.critic_opt is not None:
        lrn.critic_opt.zero_grad(set_to_none=True)


def _clip(opt: torch.optim.Optimizer, limit: float | None) -> Tensor:
    """Clip the gradients of ``opt``'s parameters to ``limit``; their total norm before
    clipping (non-finite when a gradient is)."""
    params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, limit if limit is not None else math.inf)
    return distributed.full_tensor(norm)  # sharded gradients: the norm of the whole


def _denominators(lrn: Learner, data: UpdateData, idx: Tensor) -> dict[str, Tensor | None]:
    """Each aggregation's denominator over the whole minibatch ``idx``: the policy terms'
    over mask', the NLL term's over mask'·[R > 0], the critic's over m^V."""

    def clamp(d: Tensor | None) -> Tensor | None:
        return None if d is None else d.clamp_min(1e-8)

    def whole(mask: Tensor) -> Tensor:  # every process's rows of the minibatch
        if data.round_width is None:
            return mask
        return distributed.gather_rows(mask, data.round_width)

    parts = lrn.assembly
    out = {"policy": clamp(denominator(parts.policy_agg, whole(data.actor_mask[idx])))}
    if data.nll_mask is not None:
        out["nll"] = clamp(denominator(parts.policy_agg, whole(data.nll_mask[idx])))
    if data.value_mask is not None and parts.critic_agg is not None:
        out["critic"] = clamp(denominator(parts.critic_agg, whole(data.value_mask[idx])))
    return out


def _micro_loss(
    lrn: Learner,
    data: UpdateData,
    j: Tensor,
    denoms: dict[str, Tensor | None],
    share: float,
    train_actor: bool,
    meter: Meter,
    checks: NonFinite,
) -> Tensor:
    """The loss of the micro-batch ``j``: actor (when it trains) plus critic."""
    models, parts, forwards = lrn.models, lrn.assembly, lrn.forwards
    ro = data.rollout.rows(j)
    loss = torch.zeros((), device=lrn.device)
    shared = None
    if train_actor:
        logp, ent, hidden = forwards.actor(models.actor, ro)
        checks.add("the actor's forward pass", torch.stack([logp.detach(), ent]), "values")
        actor = _actor_loss(lrn, data, j, logp, ent, denoms, share, meter, checks)
        checks.add("the actor's loss", actor, "scalar", parts.name("policy.loss").inline)
        loss = loss + actor
        shared = hidden if models.shared_critic else None
    elif models.shared_critic:
        with torch.no_grad():
            shared = forwards.hidden(models.actor, ro)
    if models.critic is not None:
        critic = _critic_loss(lrn, data, j, ro, shared, denoms, share, meter, checks)
        checks.add("the critic's loss", critic, "scalar", parts.name("critic.loss").inline)
        loss = loss + critic
    return loss


def _actor_loss(
    lrn: Learner,
    data: UpdateData,
    j: Tensor,
    logp: Tensor,
    ent: Tensor,
    denoms: dict[str, Tensor | None],
    share: float,
    meter: Meter,
    checks: NonFinite,
) -> Tensor:
    """L_π of the micro-batch (docs/design.md): with mask' = mask·[ω > 0]·[c > 0],
    agg(pl(logp, logp_old, A, mask')·ω·c, mask') + β·agg(kl(logp, logp_ref), mask')
    − c_H·agg(entropy, mask') + c_NLL·agg(−logp, mask'·[R > 0])."""
    policy = lrn.spec.policy
    parts = lrn.assembly
    mask = data.actor_mask[j]
    logp_old = data.batch.logp_old[j].float()  # type: ignore[index]
    adv = data.advantages[j]

    def term(elementwise: Tensor, m: Tensor, denom: Tensor | None) -> Tensor:
        return aggregate(parts.policy_agg, elementwise, m, denom, share)

    elementwise = parts.policy_loss(logp, logp_old, adv, mask)
    checks.add(str(parts.name("policy.loss")), elementwise)
    weights = data.policy_weights[j][:, None] * data.correction[j]  # ω · c
    pg = term(elementwise * weights, mask, denoms["policy"])
    checks.add(str(parts.name("policy.aggregation")), pg, "scalar")
    loss = pg
    kl = lrn.spec.kl
    if kl is not None and kl.placement == "loss":
        assert parts.kl is not None and data.batch.logp_ref is not None
        ref = data.batch.logp_ref[j].float()
        # where the aggregation drops a position (padding, rows of weight 0) log π_ref is
        # compared with itself: KL 0 there, so a huge log-ratio at a dropped position
        # (exp overflows) cannot put 0·inf = NaN into the gradient
        estimate = parts.kl(torch.where(mask, logp, ref), ref)
        checks.add(str(parts.name("kl.estimator")), estimate)
        loss = loss + lrn.kl_coef * term(estimate, mask, denoms["policy"])
    if policy.entropy_coef > 0:
        loss = loss - policy.entropy_coef * term(ent, mask, denoms["policy"])
    if data.nll_mask is not None:
        loss = loss + policy.nll_coef * term(-logp, data.nll_mask[j], denoms["nll"])

    meter.add("policy_loss", pg, share)
    with torch.no_grad():
        tokens = mask.float().sum()
        log_ratio = torch.where(mask, logp - logp_old, 0.0)
        # (ρ − 1) − log ρ, an estimate of KL(π_old ‖ π) from the sampled tokens
        meter.add("approx_kl", (log_ratio.exp() - 1 - log_ratio).sum(), tokens)
        meter.add("entropy", torch.where(mask, ent, 0.0).sum(), tokens)
        clipped = optional(parts.policy_loss, "policy_loss", "clipped")
        if clipped is not None:
            active = clipped(logp, logp_old, adv, mask) & mask
            meter.add("clipfrac", active.float().sum(), tokens)
    return loss


def _critic_loss(
    lrn: Learner,
    data: UpdateData,
    j: Tensor,
    ro: Rollout,
    shared: Tensor | None,
    denoms: dict[str, Tensor | None],
    share: float,
    meter: Meter,
    checks: NonFinite,
) -> Tensor:
    """L_V of the micro-batch (docs/design.md): vf_coef·agg(ℓ(pred, Y, V_old)·ω^V, m^V)."""
    parts = lrn.assembly
    assert parts.critic_loss is not None and parts.critic_agg is not None
    assert data.targets is not None and data.value_mask is not None
    assert data.value_weights is not None and data.batch.values is not None
    pred = parts.prediction(lrn.forwards.critic_head_out(ro, shared)[:, :-1])
    checks.add("the critic's forward pass", pred, "values")
    target = data.targets[j]
    old = data.batch.values[j].float()
    vmask = data.value_mask[j]
    elementwise = parts.critic_loss(pred, target, old)
    checks.add(str(parts.name("critic.loss")), elementwise)
    weighted = elementwise * data.value_weights[j][:, None]
    value = aggregate(parts.critic_agg, weighted, vmask, denoms.get("critic"), share)
    checks.add(str(parts.name("critic.aggregation")), value, "scalar")

    meter.add("value_loss", value, share)
    clipped = optional(parts.critic_loss, "regression_loss", "clipped")
    if clipped is not None:
        with torch.no_grad():
            active = clipped(pred, target, old) & vmask
            meter.add("vf_clipfrac", active.float().sum(), vmask.float().sum())
    return lrn.spec.train.vf_coef * value
