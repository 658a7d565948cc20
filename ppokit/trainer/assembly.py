"""The components of a spec, created through the registry, plus what they declare, behind
the trainer's boundary.

The trainer never special-cases a component by name: what it needs (``requires``) and the
optional members of the contract (aggregation ``denominator``, policy loss ``clipped``,
regression loss ``head_size``/``value``/``prediction``/``clipped``) are read here, each as
its kind declares it: the ``CONTRACT`` beside the kind's Protocol
(``ppokit.components.<kind>``) names the check of its return value and its optional
members; this module holds the checks' tensor code.

Every component is wrapped by :func:`checked`: its return value is checked against its
kind's contract (docs/design.md) where it crosses into the trainer, so a plugin that breaks
the contract is named in one line (``advantage (gae, plugin ppokit) returned ...``) instead
of surfacing later as a tensor-shape traceback. The checks read only shapes, dtypes, devices
and ``requires_grad``: no tensor is read back to the host. A reward runs under
``train.reward_timeout``, an environment under ``rollout.environment_timeout``
(:class:`CheckedEnvironment`).
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ppokit.batch import RolloutBatch
from ppokit.bounded import TimedOut, run_bounded
from ppokit.catalogue import Contract
from ppokit.components import KIND_PACKAGES
from ppokit.components.reward import Scored
from ppokit.errors import ComponentError, ComponentTimeout, UserError, one_line
from ppokit.registry import RegistryError, get_registry
from ppokit.slots import KINDS, SLOTS
from ppokit.spec import RewardSpec, Spec
from ppokit.trainer.checks import count

if TYPE_CHECKING:
    from ppokit.components import (
        Advantage,
        Aggregation,
        CriticTarget,
        Environment,
        GroupFilter,
        KLEstimator,
        PolicyLoss,
        PositionMask,
        PromptWeight,
        RegressionLoss,
        Reward,
        RolloutCorrection,
        RolloutEngine,
        Truncation,
    )
    from ppokit.components.rollout_engine import EngineContext, Generation, Sampling

__all__ = [
    "ATTRIBUTES",
    "Assembly",
    "Checked",
    "CheckedEngine",
    "CheckedEnvironment",
    "Where",
    "aggregate",
    "as_flags",
    "as_scores",
    "call_with_timeout",
    "checked",
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


@dataclass(frozen=True)
class Where:
    """A component in its slot: ``str()`` is ``advantage (gae, plugin ppokit)``."""

    slot: str
    name: str
    plugin: str

    def __str__(self) -> str:
        return f"{self.slot} ({self.name}, plugin {self.plugin})"

    @property
    def inline(self) -> str:
        """``policy.loss ppo_clip, plugin ppokit`` (inside parentheses of a message)."""
        return f"{self.slot} {self.name}, plugin {self.plugin}"


# ---------------------------------------------------------------------- the contract
def _describe(value: Any) -> str:
    if isinstance(value, Tensor):
        grad = " that requires grad" if value.requires_grad else ""
        dtype = str(value.dtype).removeprefix("torch.")
        article = "an" if dtype[0] in "aeiou" else "a"
        return f"{article} {dtype} tensor of shape {list(value.shape)}{grad}"
    if isinstance(value, RolloutBatch):
        return f"a RolloutBatch of shape {list(value.response_mask.shape)}"
    if value is None:
        return "None"
    return f"a {type(value).__name__}"


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], i: int, name: str) -> Any:
    return args[i] if len(args) > i else kwargs.get(name)


def _unreadable(t: Tensor) -> str | None:
    """Why the values of tensor ``t`` cannot be read as a dense tensor, or None."""
    if t.device.type == "meta":
        return "a tensor on the meta device, which holds no values"
    if t.layout != torch.strided:
        return f"a tensor of layout {str(t.layout).removeprefix('torch.')}, not a dense one"
    if t.is_quantized:
        return "a quantized tensor"
    return None


def _check_tensor(
    where: Where,
    out: Any,
    expect: str,
    shape: tuple[int, ...] | None,
    device: torch.device | None,
    *,
    bool_ok: bool = False,
    grad: bool | None = None,
) -> Tensor:
    """``out`` is a floating (or, with ``bool_ok``, bool) tensor of ``shape`` on ``device``;
    ``grad`` False: it requires no grad (an estimate); True: it does (a loss)."""
    if not isinstance(out, Tensor):
        raise ComponentError(f"{where} returned {_describe(out)}: expected {expect}")
    problem = _unreadable(out)
    if problem is not None:
        raise ComponentError(f"{where} returned {problem}: expected {expect}")
    if shape is not None and tuple(out.shape) != tuple(shape):
        raise ComponentError(f"{where} returned {_describe(out)}: expected {expect}")
    if not (out.is_floating_point() or (bool_ok and out.dtype == torch.bool)):
        raise ComponentError(f"{where} returned {_describe(out)}: expected {expect}")
    if device is not None and out.device != device:
        raise ComponentError(
            f"{where} returned a tensor on {out.device}: expected it on {device}, the "
            "device of its inputs"
        )
    if grad is False and out.requires_grad:
        raise ComponentError(
            f"{where} returned a tensor that requires grad: an estimate is detached "
            "(docs/design.md, convention 3)"
        )
    if grad is True and not out.requires_grad:
        raise ComponentError(
            f"{where} returned a tensor without grad: a loss is differentiable in its "
            "first argument"
        )
    return out


def _shape_text(shape: tuple[int, ...], names: str) -> str:
    return f"{list(shape)} ({names})"


def _estimate(where: Where, out: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """advantage, critic_target, rollout_correction: float [B, T], detached."""
    mask = _arg(args, kwargs, 0, "batch").response_mask
    expect = f"a float tensor of shape {_shape_text(mask.shape, 'B, T')} without grad"
    return _check_tensor(where, out, expect, mask.shape, mask.device, grad=False)


def _position_mask(where: Where, out: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    mask = _arg(args, kwargs, 0, "batch").response_mask
    expect = f"a float or bool tensor of shape {_shape_text(mask.shape, 'B, T')} without grad"
    return _check_tensor(where, out, expect, mask.shape, mask.device, bool_ok=True, grad=False)


def _prompt_weight(where: Where, out: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    mask = _arg(args, kwargs, 0, "batch").response_mask
    shape = mask.shape[:1]
    expect = f"a float tensor of shape {_shape_text(shape, 'B')} without grad"
    return _check_tensor(where, out, expect, shape, mask.device, grad=False)


def _group_filter(where: Where, out: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """group_filter: bool [G], on the rewards' device."""
    rewards = _arg(args, kwargs, 0, "groups").rewards
    shape = rewards.shape[:1]
    expect = f"a bool tensor of shape {_shape_text(shape, 'G')}"
    out = _check_tensor(where, out, expect, shape, rewards.device, bool_ok=True)
    if out.dtype != torch.bool:
        raise ComponentError(f"{where} returned {_describe(out)}: expected {expect}")
    return out


def _step(where: Where, out: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """environment (a step): a Step, its observation text or None, its reward a finite
    real number, done a bool."""
    from ppokit.environments import Step

    expect = "a Step(observation: str | None, reward: float, done: bool)"
    if not all(hasattr(out, f) for f in ("observation", "reward", "done")):
        raise ComponentError(f"{where} returned {_describe(out)}: expected {expect}")
    observation, reward, done = out.observation, out.reward, out.done
    if observation is not None and not isinstance(observation, str):
        raise ComponentError(
            f"{where} returned an observation of {_describe(observation)}: {expect}"
        )
    if (
        isinstance(reward, bool)
        or not isinstance(reward, numbers.Real)
        or not math.isfinite(float(reward))
    ):
        raise ComponentError(f"{where} returned the reward {reward!r}: expected a finite number")
    if not isinstance(done, bool):
        raise ComponentError(f"{where} returned done={done!r}: expected True or False")
    return Step(observation, float(reward), done)


def _truncation(where: Where, out: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    mask = _arg(args, kwargs, 0, "batch").response_mask
    if not isinstance(out, RolloutBatch) or out.response_mask.shape != mask.shape:
        raise ComponentError(
            f"{where} returned {_describe(out)}: expected a RolloutBatch of shape "
            f"{_shape_text(mask.shape, 'B, T')}"
        )
    return out


def _differentiable(x: Any) -> bool | None:
    """True when the output must carry grad (``x`` requires it and grad is on), else no
    requirement."""
    return True if isinstance(x, Tensor) and x.requires_grad and torch.is_grad_enabled() else None


def _elementwise(first: str, like_index: int, like_name: str) -> Callable[..., Any]:
    """policy_loss, kl_estimator (shaped like their first argument) and regression_loss
    (shaped like its target): [B, T], differentiable in the first argument."""

    def check(where: Where, out: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        like = _arg(args, kwargs, like_index, like_name)
        grad = _differentiable(_arg(args, kwargs, 0, first))
        expect = f"a float tensor of shape {_shape_text(like.shape, 'B, T')}"
        return _check_tensor(where, out, expect, like.shape, like.device, grad=grad)

    return check


def _aggregation(where: Where, out: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    loss = _arg(args, kwargs, 0, "values")
    grad = _differentiable(loss)
    device = loss.device if isinstance(loss, Tensor) else None
    return _check_tensor(where, out, "a float scalar (a 0-d tensor)", (), device, grad=grad)


def _is_number(value: Any) -> bool:
    if isinstance(value, Tensor):
        return value.numel() == 1 and not value.is_complex()
    return isinstance(value, numbers.Real)


def as_scores(value: Any, n: int, where: Where | str = "reward") -> Tensor:
    """A reward's return value as float32 ``[n]``: exactly one real number per response,
    as a dense tensor (any real dtype, any device but ``meta``), a numpy array or a list.
    Anything else (one value for many responses, a [B, 1] tensor, strings, None, a tensor
    without values) is a ComponentError, and so is a value that fails to convert."""
    try:
        return _as_scores(value, n, where)
    except ComponentError:
        raise
    except Exception as exc:  # a value whose conversion raises (its own __float__, ...)
        raise ComponentError(
            f"{where} returned {_describe(value)} that cannot be read as scores ({one_line(exc)})"
        ) from exc


def _as_scores(value: Any, n: int, where: Where | str) -> Tensor:
    expect = f"one number per response: a tensor of shape [{n}] or a list of {n} numbers"
    if isinstance(value, Tensor):
        t = value.detach()
    elif isinstance(value, (list, tuple)):
        bad = [v for v in value if not _is_number(v)]
        if bad:
            raise ComponentError(
                f"{where} returned a {type(value).__name__} holding {_describe(bad[0])}: "
                f"expected {expect}"
            )
        if len(value) != n:
            raise ComponentError(
                f"{where} returned {len(value)} scores for {n} responses: expected {expect}"
            )
        unreadable = [u for v in value if isinstance(v, Tensor) and (u := _unreadable(v))]
        if unreadable:
            raise ComponentError(
                f"{where} returned a {type(value).__name__} holding {unreadable[0]}: "
                f"expected {expect}"
            )
        t = torch.tensor([float(v) for v in value], dtype=torch.float32)
    elif type(value).__module__ == "numpy" and hasattr(value, "dtype"):
        if getattr(value.dtype, "kind", "") not in "biuf":
            raise ComponentError(
                f"{where} returned a numpy array of {value.dtype}: expected {expect}"
            )
        t = torch.as_tensor(value)
    else:
        raise ComponentError(f"{where} returned {_describe(value)}: expected {expect}")
    if t.is_complex():
        raise ComponentError(f"{where} returned {_describe(t)}: expected {expect}")
    problem = _unreadable(t)
    if problem is not None:
        raise ComponentError(f"{where} returned {problem}: expected {expect}")
    if tuple(t.shape) != (n,):
        raise ComponentError(
            f"{where} returned {_describe(t)} for {n} responses: expected {expect}"
        )
    return t.float()


def _reward(where: Where, out: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return as_scores(out, len(_arg(args, kwargs, 1, "responses")), where)


_FLAG = re.compile(r"[a-z][a-z0-9_]*")


def as_flags(value: Any, n: int, where: Where | str = "reward") -> dict[str, Tensor]:
    """A :class:`~ppokit.components.reward.Scored`'s flags as float32 ``[n]`` tensors in
    {0, 1}, by name: each one value per response (bools or numbers, 0 is unset); a
    ComponentError for a name that is no lower-case identifier or a wrong count."""
    if not isinstance(value, Mapping):
        raise ComponentError(f"{where} returned flags as {_describe(value)}: expected a mapping")
    flags = {}
    for name, raw in value.items():
        if not isinstance(name, str) or not _FLAG.fullmatch(name):
            raise ComponentError(
                f"{where} returned a flag named {name!r}: expected a lower-case identifier"
            )
        if isinstance(raw, (list, tuple)):
            raw = [float(bool(v)) for v in raw]
        flags[name] = (as_scores(raw, n, f"{where}'s flag {name!r}") != 0).float()
    return flags


def scored(
    fn: Any,
    where: Where | str,
    prompts: list[str],
    responses: list[str],
    fields: dict[str, list[Any]],
) -> tuple[Any, dict[str, Tensor]]:
    """A reward's scores (as it returned them) and its flags (float32 [B] each, see
    :class:`~ppokit.components.reward.Scored`) for ``responses`` and their ``fields``;
    ``fn``: a reward behind the boundary (:class:`Checked`) or a bare one."""
    if isinstance(fn, Checked):
        return fn.scored(prompts, responses, **fields)
    out = fn(prompts, responses, **fields)
    if isinstance(out, Scored):
        return out.scores, as_flags(out.flags, len(responses), where)
    return out, {}


Check = Callable[[Where, Any, tuple[Any, ...], dict[str, Any]], Any]

#: The tensor code of each check a kind's ``CONTRACT.returns`` names.
CHECKS: dict[str, Check] = {
    "scores": _reward,
    "group_keep": _group_filter,
    "environment": _step,
    "batch": _truncation,
    "estimate": _estimate,
    "position_mask": _position_mask,
    "prompt_weight": _prompt_weight,
    "scalar": _aggregation,
}


def _check_of(contract: Contract) -> Check:
    if contract.returns == "elementwise":
        assert contract.like is not None
        return _elementwise(contract.differentiable, *contract.like)
    return CHECKS[contract.returns]


#: The check of each kind's return value, from the ``CONTRACT`` beside its Protocol
#: (docs/design.md, "Component kinds"); the rollout engine has its own (CheckedEngine).
CONTRACTS: dict[str, Check] = {
    kind: _check_of(package.CONTRACT)
    for kind, package in zip(KINDS, KIND_PACKAGES, strict=True)
    if hasattr(package, "CONTRACT")
}


#: What each kind returns (its ``CONTRACT.returns``).
RETURNS: dict[str, str] = {
    kind: package.CONTRACT.returns
    for kind, package in zip(KINDS, KIND_PACKAGES, strict=True)
    if hasattr(package, "CONTRACT")
}

#: The returns whose NaNs and infs a checked component counts into the round's active
#: counter (:func:`~ppokit.trainer.checks.count`), with the unit its message names. An
#: aggregation's scalar is not among them: the trainer counts its loss terms itself.
COUNTED: dict[str, str] = {
    "scores": "responses",
    "prompt_weight": "responses",
    "estimate": "positions",
    "position_mask": "positions",
    "elementwise": "positions",
}


def optional(component: Any, kind: str, member: str) -> Any:
    """The optional ``member`` of a component of ``kind`` (None when it has none): only a
    member its kind's ``CONTRACT.optional`` declares is read."""
    declared = getattr(KIND_PACKAGES[KINDS.index(kind)], "CONTRACT", None)
    if declared is None or member not in declared.optional:
        raise KeyError(f"{kind} declares no optional member {member!r}")
    return getattr(component, member, None)


def call_with_timeout(
    fn: Callable[..., Any],
    timeout: float | None,
    where: Where | str,
    *args: Any,
    setting: str = "train.reward_timeout",
    **kwargs: Any,
) -> Any:
    """``fn(*args, **kwargs)`` on a worker thread, waited for at most ``timeout`` seconds
    (``None``: called here, unbounded; ``setting``: where the bound is set, for the
    message). A call that runs over raises
    :class:`ComponentTimeout`. A Python thread cannot be killed: the call goes on in the
    background (a daemon thread, so the process can still exit) and the run stops."""
    name = where.slot if isinstance(where, Where) else str(where)
    try:
        return run_bounded(lambda: fn(*args, **kwargs), timeout, f"ppokit-{name}")
    except TimedOut:
        raise ComponentTimeout(
            f"{where} did not return within {setting} ({timeout:g} s); a running "
            "call cannot be interrupted, so the run stops"
        ) from None


class Checked:
    """A component behind the trainer's boundary: ``__call__`` calls it (a reward under
    ``timeout``) and checks the result against its kind's contract (:data:`CONTRACTS`);
    every other attribute (the optional members ``denominator``, ``clipped``,
    ``head_size``, ...) is the component's own."""

    def __init__(
        self, kind: str, where: Where, component: Any, timeout: float | None = None
    ) -> None:
        self.kind = kind
        self.where = where
        self.component = component
        self.timeout = timeout
        self._contract = CONTRACTS[kind]
        self._unit = COUNTED.get(RETURNS[kind])

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.kind == "reward":
            return self.scored(*args, **kwargs)[0]
        return self._checked(self.component(*args, **kwargs), args, kwargs)

    def _checked(self, out: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        out = self._contract(self.where, out, args, kwargs)
        if self._unit is not None:  # into the round's active non-finite counter
            count(str(self.where), out, self._unit)
        return out

    def scored(self, *args: Any, **kwargs: Any) -> tuple[Tensor, dict[str, Tensor]]:
        """A reward's call under its timeout: its scores (float32 [B]) and its flags (a
        :class:`~ppokit.components.reward.Scored`'s, float32 [B] each; none for bare
        scores)."""
        out = call_with_timeout(self.component, self.timeout, self.where, *args, **kwargs)
        flags: dict[str, Tensor] = {}
        if isinstance(out, Scored):
            n = len(_arg(args, kwargs, 1, "responses"))
            out, flags = out.scores, as_flags(out.flags, n, self.where)
        return self._checked(out, args, kwargs), flags

    def __getattr__(self, name: str) -> Any:
        try:
            component = self.__dict__["component"]
        except KeyError:
            raise AttributeError(name) from None
        return getattr(component, name)

    def __repr__(self) -> str:
        return f"Checked({self.where}: {self.component!r})"


class CheckedEngine:
    """A rollout engine behind the trainer's boundary: an exception in ``start``,
    ``generate``, ``sync`` or ``close`` is a :class:`ComponentError` naming the slot, the
    engine and its plugin, and ``generate``'s :class:`Generation` is checked against the
    contract (rows, shapes, dtypes, device; log-probs unless greedy). The optional members
    get their defaults here."""

    def __init__(self, where: Where, engine: RolloutEngine) -> None:
        self.where = where
        self.engine = engine

    @property
    def samples_from_policy(self) -> bool:
        return bool(getattr(self.engine, "samples_from_policy", False))

    def _call(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except (UserError, ComponentError):
            raise
        except Exception as exc:
            raise ComponentError(f"{self.where} failed in {what}: {one_line(exc)}") from exc

    def start(self, context: EngineContext) -> None:
        self._call("start", self.engine.start, context)

    def generate(self, prompt_ids: Tensor, prompt_mask: Tensor, sampling: Sampling) -> Generation:
        out = self._call("generate", self.engine.generate, prompt_ids, prompt_mask, sampling)
        rows = prompt_ids.shape[0] * sampling.n
        device = prompt_ids.device

        def bad(what: str) -> ComponentError:
            return ComponentError(
                f"{self.where} returned {what}: expected a Generation of {rows} rows "
                f"({prompt_ids.shape[0]} prompts x n={sampling.n}) on {device}"
            )

        fields = ("response_ids", "response_mask", "truncated", "logp")
        if not all(hasattr(out, f) for f in fields):
            raise bad(_describe(out))
        ids, mask, truncated, logp = (getattr(out, f) for f in fields)
        for name, t in (("response_ids", ids), ("response_mask", mask), ("truncated", truncated)):
            if not isinstance(t, Tensor) or t.device != device or t.shape[:1] != (rows,):
                raise bad(f"{name} as {_describe(t)}")
        if ids.dim() != 2 or ids.is_floating_point() or ids.dtype == torch.bool:
            raise bad(f"response_ids as {_describe(ids)}")
        if mask.dtype != torch.bool or mask.shape != ids.shape:
            raise bad(f"response_mask as {_describe(mask)}")
        if truncated.dtype != torch.bool or truncated.dim() != 1:
            raise bad(f"truncated as {_describe(truncated)}")
        if logp is None and not sampling.greedy:
            raise bad("no log-probs (logp None) for sampled responses")
        if logp is not None and (
            not isinstance(logp, Tensor)
            or not logp.is_floating_point()
            or logp.shape != ids.shape
            or logp.device != device
        ):
            raise bad(f"logp as {_describe(logp)}")
        return out

    def sync(self) -> None:
        sync = getattr(self.engine, "sync", None)
        if sync is not None:
            self._call("sync", sync)

    def close(self) -> None:
        close = getattr(self.engine, "close", None)
        if close is not None:
            self._call("close", close)

    def __repr__(self) -> str:
        return f"CheckedEngine({self.where}: {self.engine!r})"


class CheckedEnvironment:
    """An environment behind the trainer's boundary: ``reset`` and ``step`` run under
    ``rollout.environment_timeout``; an exception in either is a :class:`ComponentError`
    naming the slot, the environment and its plugin; ``reset`` returns text or None and
    ``step`` a :class:`~ppokit.environments.Step` (checked: its observation text or None,
    a finite reward, a bool ``done``)."""

    def __init__(self, where: Where, environment: Environment, timeout: float | None) -> None:
        self.where = where
        self.environment = environment
        self.timeout = timeout

    @property
    def single_turn(self) -> bool:
        return bool(optional(self.environment, "environment", "single_turn"))

    def _call(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return call_with_timeout(
                fn, self.timeout, self.where, *args, setting="rollout.environment_timeout"
            )
        except (UserError, ComponentError):
            raise
        except Exception as exc:
            raise ComponentError(f"{self.where} failed in {what}: {one_line(exc)}") from exc

    def reset(self, row: dict[str, Any]) -> str | None:
        out = self._call("reset", self.environment.reset, row)
        if out is not None and not isinstance(out, str):
            raise ComponentError(
                f"{self.where} returned {_describe(out)} from reset: expected text or None"
            )
        return out

    def step(self, row: dict[str, Any], response: str, turn: int) -> Any:
        out = self._call("step", self.environment.step, row, response, turn)
        return _step(self.where, out, (row, response, turn), {})

    def __repr__(self) -> str:
        return f"CheckedEnvironment({self.where}: {self.environment!r})"


def create(spec: Spec, path: str, kind: str, comp: Any) -> tuple[Where, Any]:
    """The component ``comp`` of slot ``path`` (of ``kind``) created through the registry
    and wrapped behind its boundary (a reward under ``train.reward_timeout``), with where it
    sits; a factory that raises is a :class:`ComponentError` naming the slot, the
    component and the plugin."""
    registry = get_registry()
    here = Where(path, comp.name, registry.info(kind, comp.name).plugin)
    try:
        component = registry.create(kind, comp.name, **comp.params)
    except (RegistryError, UserError):
        raise  # these already name the component and say what to do
    except Exception as exc:
        raise ComponentError(f"{here} failed to start: {one_line(exc)}") from exc
    if kind == "rollout_engine":
        return here, CheckedEngine(here, component)
    if kind == "environment":
        return here, CheckedEnvironment(here, component, spec.rollout.environment_timeout)
    timeout = spec.train.reward_timeout if kind == "reward" else None
    return here, checked(kind, here, component, timeout)


def rewards_of(spec: Spec) -> list[tuple[str, Reward, float]]:
    """The spec's rewards alone, created and behind their boundary: (name, reward, weight)
    each, in the spec's order (what a reward server serves)."""
    return [
        (comp.name, create(spec, path, kind, comp)[1], float(comp.weight))
        for path, kind, comp in spec.slots()
        if isinstance(comp, RewardSpec)
    ]


def checked(kind: str, where: Where, component: Any, timeout: float | None = None) -> Checked:
    """``component`` behind the boundary checks of its ``kind`` (see :class:`Checked`)."""
    return Checked(kind, where, component, timeout)


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
