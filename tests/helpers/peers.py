"""Helpers of the tests that hold ppokit's objective against TRL's and verl's own code
(tests/peers/): generated batches, and ppokit's losses of a spec on a batch without a model.

:func:`update_data` runs the trainer's own :func:`~ppokit.trainer.estimation.estimate` on a
batch (truncation rule, the KL in the reward, advantage, prompt weight, rollout correction,
mask', the critic's targets and mask); :func:`ppokit_loss` then sums
:meth:`Objective.actor_loss` and :func:`ppokit_critic_loss`
:meth:`Objective.critic_loss` over each micro-batch with the minibatch's denominators, as
the update sums them."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from hypothesis import strategies as st
from torch import Tensor

from ppokit.batch import RolloutBatch
from ppokit.spec import Spec, validate_spec
from ppokit.trainer.assembly import Assembly
from ppokit.trainer.estimation import UpdateData, estimate
from ppokit.trainer.metrics import Meter
from ppokit.trainer.objective import Objective

__all__ = ["Case", "cases", "fixed", "ppokit_critic_loss", "ppokit_loss", "spec_of", "update_data"]


@dataclass
class Case:
    """A generation batch: ``groups`` prompts × ``n`` responses of at most ``t`` tokens."""

    n: int
    t: int
    lengths: Tensor  # [B] long
    rewards: Tensor  # [B] float
    logp: Tensor  # [B, T] the policy's log-probs (a leaf: the gradient is taken w.r.t. it)
    logp_old: Tensor  # [B, T]
    logp_ref: Tensor  # [B, T]
    logp_rollout: Tensor  # [B, T] the rollout engine's μ
    entropy: Tensor  # [B, T]

    @property
    def b(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def mask(self) -> Tensor:
        return torch.arange(self.t)[None, :] < self.lengths[:, None]

    @property
    def truncated(self) -> Tensor:
        """A response that reached ``t`` tokens is truncated (no EOS)."""
        return self.lengths == self.t

    def fresh(self) -> Tensor:
        """A new leaf copy of the policy's log-probs."""
        return self.logp.detach().clone().requires_grad_(True)

    def batch(self) -> RolloutBatch:
        mask = self.mask
        token_rewards = torch.zeros(self.b, self.t)
        token_rewards[torch.arange(self.b), self.lengths - 1] = self.rewards
        return RolloutBatch(
            response_mask=mask,
            token_rewards=token_rewards,
            logp_old=self.logp_old,
            logp_rollout=self.logp_rollout,
            logp_ref=self.logp_ref,
            group_ids=torch.arange(self.b) // self.n,
            truncated=self.truncated,
        )


@st.composite
def cases(
    draw: Any,
    groups: tuple[int, int] = (2, 3),
    n: int = 4,
    t: int = 6,
    spread: float = 0.3,
    mismatch: float = 0.3,
    binary: bool = False,
) -> Case:
    """A generated batch: lengths 1..t (t: truncated), rewards (all-equal groups among them),
    log-probs near each other."""
    g = draw(st.integers(*groups))
    b = g * n
    lengths = torch.tensor(draw(st.lists(st.integers(1, t), min_size=b, max_size=b)))
    values = st.sampled_from([0.0, 1.0]) if binary else st.sampled_from([0.0, 0.5, 1.0, 2.0])
    rewards = torch.tensor(draw(st.lists(values, min_size=b, max_size=b)), dtype=torch.float32)
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=gen, dtype=torch.float64).float() * 2 - 0.05
    logp = old + spread * torch.randn(b, t, generator=gen)
    ref = old + spread * torch.randn(b, t, generator=gen)
    rollout = old + mismatch * torch.randn(b, t, generator=gen)
    ent = torch.rand(b, t, generator=gen) * 2
    return Case(n, t, lengths, rewards, logp.clamp_max(-1e-3), old, ref, rollout, ent)


def fixed(
    lengths: list[int] | None = None, t: int = 6, n: int = 4, spread: float = 0.3, seed: int = 0
) -> Case:
    """A batch of given ``lengths`` (default 2 groups of 1..t), rewards 0, 1, 0.5, 2, ...,
    log-probs drawn from ``seed``."""
    lengths = lengths or [6, 2, 3, 4, 1, 6, 5, 2]
    b = len(lengths)
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=gen) * 2 - 0.05
    rewards = torch.tensor([0.0, 1.0, 0.5, 2.0] * (b // 4 + 1))[:b]
    return Case(
        n, t, torch.tensor(lengths), rewards,
        (old + spread * torch.randn(b, t, generator=gen)).clamp_max(-1e-3), old,
        old + spread * torch.randn(b, t, generator=gen),
        old + 0.3 * torch.randn(b, t, generator=gen), torch.rand(b, t, generator=gen) * 2,
    )  # fmt: skip


BASE: dict[str, Any] = {"model": {"actor": "demo"}}


def spec_of(**sections: Any) -> Spec:
    """A spec of ``sections`` over the demo model (the rest ppokit's defaults)."""
    return validate_spec({**BASE, **sections})


def update_data(spec: Spec, case: Case, **fields: Tensor) -> tuple[Objective, UpdateData, Tensor]:
    """The spec's objective (no models), the round's data :func:`estimate` makes of the
    case's batch with ``fields`` (a critic's ``values``, ReMax's ``baseline_rewards``), and
    β after it (the KL controller's step)."""
    parts = Assembly.from_spec(spec)
    beta = torch.tensor(spec.kl.coef if spec.kl is not None else 0.0)
    batch = case.batch().replace(**fields)
    data, _, beta = estimate(
        None,  # type: ignore[arg-type]
        batch, case.rewards, spec=spec, assembly=parts, kl_coef=beta,
    )  # fmt: skip
    return Objective(spec, parts, None), data, beta  # type: ignore[arg-type]


def _minibatches(case: Case, minibatches: int, micro: int) -> Any:
    """(minibatch rows, micro-batch rows) in the update's order."""
    size = case.b // minibatches
    for m in range(minibatches):
        idx = torch.arange(m * size, (m + 1) * size)
        for j in idx.split(micro):
            yield idx, j


def ppokit_loss(
    spec: Spec, case: Case, logp: Tensor, micro: int, minibatches: int = 1, **fields: Tensor
) -> Tensor:
    """The actor's loss: the sum over the minibatches (``minibatches`` equal slices of the
    batch, in order) of the sum of their micro-batch losses (``micro`` rows each): what the
    update backpropagates. ``fields``: more of the batch's fields (a critic's ``values``,
    ReMax's ``baseline_rewards``)."""
    objective, data, beta = update_data(spec, case, **fields)
    total = torch.zeros(())
    for idx, j in _minibatches(case, minibatches, micro):
        denoms = objective.denominators(data, idx)
        share = j.shape[0] / idx.shape[0]
        total = total + objective.actor_loss(
            data, j, logp[j], case.entropy[j], denoms, share, beta, Meter()
        )
    return total


@dataclass(frozen=True)
class _ValueHead:
    """The critic's forward pass of given predictions V [B, T]: the value head's output
    ``[B, T+1, 1]`` of the rows ``ro`` (the last position, after the response, unread)."""

    out: Tensor

    def critic_head_out(self, ro: Tensor, shared: Tensor | None) -> Tensor:
        return self.out[ro]


def ppokit_critic_loss(
    spec: Spec, case: Case, vpreds: Tensor, micro: int, minibatches: int = 1, **fields: Tensor
) -> Tensor:
    """The critic's loss, ``train.vf_coef`` included, summed as :func:`ppokit_loss` sums the
    actor's, of the predictions ``vpreds`` [B, T] (a leaf: the gradient is taken w.r.t. it);
    ``fields``: the batch's ``values`` V_old and any other field."""
    objective, data, _ = update_data(spec, case, **fields)
    head = torch.cat([vpreds, torch.zeros(case.b, 1)], 1)[..., None]
    objective = replace(objective, forwards=_ValueHead(head))  # type: ignore[arg-type]
    total = torch.zeros(())
    for idx, j in _minibatches(case, minibatches, micro):
        denoms = objective.denominators(data, idx)
        share = j.shape[0] / idx.shape[0]
        ro: Any = j  # the stub's rows
        total = total + objective.critic_loss(data, j, ro, None, denoms, share, Meter())
    return total
