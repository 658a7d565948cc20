"""The objective the update minimises (docs/design.md, "The objectives"): the actor's loss
L_π and the critic's L_V of a micro-batch, from the round's
:class:`~ppokit.trainer.estimation.UpdateData`, the assembled components and β.

Every micro-batch uses the whole minibatch's aggregation denominators
(:meth:`Objective.denominators`; on several processes, the whole minibatch of every
process), so the sum of the micro-batch losses is exactly the minibatch loss. The forward
passes and the losses are counted into the active non-finite counter
(:func:`~ppokit.trainer.checks.count`); the components count their own results.

A loss reports its diagnostics from its one call: a loss whose catalogue entry declares
``metrics`` is called with ``metrics=``, a dict it fills with per-position values
(``clipfrac``: where its clip is active), averaged here over the loss's mask (mask', m^V);
a loss that declares none may still give ``clipped``, a second computation.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
from torch import Tensor

from ppokit import distributed
from ppokit.errors import ComponentError
from ppokit.registry import get_registry
from ppokit.spec import Spec
from ppokit.trainer.assembly import Assembly, Where, aggregate, denominator, optional
from ppokit.trainer.checks import count
from ppokit.trainer.contract import describe
from ppokit.trainer.estimation import UpdateData, clip_band, log_band
from ppokit.trainer.forwards import Forwards
from ppokit.trainer.metrics import Meter
from ppokit.trainer.rollout import Rollout

__all__ = ["Denominators", "Objective", "loss_metrics"]

#: Each aggregation's denominator over the whole minibatch (``policy``, ``nll``,
#: ``critic``), None for an aggregation that declares none.
Denominators = dict[str, Tensor | None]


@dataclass(frozen=True)
class Objective:
    """L_π + L_V of the spec's components (``parts``), with the models' forward passes
    (``forwards``)."""

    spec: Spec
    parts: Assembly
    forwards: Forwards

    @cached_property
    def log_band(self) -> tuple[float, float]:
        """log of the policy loss's clip band, which ``ratio_outside`` counts outside."""
        return log_band(clip_band(self.spec))

    @cached_property
    def kl_reads_logp_old(self) -> bool:
        """Whether the KL estimator's entry requires ``logp_old``: it is then called
        ``kl(logp, logp_ref, logp_old)``."""
        return any(
            s.startswith("kl.estimator") for s in self.spec.requirements().get("logp_old", [])
        )

    @cached_property
    def reporting(self) -> frozenset[str]:
        """The loss slots (``policy.loss``, ``critic.loss``) whose component's catalogue
        entry declares ``metrics``: each is called with ``metrics=``."""
        registry, out = get_registry(), set()
        losses = [("policy.loss", "policy_loss", self.spec.policy.loss)]
        if self.spec.critic is not None:
            losses.append(("critic.loss", "regression_loss", self.spec.critic.loss))
        for slot, kind, comp in losses:
            if registry.info(kind, comp.name).entry.metrics:
                out.add(slot)
        return frozenset(out)

    def sink(self, slot: str) -> dict[str, Any]:
        """The keywords of the loss in ``slot``: ``metrics=``, a dict its call fills, for a
        loss that reports metrics (:attr:`reporting`); none for one that does not."""
        return {"metrics": {}} if slot in self.reporting else {}

    def denominators(self, data: UpdateData, idx: Tensor) -> Denominators:
        """Each aggregation's denominator over the whole minibatch ``idx``: the policy
        terms' over mask', the NLL term's over mask'·[R > 0], the critic's over m^V."""

        def clamp(d: Tensor | None) -> Tensor | None:
            return None if d is None else d.clamp_min(1e-8)

        def whole(mask: Tensor) -> Tensor:  # every process's rows of the minibatch
            if data.round_width is None:
                return mask
            return distributed.gather_rows(mask, data.round_width)

        parts, mine = self.parts, data.rows(idx)
        out = {"policy": clamp(denominator(parts.policy_agg, whole(mine.actor_mask)))}
        if mine.nll_mask is not None:
            out["nll"] = clamp(denominator(parts.policy_agg, whole(mine.nll_mask)))
        if mine.value_mask is not None and parts.critic_agg is not None:
            out["critic"] = clamp(denominator(parts.critic_agg, whole(mine.value_mask)))
        return out

    def micro_loss(
        self,
        data: UpdateData,
        j: Tensor,
        denoms: Denominators,
        share: float,
        beta: Tensor,
        train_actor: bool,
        meter: Meter,
        ro: Rollout | None = None,
    ) -> Tensor:
        """The loss of the micro-batch ``j`` (``share`` of the whole minibatch's rows):
        L_π (when the actor trains) + L_V; its metrics into ``meter``. ``ro``: its rows of
        the round's rollout, cut to their own longest response (default: as the round pads
        them); the round's ``[B, T]`` tensors are read over the same positions."""
        models, parts, forwards = self.forwards.models, self.parts, self.forwards
        if ro is None:
            assert data.rollout is not None
            ro = data.rollout.rows(j)
        loss = torch.zeros((), device=data.actor_mask.device)
        shared = None
        if train_actor:
            logp, ent, hidden = forwards.actor(models.actor, ro)
            count("the actor's forward pass", torch.stack([logp.detach(), ent]), "values")
            actor = self.actor_loss(data, j, logp, ent, denoms, share, beta, meter)
            count("the actor's loss", actor, "scalar", parts.name("policy.loss").inline)
            loss = loss + actor
            shared = hidden if models.shared_critic else None
        elif models.shared_critic:
            with torch.no_grad():
                shared = forwards.hidden(models.actor, ro)
        if models.critic is not None:
            critic = self.critic_loss(data, j, ro, shared, denoms, share, meter)
            count("the critic's loss", critic, "scalar", parts.name("critic.loss").inline)
            loss = loss + critic
        return loss

    def actor_loss(
        self,
        data: UpdateData,
        j: Tensor,
        logp: Tensor,
        ent: Tensor,
        denoms: Denominators,
        share: float,
        beta: Tensor,
        meter: Meter,
    ) -> Tensor:
        """L_π of the micro-batch (docs/design.md): with mask' = mask·[ω > 0]·[c > 0],
        agg(pl(logp, logp_old, A, mask')·ω·c, mask') + β·agg(kl(logp, logp_ref), mask')
        − c_H·agg(entropy, mask') + c_NLL·agg(−logp, mask'·[R > 0])."""
        policy, parts = self.spec.policy, self.parts
        mine = data.rows(j, logp.shape[1])  # over the micro-batch's positions
        mask = mine.actor_mask
        assert mine.batch.logp_old is not None
        logp_old = mine.batch.logp_old.float()
        adv = mine.advantages

        def term(elementwise: Tensor, m: Tensor, denom: Tensor | None) -> Tensor:
            return aggregate(parts.policy_agg, elementwise, m, denom, share)

        sink = self.sink("policy.loss")  # the loss's own diagnostics, from its one call
        elementwise = parts.policy_loss(logp, logp_old, adv, mask, **sink)
        weights = mine.policy_weights[:, None] * mine.correction  # ω · c
        pg = term(elementwise * weights, mask, denoms["policy"])
        count(str(parts.name("policy.aggregation")), pg, "scalar")
        loss = pg
        kl = self.spec.kl
        if kl is not None and kl.placement == "loss":
            assert parts.kl is not None and mine.batch.logp_ref is not None
            ref = mine.batch.logp_ref.float()
            # where the aggregation drops a position (padding, rows of weight 0) log π_ref is
            # compared with itself: KL 0 there, so a huge log-ratio at a dropped position
            # (exp overflows) cannot put 0·inf = NaN into the gradient
            policy_logp = torch.where(mask, logp, ref)
            if self.kl_reads_logp_old:
                estimate = parts.kl(policy_logp, ref, torch.where(mask, logp_old, ref))
            else:
                estimate = parts.kl(policy_logp, ref)
            loss = loss + beta * term(estimate, mask, denoms["policy"])
        if policy.entropy_coef > 0:
            loss = loss - policy.entropy_coef * term(ent, mask, denoms["policy"])
        if mine.nll_mask is not None:
            loss = loss + policy.nll_coef * term(-logp, mine.nll_mask, denoms["nll"])

        meter.add("policy_loss", pg, share)
        with torch.no_grad():
            tokens = mask.float().sum()
            log_ratio = torch.where(mask, logp - logp_old, 0.0)
            # (ρ − 1) − log ρ, an estimate of KL(π_old ‖ π) from the sampled tokens
            meter.add("approx_kl", (log_ratio.exp() - 1 - log_ratio).sum(), tokens)
            meter.add("entropy", torch.where(mask, ent, 0.0).sum(), tokens)
            # π/π_old outside the clip band, whatever the advantage's sign (clipfrac counts
            # only the side the clip acts on)
            low, high = self.log_band
            outside = mask & ((log_ratio < low) | (log_ratio > high))
            meter.add("ratio_outside", outside.float().sum(), tokens)
            loss_metrics(parts.name("policy.loss"), sink.get("metrics", {}), mask, meter)
            clipped = optional(parts.policy_loss, "policy_loss", "clipped")
            if clipped is not None and "policy.loss" not in self.reporting:
                active = clipped(logp, logp_old, adv, mask) & mask
                meter.add("clipfrac", active.float().sum(), tokens)
        return loss

    def critic_loss(
        self,
        data: UpdateData,
        j: Tensor,
        ro: Rollout,
        shared: Tensor | None,
        denoms: Denominators,
        share: float,
        meter: Meter,
    ) -> Tensor:
        """L_V of the micro-batch (docs/design.md): vf_coef·agg(ℓ(pred, Y, V_old)·ω^V, m^V)."""
        parts = self.parts
        assert parts.critic_loss is not None and parts.critic_agg is not None
        pred = parts.prediction(self.forwards.critic_head_out(ro, shared)[:, :-1])
        count("the critic's forward pass", pred, "values")
        mine = data.rows(j, pred.shape[1])  # over the micro-batch's positions
        assert mine.targets is not None and mine.value_mask is not None
        assert mine.value_weights is not None and mine.batch.values is not None
        target = mine.targets
        old = mine.batch.values.float()
        vmask = mine.value_mask
        sink = self.sink("critic.loss")  # the loss's own diagnostics, from its one call
        elementwise = parts.critic_loss(pred, target, old, **sink)
        weighted = elementwise * mine.value_weights[:, None]
        value = aggregate(parts.critic_agg, weighted, vmask, denoms.get("critic"), share)
        count(str(parts.name("critic.aggregation")), value, "scalar")

        meter.add("value_loss", value, share)
        loss_metrics(parts.name("critic.loss"), sink.get("metrics", {}), vmask, meter)
        clipped = optional(parts.critic_loss, "regression_loss", "clipped")
        if clipped is not None and "critic.loss" not in self.reporting:
            with torch.no_grad():
                active = clipped(pred, target, old) & vmask
                meter.add("vf_clipfrac", active.float().sum(), vmask.float().sum())
        return self.spec.train.vf_coef * value


def loss_metrics(where: Where, sink: dict[str, Tensor], mask: Tensor, meter: Meter) -> None:
    """Each per-position diagnostic a loss reported (``sink``: a ``[B, T]`` tensor per
    name) into ``meter`` as its sum over ``mask``'s positions and their number: the metric
    is its mean over the loss's positions of the round's steps."""
    tokens = mask.float().sum()
    for name, value in sink.items():
        if not isinstance(name, str) or not isinstance(value, Tensor) or value.shape != mask.shape:
            raise ComponentError(
                f"{where} reported metric {name!r} as {describe(value)}: expected a tensor "
                f"of shape {list(mask.shape)} per metric name"
            )
        meter.add(name, torch.where(mask, value.detach().float(), 0.0).sum(), tokens)
