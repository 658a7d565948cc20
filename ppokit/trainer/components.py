"""The components of a spec, created through the registry, plus what they declare.

The trainer never special-cases a component by name: what it needs (``requires``) and the
optional members of the contract (aggregation ``denominator``, policy loss ``clipped``,
regression loss ``head_size``/``value``/``prediction``/``clipped``) are read here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ppokit.registry import get_registry

__all__ = ["Components", "aggregate", "denominator"]


def _create(kind: str, comp: Any) -> Any:
    return get_registry().create(kind, comp.name, **comp.params)


@dataclass
class Components:
    """Every component of a spec, ready to call."""

    rewards: list[tuple[str, Callable[..., Any], float]]
    truncation: Callable[..., Any]
    advantage: Callable[..., Any]
    policy_loss: Callable[..., Any]
    policy_agg: Callable[..., Any]
    policy_weight: Callable[..., Any]
    kl: Callable[..., Any] | None
    critic_target: Callable[..., Any] | None
    critic_mask: Callable[..., Any] | None
    critic_weight: Callable[..., Any] | None
    critic_loss: Callable[..., Any] | None
    critic_agg: Callable[..., Any] | None
    requires: frozenset[str]

    @classmethod
    def from_spec(cls, spec: Any) -> Components:
        registry = get_registry()
        requires: set[str] = set()
        for _path, kind, comp in spec.slots():
            requires.update(registry.info(kind, comp.name).requires)
        rewards = [(r.name, _create("reward", r), float(r.weight)) for r in spec.reward]
        critic = spec.critic
        return cls(
            rewards=rewards,
            truncation=_create("truncation", spec.truncation),
            advantage=_create("advantage", spec.advantage),
            policy_loss=_create("policy_loss", spec.policy.loss),
            policy_agg=_create("aggregation", spec.policy.aggregation),
            policy_weight=_create("prompt_weight", spec.policy.weight),
            kl=None if spec.kl is None else _create("kl_estimator", spec.kl.estimator),
            critic_target=None if critic is None else _create("critic_target", critic.target),
            critic_mask=None if critic is None else _create("position_mask", critic.mask),
            critic_weight=None if critic is None else _create("prompt_weight", critic.weight),
            critic_loss=None if critic is None else _create("regression_loss", critic.loss),
            critic_agg=None if critic is None else _create("aggregation", critic.aggregation),
            requires=frozenset(requires),
        )

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


def denominator(agg: Callable[..., Any], mask: Tensor) -> Tensor | None:
    """The aggregation's denominator over a whole minibatch, or None if it declares none."""
    fn = getattr(agg, "denominator", None)
    return None if fn is None else fn(mask)


def aggregate(
    agg: Callable[..., Any], loss: Tensor, mask: Tensor, denom: Tensor | None, share: float
) -> Tensor:
    """``agg(loss, mask, denom=denom)``; without a declared denominator the micro-batch's own
    aggregate scaled by its share of the minibatch."""
    if denom is not None:
        return agg(loss, mask, denom=denom)
    return agg(loss, mask) * share


def as_scores(value: Any, device: torch.device) -> Tensor:
    """A reward's return value as float32 ``[B]`` on ``device``."""
    return torch.as_tensor(value, dtype=torch.float32).to(device).reshape(-1)
