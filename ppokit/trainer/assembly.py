"""The components of a spec, created through the registry, plus what they declare.

The trainer never special-cases a component by name: what it needs (``requires``) and the
optional members of the contract (aggregation ``denominator``, policy loss ``clipped``,
regression loss ``head_size``/``value``/``prediction``/``clipped``) are read here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ppokit.registry import get_registry
from ppokit.spec import RewardSpec, Spec

if TYPE_CHECKING:
    from ppokit.components import (
        Advantage,
        Aggregation,
        CriticTarget,
        KLEstimator,
        PolicyLoss,
        PositionMask,
        PromptWeight,
        RegressionLoss,
        Reward,
        Truncation,
    )

__all__ = ["ATTRIBUTES", "Assembly", "aggregate", "as_scores", "denominator"]

#: The attribute of :class:`Assembly` each slot path of ``Spec.slots()`` fills. Rewards
#: (``reward``, or ``reward.0``, ``reward.1``, ... for a list) go to ``Assembly.rewards``.
ATTRIBUTES: dict[str, str] = {
    "truncation": "truncation",
    "kl.estimator": "kl",
    "advantage": "advantage",
    "critic.target": "critic_target",
    "critic.mask": "critic_mask",
    "critic.weight": "critic_weight",
    "critic.loss": "critic_loss",
    "critic.aggregation": "critic_agg",
    "policy.loss": "policy_loss",
    "policy.aggregation": "policy_agg",
    "policy.weight": "policy_weight",
}


@dataclass
class Assembly:
    """Every component of a spec, ready to call (``None`` for a slot of an absent section:
    no ``kl``, no ``critic``)."""

    rewards: list[tuple[str, Reward, float]]  # (name, reward, weight)
    truncation: Truncation
    advantage: Advantage
    policy_loss: PolicyLoss
    policy_agg: Aggregation
    policy_weight: PromptWeight
    requires: frozenset[str]  # batch fields the components read
    kl: KLEstimator | None = None
    critic_target: CriticTarget | None = None
    critic_mask: PositionMask | None = None
    critic_weight: PromptWeight | None = None
    critic_loss: RegressionLoss | None = None
    critic_agg: Aggregation | None = None

    @classmethod
    def from_spec(cls, spec: Spec) -> Assembly:
        registry = get_registry()
        slots: dict[str, Any] = {}
        rewards: list[tuple[str, Reward, float]] = []
        requires: set[str] = set()
        for path, kind, comp in spec.slots():
            requires.update(registry.info(kind, comp.name).requires)
            component = registry.create(kind, comp.name, **comp.params)
            if isinstance(comp, RewardSpec):
                rewards.append((comp.name, component, float(comp.weight)))
            else:
                slots[ATTRIBUTES[path]] = component
        return cls(rewards=rewards, requires=frozenset(requires), **slots)

    # ------------------------------------------------------------ optional members
    @property
    def head_size(self) -> int:
        return int(getattr(self.critic_loss, "head_size", 1))

    def value(self, head_out: Tensor) -> Tensor:
        """V from the value head's output ``[.., head_size]``."""
        read = getattr(self.critic_loss, "value", None)
        return (read(head_out) if read is not None else head_out[..., 0]).float()

    def prediction(self, head_out: Tensor) -> Tensor:
        """What the regression loss takes as ``pred``."""
        read = getattr(self.critic_loss, "prediction", None)
        return read(head_out) if read is not None else self.value(head_out)


def denominator(agg: Aggregation, mask: Tensor) -> Tensor | None:
    """The aggregation's denominator over a whole minibatch, or None if it declares none."""
    fn = getattr(agg, "denominator", None)
    return None if fn is None else fn(mask)


def aggregate(
    agg: Aggregation, loss: Tensor, mask: Tensor, denom: Tensor | None, share: float
) -> Tensor:
    """``agg(loss, mask, denom=denom)``; without a declared denominator the micro-batch's own
    aggregate scaled by its share of the minibatch."""
    if denom is not None:
        return agg(loss, mask, denom=denom)
    return agg(loss, mask) * share


def as_scores(value: Any, device: torch.device) -> Tensor:
    """A reward's return value as float32 ``[B]`` on ``device``."""
    return torch.as_tensor(value, dtype=torch.float32).to(device).reshape(-1)
