"""The optimizers of a run: AdamW for the actor and the critic, their learning-rate
schedules over the run's optimizer steps, and the clip and step of one minibatch."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ppokit import distributed
from ppokit.spec import Spec, TrainSpec
from ppokit.trainer.models import Models

__all__ = ["MasterAdamW", "Optimizers", "Schedule", "clip", "lr_factor", "optimizer_steps"]

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


class MasterAdamW(torch.optim.AdamW):
    """AdamW over weights stored in a low precision (``model.master_weights``), stepping a
    float32 master copy of each: the master is in the parameter's state (``"master"``, so a
    checkpoint of the optimizer keeps it), a backward's gradients are summed into the
    master's float32 ``grad`` as each arrives (the parameter's own is then freed), and a
    step is torch's AdamW over the masters (float32 moments), each copied into its weight
    after it. :func:`clip` clips the masters' gradients."""

    def __init__(self, params: Iterable[Tensor], **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        #: Each weight's master (in its state too once it has stepped: AdamW initialises
        #: a state that is empty).
        self.masters: dict[Tensor, Tensor] = {}
        for p in self.weights():
            p.register_post_accumulate_grad_hook(self._accumulate)

    def weights(self) -> list[Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def master(self, p: Tensor) -> Tensor:
        if p not in self.masters:
            self.masters[p] = p.detach().float()
        return self.masters[p]

    def _accumulate(self, p: Tensor) -> None:
        master = self.master(p)
        if p.grad is None:
            return
        if master.grad is None:
            master.grad = p.grad.float()
        else:
            master.grad.add_(p.grad)
        p.grad = None

    def grads(self) -> list[Tensor]:
        """The masters holding a gradient (a parameter's own, set directly, folded in)."""
        for p in self.weights():
            self._accumulate(p)
        return [m for p in self.weights() if (m := self.master(p)).grad is not None]

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for master in self.masters.values():
            master.grad = None

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        self.grads()
        stored = {}
        for p in self.weights():  # each parameter is its master while AdamW steps
            master = self.master(p)
            if master.grad is not None:
                stored[p] = p.data
                p.data, p.grad = master, master.grad
        try:
            super().step()
        finally:
            for p, low in stored.items():
                low.copy_(p.data)
                p.data, p.grad = low, None
                self.state[p]["master"] = self.masters[p]
        self.zero_grad()
        return None

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch casts a state's tensors to its parameter's dtype: the parameters are
        float32 while it loads, so the masters and the moments stay float32."""
        stored = {p: p.data for p in self.weights()}
        for p in stored:
            p.data = p.data.float()
        try:
            super().load_state_dict(state_dict)
        finally:
            for p, low in stored.items():
                p.data = low
        self.masters = {}
        with torch.no_grad():
            for p in stored:
                if "master" in self.state[p]:
                    self.masters[p] = self.state[p]["master"]
                    p.copy_(self.masters[p])


def clip(opt: torch.optim.Optimizer, limit: float | None) -> Tensor:
    """Clip the gradients of ``opt``'s parameters (a :class:`MasterAdamW`'s masters) to the
    total norm ``limit``; their total norm before clipping (non-finite when a gradient
    is)."""
    if isinstance(opt, MasterAdamW):
        params = opt.grads()
    else:
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
            kind = MasterAdamW if models.runtime.master else torch.optim.AdamW
            opt = kind(params, lr=lr, weight_decay=t.weight_decay, fused=fused)
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
