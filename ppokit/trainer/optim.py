"""The optimizers of a run: AdamW for the actor and the critic, their learning-rate
schedules over the run's optimizer steps, and the clip and step of one minibatch."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

from ppokit import distributed
from ppokit.spec import Spec, TrainSpec
from ppokit.trainer.models import Models

__all__ = ["Optimizers", "Schedule", "clip", "lr_factor", "optimizer_steps"]

Schedule = torch.optim.lr_scheduler.LambdaLR

#: AdamW's implementation on one process: ``fused`` (one kernel over every parameter, on the
#: CPU as on CUDA; the same update as the per-parameter loop within float32 rounding), or
#: None for torch's default (its per-parameter loop on a CPU). Sharded parameters (several
#: processes) keep torch's default.
ADAMW_FUSED: bool | None = True


def optimizer_steps(spec: Spec) -> tuple[int, int]:
    """(the actor's, the critic's) optimizer steps in a run of ``spec`` with none skipped:
    ``ppo_epochs`` passes of ceil(responses of a round / minibatch) steps a round, the
    actor's none in the ``critic_warmup_rounds``."""
    t, r = spec.train, spec.rollout
    responses = r.prompts_per_round * r.n
    per_round = t.ppo_epochs * -(-responses // (t.minibatch_size or responses))
    actor_rounds = max(0, t.rounds - t.critic_warmup_rounds)
    return actor_rounds * per_round, t.rounds * per_round


def lr_factor(train: TrainSpec, steps: int) -> Callable[[int], float]:
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


def clip(opt: torch.optim.Optimizer, limit: float | None) -> Tensor:
    """Clip the gradients of ``opt``'s parameters to the total norm ``limit``; their total
    norm before clipping (non-finite when a gradient is)."""
    params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, limit if limit is not None else math.inf)
    return distributed.full_tensor(norm)  # sharded gradients: the norm of the whole


@dataclass
class Optimizers:
    """AdamW and its learning-rate schedule for the actor, and for the critic when there is
    one; the schedules follow ``train.lr_schedule`` over the run's optimizer steps
    (:func:`lr_factor`)."""

    actor: torch.optim.Optimizer
    actor_schedule: Schedule
    critic: torch.optim.Optimizer | None = None
    critic_schedule: Schedule | None = None
    #: Optimizer steps taken (:meth:`step` calls) in this process's life.
    taken: int = 0

    @classmethod
    def create(cls, spec: Spec, models: Models) -> Optimizers:
        t = spec.train
        actor_steps, critic_steps = optimizer_steps(spec)

        def adamw(
            params: Iterable[Tensor], lr: float, steps: int
        ) -> tuple[torch.optim.Optimizer, Schedule]:
            fused = ADAMW_FUSED if not distributed.world().distributed else None
            opt = torch.optim.AdamW(params, lr=lr, weight_decay=t.weight_decay, fused=fused)
            return opt, Schedule(opt, lr_factor(t, steps))

        actor = adamw(models.actor_parameters(), t.actor_lr, actor_steps)
        if models.critic is None:
            return cls(*actor)
        return cls(*actor, *adamw(list(models.critic_parameters()), t.critic_lr, critic_steps))

    def named(self) -> list[tuple[str, torch.optim.Optimizer, Schedule]]:
        """``("actor", optimizer, schedule)`` and the critic's, when there is one."""
        out = [("actor", self.actor, self.actor_schedule)]
        if self.critic is not None and self.critic_schedule is not None:
            out.append(("critic", self.critic, self.critic_schedule))
        return out

    def zero_grad(self) -> None:
        for _, opt, _ in self.named():
            opt.zero_grad(set_to_none=True)

    def clip(self, limit: float | None, train_actor: bool) -> dict[str, Tensor]:
        """Clip each trained model's gradients (the actor's unless ``train_actor`` is
        False): ``{"actor": norm, "critic": norm}`` before clipping."""
        return {
            name: clip(opt, limit)
            for name, opt, _ in self.named()
            if train_actor or name != "actor"
        }

    def step(self, models: Iterable[str]) -> None:
        """An optimizer and a schedule step for each of ``models`` (``"actor"``,
        ``"critic"``)."""
        steps = {name: (opt, sched) for name, opt, sched in self.named()}
        self.taken += 1
        for name in models:
            opt, sched = steps[name]
            opt.step()
            sched.step()
