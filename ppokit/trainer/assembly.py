"""The components of a spec, created through the registry, plus what they declare, behind
the trainer's boundary.

The trainer never special-cases a component by name: what it needs (``requires``) and the
optional members of the contract (aggregation ``denominator``, policy loss ``clipped``,
regression loss ``head_size``/``value``/``prediction``/``clipped``) are read here, each as
its kind declares it: the ``CONTRACT`` beside the kind's Protocol
(``ppokit.components.<kind>``) names the check of its return value and its optional
members (:mod:`ppokit.trainer.contract` holds the checks' tensor code).

Every component is wrapped (:mod:`ppokit.trainer.boundary`): its calls are bounded, what
it raises is one line naming it, and its return value is checked against its kind's
contract (docs/design.md) where it crosses into the trainer, so a plugin that breaks the
contract is named in one line (``advantage (gae, plugin ppokit) returned ...``) instead of
surfacing later as a tensor-shape traceback. A reward and an environment run in worker
processes of their own (``train.reward_timeout``, ``rollout.environment_timeout``):
:meth:`Assembly.close` ends them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torch import Tensor

from ppokit.bounded import interrupts
from ppokit.errors import ComponentError, UserError, one_line, raised_at
from ppokit.registry import RegistryError, get_registry
from ppokit.slots import SLOTS
from ppokit.spec import RewardSpec, Spec
from ppokit.trainer.boundary import (
    BOUNDED_KINDS,
    Checked,
    CheckedEngine,
    CheckedEnvironment,
    scored,
)
from ppokit.trainer.contract import CONTRACTS, Where, as_flags, as_scores, optional

if TYPE_CHECKING:
    from ppokit.components import (
        Advantage,
        Aggregation,
        CriticTarget,
        GroupFilter,
        KLEstimator,
        PolicyLoss,
        PositionMask,
        PromptWeight,
        RegressionLoss,
        Reward,
        RolloutCorrection,
        Truncation,
    )

__all__ = [
    "ATTRIBUTES",
    "CONTRACTS",
    "Assembly",
    "Checked",
    "CheckedEngine",
    "CheckedEnvironment",
    "Where",
    "aggregate",
    "as_flags",
    "as_scores",
    "create",
    "denominator",
    "optional",
    "rewards_of",
    "scored",
]

#: The attribute of :class:`Assembly` each slot path of ``Spec.slots()`` fills (the slot
#: table's ``attribute``). Rewards (``reward``, or ``reward.0``, ``reward.1``, ... for a
#: list) go to ``Assembly.rewards``.
ATTRIBUTES: dict[str, str] = {s.path: s.attribute for s in SLOTS if s.kind != "reward"}


def create(spec: Spec, path: str, kind: str, comp: Any) -> tuple[Where, Any]:
    """The component ``comp`` of slot ``path`` (of ``kind``) created through the registry
    and wrapped behind its boundary (:mod:`ppokit.trainer.boundary`, with the bound of its
    kind), with where it sits; a factory that raises (``SystemExit`` too) is a
    :class:`ComponentError` naming the slot, the component and the plugin."""
    registry = get_registry()
    here = Where(path, comp.name, registry.info(kind, comp.name).plugin)
    before = interrupts()
    try:
        component = registry.create(kind, comp.name, **comp.params)
    except (RegistryError, UserError):
        raise  # these already name the component and say what to do
    except BaseException as exc:  # SystemExit too; Ctrl-C is the run's
        if isinstance(exc, KeyboardInterrupt) and interrupts() != before:
            raise
        at = raised_at(exc)
        raise ComponentError(
            f"{here} failed to start: {one_line(exc)}" + (f" (at {at})" if at else "")
        ) from exc
    if kind == "rollout_engine":
        return here, CheckedEngine(here, component, spec.rollout.engine_timeout)
    if kind == "environment":
        return here, CheckedEnvironment(here, component, spec.rollout.environment_timeout)
    if kind == "reward":
        workers = spec.train.reward_workers
        return here, Checked(kind, here, component, spec.train.reward_timeout, workers=workers)
    bound = spec.train.component_timeout if kind in BOUNDED_KINDS else None
    return here, Checked(kind, here, component, bound)


def rewards_of(spec: Spec) -> list[tuple[str, Reward, float]]:
    """The spec's rewards alone, created and behind their boundary: (name, reward, weight)
    each, in the spec's order (what a reward server serves)."""
    return [
        (comp.name, create(spec, path, kind, comp)[1], float(comp.weight))
        for path, kind, comp in spec.slots()
        if isinstance(comp, RewardSpec)
    ]


@dataclass
class Assembly:
    """Every component of a spec, ready to call (``None`` for a slot of an absent section:
    no ``kl``, no ``critic``), each behind its boundary checks when built by
    :meth:`from_spec`; ``where`` names each slot's component and plugin."""

    engine: CheckedEngine
    environment: CheckedEnvironment
    rewards: list[tuple[str, Reward, float]]  # (name, reward, weight)
    truncation: Truncation
    advantage: Advantage
    policy_loss: PolicyLoss
    policy_agg: Aggregation
    policy_weight: PromptWeight
    correction: RolloutCorrection
    filter: GroupFilter
    requires: frozenset[str]  # batch fields the components read
    kl: KLEstimator | None = None
    critic_target: CriticTarget | None = None
    critic_mask: PositionMask | None = None
    critic_weight: PromptWeight | None = None
    critic_loss: RegressionLoss | None = None
    critic_agg: Aggregation | None = None
    where: dict[str, Where] = field(default_factory=dict)  # slot path -> component, plugin

    @classmethod
    def from_spec(cls, spec: Spec) -> Assembly:
        """Create every component; a factory that raises is a :class:`ComponentError`
        naming the slot, the component and the plugin."""
        registry = get_registry()
        slots: dict[str, Any] = {}
        rewards: list[tuple[str, Reward, float]] = []
        requires: set[str] = set()
        where: dict[str, Where] = {}
        for path, kind, comp in spec.slots():
            requires.update(registry.info(kind, comp.name).requires)
            here, wrapped = create(spec, path, kind, comp)
            where[path] = here
            if isinstance(comp, RewardSpec):
                rewards.append((comp.name, wrapped, float(comp.weight)))
            else:
                slots[ATTRIBUTES[path]] = wrapped
        return cls(rewards=rewards, requires=frozenset(requires), where=where, **slots)

    def close(self) -> None:
        """End the worker processes of the rewards and the environment."""
        for _, reward, _ in self.rewards:
            if isinstance(reward, Checked):
                reward.close()
        if isinstance(self.environment, CheckedEnvironment):
            self.environment.close()

    def name(self, path: str) -> Where:
        """The component in slot ``path`` (a bare slot name when unknown)."""
        return self.where.get(path) or Where(path, "?", "?")

    # ------------------------------------------------------------ optional members
    @property
    def head_size(self) -> int:
        size = optional(self.critic_loss, "regression_loss", "head_size")
        return 1 if size is None else int(size)

    def value(self, head_out: Tensor) -> Tensor:
        """V from the value head's output ``[.., head_size]``."""
        read = optional(self.critic_loss, "regression_loss", "value")
        return (read(head_out) if read is not None else head_out[..., 0]).float()

    def prediction(self, head_out: Tensor) -> Tensor:
        """What the regression loss takes as ``pred``."""
        read = optional(self.critic_loss, "regression_loss", "prediction")
        return read(head_out) if read is not None else self.value(head_out)


def denominator(agg: Aggregation, mask: Tensor) -> Tensor | None:
    """The aggregation's denominator over a whole minibatch, or None if it declares none."""
    fn = optional(agg, "aggregation", "denominator")
    return None if fn is None else fn(mask)


def aggregate(
    agg: Aggregation, loss: Tensor, mask: Tensor, denom: Tensor | None, share: float
) -> Tensor:
    """``agg(loss, mask, denom=denom)``; without a declared denominator the micro-batch's own
    aggregate scaled by its share of the minibatch."""
    if denom is not None:
        return agg(loss, mask, denom=denom)
    return agg(loss, mask) * share
