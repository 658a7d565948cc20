"""The contract of each component kind, checked where a component's return value crosses
into the trainer (docs/design.md): a reward returns exactly one real number per response, an
estimate is a ``[B, T]`` (or ``[B]``) float tensor without grad, a loss keeps its grad, an
aggregation returns a scalar, a truncation rule a ``RolloutBatch``, an environment's step a
``Step``, a rollout engine a ``Generation`` of the asked rows, shapes, dtypes and values.

A check reads shapes, dtypes, devices and ``requires_grad``; only the engine's output is
read back to the host, once a generation (its ids, mask and log μ), as the decode that
follows reads it anyway. Each failure is a :class:`~ppokit.errors.ComponentError` naming the
slot, the component and its plugin (:class:`Where`).
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ppokit.batch import RolloutBatch
from ppokit.catalogue import Contract
from ppokit.components import KIND_PACKAGES
from ppokit.errors import ComponentError, one_line
from ppokit.slots import KINDS

if TYPE_CHECKING:
    from ppokit.components.rollout_engine import Generation, Sampling

__all__ = [
    "CHECKS",
    "CONTRACTS",
    "COUNTED",
    "LOGP_SLACK",
    "RETURNS",
    "EngineLimits",
    "Where",
    "as_flags",
    "as_scores",
    "check_generation",
    "check_step",
    "describe",
    "optional",
    "responses_of",
]


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
def describe(value: Any) -> str:
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
        raise ComponentError(f"{where} returned {describe(out)}: expected {expect}")
    problem = _unreadable(out)
    if problem is not None:
        raise ComponentError(f"{where} returned {problem}: expected {expect}")
    if shape is not None and tuple(out.shape) != tuple(shape):
        raise ComponentError(f"{where} returned {describe(out)}: expected {expect}")
    if not (out.is_floating_point() or (bool_ok and out.dtype == torch.bool)):
        raise ComponentError(f"{where} returned {describe(out)}: expected {expect}")
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
        raise ComponentError(f"{where} returned {describe(out)}: expected {expect}")
    return out


def check_step(where: Where, out: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """environment (a step): a Step, its observation text or None, its reward a finite
    real number, done a bool."""
    from ppokit.environments import Step

    expect = "a Step(observation: str | None, reward: float, done: bool)"
    if not all(hasattr(out, f) for f in ("observation", "reward", "done")):
        raise ComponentError(f"{where} returned {describe(out)}: expected {expect}")
    observation, reward, done = out.observation, out.reward, out.done
    if observation is not None and not isinstance(observation, str):
        raise ComponentError(
            f"{where} returned an observation of {describe(observation)}: {expect}"
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
            f"{where} returned {describe(out)}: expected a RolloutBatch of shape "
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
            f"{where} returned {describe(value)} that cannot be read as scores ({one_line(exc)})"
        ) from exc


def _as_scores(value: Any, n: int, where: Where | str) -> Tensor:
    expect = f"one number per response: a tensor of shape [{n}] or a list of {n} numbers"
    if isinstance(value, Tensor):
        t = value.detach()
    elif isinstance(value, (list, tuple)):
        bad = [v for v in value if not _is_number(v)]
        if bad:
            raise ComponentError(
                f"{where} returned a {type(value).__name__} holding {describe(bad[0])}: "
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
        raise ComponentError(f"{where} returned {describe(value)}: expected {expect}")
    if t.is_complex():
        raise ComponentError(f"{where} returned {describe(t)}: expected {expect}")
    problem = _unreadable(t)
    if problem is not None:
        raise ComponentError(f"{where} returned {problem}: expected {expect}")
    if tuple(t.shape) != (n,):
        raise ComponentError(f"{where} returned {describe(t)} for {n} responses: expected {expect}")
    return t.float()


_FLAG = re.compile(r"[a-z][a-z0-9_]*")


def as_flags(value: Any, n: int, where: Where | str = "reward") -> dict[str, Tensor]:
    """A :class:`~ppokit.components.reward.Scored`'s flags as float32 ``[n]`` tensors in
    {0, 1}, by name: each one value per response (bools or numbers, 0 is unset); a
    ComponentError for a name that is no lower-case identifier or a wrong count."""
    if not isinstance(value, Mapping):
        raise ComponentError(f"{where} returned flags as {describe(value)}: expected a mapping")
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


def responses_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The ``responses`` argument of a reward's call."""
    return _arg(args, kwargs, 1, "responses")


def _reward(where: Where, out: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return as_scores(out, len(_arg(args, kwargs, 1, "responses")), where)


Check = Callable[[Where, Any, tuple[Any, ...], dict[str, Any]], Any]

#: The tensor code of each check a kind's ``CONTRACT.returns`` names.
CHECKS: dict[str, Check] = {
    "scores": _reward,
    "group_keep": _group_filter,
    "environment": check_step,
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


#: How far above 0 a log-probability may be (float rounding of a log-softmax) before it is
#: not a log-probability.
LOGP_SLACK = 1e-3


@dataclass(frozen=True)
class EngineLimits:
    """What an engine's output is checked against: the tokenizer's ids ``[0, vocab)`` and
    the model's context length (None: unknown, not checked)."""

    vocab: int | None = None
    context: int | None = None


def check_generation(
    where: Where,
    out: Any,
    prompt_ids: Tensor,
    sampling: Sampling,
    limits: EngineLimits,
) -> Generation:
    """``out`` is the :class:`Generation` a ``generate(prompt_ids, ..., sampling)`` call
    promises: its rows, shapes, dtypes (long ids, bool masks), device; at least one
    position and at most ``max_new_tokens`` (and the context length, with the prompt); log μ
    unless greedy. Then its values, in one host read: ids within the vocabulary, each
    row's mask a prefix (no token after its padding) of at least one token, log μ finite and
    at most 0 on the response."""
    rows = prompt_ids.shape[0] * sampling.n
    device = prompt_ids.device

    def bad(what: str) -> ComponentError:
        return ComponentError(
            f"{where} returned {what}: expected a Generation of {rows} rows "
            f"({prompt_ids.shape[0]} prompts x n={sampling.n}) on {device}"
        )

    fields = ("response_ids", "response_mask", "truncated", "logp")
    if not all(hasattr(out, f) for f in fields):
        raise bad(describe(out))
    ids, mask, truncated, logp = (getattr(out, f) for f in fields)
    for name, t in (("response_ids", ids), ("response_mask", mask), ("truncated", truncated)):
        if not isinstance(t, Tensor) or t.device != device or t.shape[:1] != (rows,):
            raise bad(f"{name} as {describe(t)}")
        problem = _unreadable(t)
        if problem is not None:
            raise bad(f"{name} as {problem}")
    if ids.dim() != 2 or ids.dtype != torch.long:
        raise bad(f"response_ids as {describe(ids)} (token ids are int64, as gathers take)")
    if mask.dtype != torch.bool or mask.shape != ids.shape:
        raise bad(f"response_mask as {describe(mask)}")
    if truncated.dtype != torch.bool or truncated.dim() != 1:
        raise bad(f"truncated as {describe(truncated)}")
    width = ids.shape[1]
    if width < 1:
        raise bad("responses of no position")
    if width > sampling.max_new_tokens:
        raise bad(f"responses of {width} positions for max_new_tokens={sampling.max_new_tokens}")
    if limits.context is not None and prompt_ids.shape[1] + width > limits.context:
        raise bad(
            f"{prompt_ids.shape[1]} prompt and {width} response positions, past the model's "
            f"context of {limits.context}"
        )
    if logp is None and not sampling.greedy:
        raise bad("no log-probs (logp None) for sampled responses")
    if logp is not None and (
        not isinstance(logp, Tensor)
        or not logp.is_floating_point()
        or logp.shape != ids.shape
        or logp.device != device
        or _unreadable(logp) is not None
    ):
        raise bad(f"logp as {describe(logp)}")
    _check_values(bad, ids, mask, logp, limits)
    return out  # type: ignore[no-any-return]


def _check_values(
    bad: Callable[[str], ComponentError],
    ids: Tensor,
    mask: Tensor,
    logp: Tensor | None,
    limits: EngineLimits,
) -> None:
    """The values of a generation's ids, mask and log μ, read back in one host read."""
    flags = [
        (ids < 0).any(),
        (ids >= limits.vocab).any()
        if limits.vocab is not None
        else ids.new_zeros((), dtype=torch.bool),
        (mask[:, 1:] & ~mask[:, :-1]).any(),
        ~mask.any(1).all(),
    ]
    if logp is not None:
        on = logp.float().masked_fill(~mask, 0.0)
        flags += [(~torch.isfinite(on)).any(), (on > LOGP_SLACK).any()]
    (neg, over, gap, empty, *lp) = torch.stack(flags).tolist()
    if neg or over:
        vocab = f" of {limits.vocab}" if limits.vocab is not None else ""
        raise bad(f"token ids outside the vocabulary{vocab} (ids are in [0, vocab))")
    if gap:
        raise bad("a response_mask with tokens after a row's padding (a row's mask is a prefix)")
    if empty:
        raise bad("a row without any token in response_mask (its EOS at least)")
    if lp and lp[0]:
        raise bad("logp with a NaN or infinite value on the response")
    if lp and lp[1]:
        raise bad("logp above 0 on the response (a log-probability is at most 0)")
