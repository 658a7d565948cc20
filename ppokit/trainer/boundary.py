"""The trainer's boundary: every call of a component, bounded in time, with what it raises
made one line and what it returns checked (:mod:`ppokit.trainer.contract`).

Where each kind runs, and what bounds it (the one place for bounds is :mod:`ppokit.bounded`):

- a **reward** (``train.reward_timeout``) and an **environment**
  (``rollout.environment_timeout``) run in worker processes of their own
  (:class:`ppokit.workers.WorkerPool`: one process each, a reward ``train.reward_workers``,
  over which its batch is split at group boundaries), killed when a call runs over; with
  the timeout null they run in the trainer's process, unbounded, on copies of their inputs.
  A reward's call is :meth:`Checked.reply` (what a scoring thread may run, see
  :mod:`ppokit.trainer.scoring`) and its checks :meth:`Checked.scores_of` (on the trainer's
  thread, which counts into the round's non-finite counter);
- a **rollout engine**'s ``generate``, ``sync`` and ``close`` (``rollout.engine_timeout``)
  and the components called once a round on the round's tensors (group filter, rollout
  correction, truncation rule, advantage, critic target, position mask, prompt weight:
  ``train.component_timeout``) run in the trainer's process under
  :func:`ppokit.bounded.deadline`;
- the per-micro-batch terms (policy and regression losses, KL estimator, aggregation) run
  unbounded inside the update.

Whatever a component raises (``SystemExit``, ``KeyboardInterrupt`` and any
``BaseException`` included, or its worker process dying) stops the run as a
:class:`~ppokit.errors.ComponentError`: one line naming the slot, the component, its plugin,
what it raised and the ``file:line`` where (``ppokit --traceback`` shows the traceback). A
:class:`~ppokit.errors.UserError` a component raises (a missing data column, ...) is its own
line, as is. A real Ctrl-C is not the component's: it ends the run as an interruption. A
component that writes into a tensor it was given (its ``_version`` counter moves) is an
error too: the inputs of one component are the next one's.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import itertools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

import torch
from torch import Tensor

from ppokit import distributed
from ppokit.bounded import TimedOut, deadline, interrupts
from ppokit.components.reward import Scored
from ppokit.errors import ComponentError, ComponentTimeout, UserError, one_line, raised_at
from ppokit.trainer.checks import count
from ppokit.trainer.contract import (
    CONTRACTS,
    COUNTED,
    RETURNS,
    EngineLimits,
    Where,
    as_flags,
    check_generation,
    check_step,
    describe,
    optional,
    responses_of,
)
from ppokit.workers import Call, Raised, WorkerDied, WorkerPool

if TYPE_CHECKING:
    from ppokit.components import Environment, RolloutEngine
    from ppokit.components.rollout_engine import EngineContext, Generation, Sampling

__all__ = [
    "BOUNDED_KINDS",
    "Checked",
    "CheckedEngine",
    "CheckedEnvironment",
    "EnvironmentInWorker",
    "InWorker",
    "RewardInWorker",
    "call_here",
    "code_of",
    "failure",
    "finish",
    "join_answers",
    "reply",
    "reraise",
    "scored",
    "split_groups",
    "waits",
]

#: The kinds called once a round on the round's tensors, bounded in the trainer's process by
#: ``train.component_timeout``.
BOUNDED_KINDS = frozenset(
    {
        "group_filter",
        "rollout_correction",
        "truncation",
        "advantage",
        "critic_target",
        "position_mask",
        "prompt_weight",
    }
)


def code_of(component: Any) -> str | None:
    """``file:line`` of a component's code: the function it wraps (``__wrapped__``, as the
    python reward sets it), the function itself, or its class."""
    target = getattr(component, "__wrapped__", component)
    try:
        if not (inspect.isfunction(target) or inspect.ismethod(target)):
            target = type(target)
        file = inspect.getsourcefile(target)
        _, line = inspect.getsourcelines(target)
    except (TypeError, OSError):
        return None
    return None if file is None else f"{file}:{line}"


def failure(
    where: Where | str, exc: BaseException, what: str = "", code: str | None = None
) -> UserError:
    """The error that stops the run for ``exc``, raised by a component's call (``what``: the
    member called, for engines and environments; ``code``: where its code is, named when
    the exact line is unknown): a :class:`UserError` it raised as is, anything else one
    :class:`ComponentError` line."""
    doing = f" in {what}" if what else ""
    if isinstance(exc, UserError):
        return exc
    if isinstance(exc, Raised):
        original = exc.original
        if isinstance(original, UserError):
            return original
        location = exc.location
        if location and location.startswith("<dynamic-code>:") and code:  # crossed by value
            location = f"{code.rpartition(':')[0]}:{location.rpartition(':')[2]}"
        at = f" (at {location})" if location else ""
        return ComponentError(f"{where} failed{doing}: {exc.message}{at}")
    if isinstance(exc, WorkerDied):
        at = f" (its code: {code})" if code else ""
        return ComponentError(f"{where} failed{doing}: {exc}{at}")
    location = raised_at(exc)
    at = f" (at {location})" if location else ""
    return ComponentError(f"{where} failed{doing}: {one_line(exc)}{at}")


def call_here(
    where: Where | str,
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    *,
    what: str = "",
    timeout: float | None = None,
    setting: str = "",
) -> Any:
    """``fn(*args, **kwargs)`` in this process, under :func:`deadline` (``timeout``, set by
    ``setting``), with whatever it raises made the run's one line (:func:`reraise`)."""
    before = interrupts()
    try:
        with deadline(timeout, str(where)):
            return fn(*args, **(kwargs or {}))
    except TimedOut:
        doing = f" from {what}" if what else ""
        raise ComponentTimeout(
            f"{where} did not return{doing} within {setting} ({timeout:g} s): it was "
            "interrupted and the run stops"
        ) from None
    except BaseException as exc:
        reraise(where, exc, before, what)


def reraise(where: Where | str, exc: BaseException, before: int, what: str = "") -> NoReturn:
    """Raise what stops the run for ``exc``, raised by a component's call in this process
    (:func:`failure`); a ``KeyboardInterrupt`` is a Ctrl-C, raised as it is, when one
    arrived since :func:`~ppokit.bounded.interrupts` was ``before``."""
    if isinstance(exc, UserError) or (
        isinstance(exc, KeyboardInterrupt) and interrupts() != before
    ):
        raise exc  # its own line already; or a Ctrl-C
    raise failure(where, exc, what) from exc


def call_in_worker(
    where: Where,
    pool: WorkerPool,
    calls: list[Call],
    timeout: float | None,
    setting: str,
    what: str = "",
    code: str | None = None,
) -> list[Any]:
    """The results of ``calls`` of ``pool``'s component, each bounded by ``timeout``."""
    try:
        return pool.map(calls, timeout)
    except TimedOut:
        doing = f" from {what}" if what else ""
        raise ComponentTimeout(
            f"{where} did not return{doing} within {setting} ({timeout:g} s): its worker "
            "process was stopped and the run stops"
        ) from None
    except (Raised, WorkerDied) as exc:
        raise failure(where, exc, what, code) from exc
    except Exception as exc:  # its inputs could not be sent
        raise ComponentError(f"{where}: cannot send its inputs: {one_line(exc)}") from exc


def start_pool(where: Where, target: Any, setting: str, size: int = 1) -> WorkerPool:
    """``size`` worker processes for ``target``, or one line saying why it cannot cross."""
    try:
        return WorkerPool(target, size=size, name=f"ppokit-{where.slot}")
    except Exception as exc:
        raise ComponentError(
            f"{where} cannot be sent to a worker process ({one_line(exc)}); set {setting}: "
            "null to run it in the trainer's process, unbounded"
        ) from exc


def _versions(args: Sequence[Any], kwargs: dict[str, Any]) -> list[tuple[str, Tensor, int]]:
    """(name, tensor, version) of every tensor among the arguments, and among the fields of
    a dataclass argument (a ``RolloutBatch``, a group filter's ``Groups``)."""
    found: list[tuple[str, Tensor, int]] = []
    for i, value in [*enumerate(args), *kwargs.items()]:
        if isinstance(value, Tensor):
            found.append((f"argument {i}", value, value._version))
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            for f in dataclasses.fields(value):
                t = getattr(value, f.name)
                if isinstance(t, Tensor):
                    found.append((f"{type(value).__name__}.{f.name}", t, t._version))
    return found


def _unchanged(where: Where, versions: list[tuple[str, Tensor, int]]) -> None:
    for name, t, version in versions:
        if t._version != version:
            raise ComponentError(
                f"{where} wrote into its input {name} in place: a component's inputs are "
                "read-only (others read them after it); return a new tensor"
            )


# ---------------------------------------------------------------------- what runs in workers
class InWorker:
    """A component as it crosses to its worker process, with the :class:`World` of the
    run's process that made it (its rank and size, which the worker then reads from
    :func:`ppokit.distributed.world`; no process group)."""

    def __init__(self) -> None:
        self.world = distributed.world()

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        distributed.adopt(state["world"])


class RewardInWorker(InWorker):
    """A reward as it runs in its worker process: a tensor result crosses back on the CPU
    (a meta tensor as it is, for the contract's message)."""

    def __init__(self, reward: Any) -> None:
        super().__init__()
        self.reward = reward

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self.reward(*args, **kwargs)
        if isinstance(out, Tensor) and out.device.type not in ("cpu", "meta"):
            out = out.detach().cpu()
        return out


class EnvironmentInWorker(InWorker):
    """An environment as it runs in its worker process: ``reset`` and ``step`` return the
    episode's row too (what the environment wrote into it crosses back), and the optional
    ``state_dict``/``load_state_dict`` pass through."""

    def __init__(self, environment: Any) -> None:
        super().__init__()
        self.environment = environment

    def reset(self, row: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        return self.environment.reset(row), row

    def step(self, row: dict[str, Any], response: str, turn: int) -> tuple[Any, dict[str, Any]]:
        return self.environment.step(row, response, turn), row

    def state_dict(self) -> Any:
        read = optional(self.environment, "environment", "state_dict")
        return None if read is None else read()

    def load_state_dict(self, state: Any) -> None:
        self.environment.load_state_dict(state)


# ---------------------------------------------------------------------- components
class Checked:
    """A component behind the trainer's boundary: ``__call__`` calls it (a reward in its
    worker process when ``timeout`` is set, a kind of :data:`BOUNDED_KINDS` under its
    deadline), makes what it raises one line, refuses a write into its input tensors, and
    checks the result against its kind's contract (:data:`CONTRACTS`); every other
    attribute (the optional members ``denominator``, ``clipped``, ``head_size``, ...) is the
    component's own."""

    def __init__(
        self,
        kind: str,
        where: Where,
        component: Any,
        timeout: float | None = None,
        setting: str = "",
        workers: int = 1,
    ) -> None:
        self.kind = kind
        self.where = where
        self.component = component
        self.timeout = timeout
        self.setting = setting or (
            "train.reward_timeout" if kind == "reward" else "train.component_timeout"
        )
        self._contract = CONTRACTS[kind]
        self._unit = COUNTED.get(RETURNS[kind])
        self.pool: WorkerPool | None = None
        if kind == "reward" and timeout is not None:
            self.pool = start_pool(where, RewardInWorker(component), self.setting, workers)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.kind == "reward":
            return self.scored(*args, **kwargs)[0]
        versions = _versions(args, kwargs)
        if self.kind in BOUNDED_KINDS:
            out = call_here(
                self.where, self.component, args, kwargs, timeout=self.timeout, setting=self.setting
            )
        else:  # the per-micro-batch terms: called straight, inside the update
            before = interrupts()
            try:
                out = self.component(*args, **kwargs)
            except BaseException as exc:
                reraise(self.where, exc, before)
        _unchanged(self.where, versions)
        return self._checked(out, args, kwargs)

    @property
    def waits(self) -> bool:
        """Whether a reward's call mostly waits on something outside the trainer's threads:
        it declares itself ``blocking`` (a server, a sandbox) or runs in several worker
        processes (``train.reward_workers``)."""
        blocking = bool(optional(self.component, "reward", "blocking"))
        return blocking or (self.pool is not None and self.pool.size > 1)

    def scored(self, *args: Any, **kwargs: Any) -> tuple[Tensor, dict[str, Tensor]]:
        """A reward's call (in its worker processes, or here on its own copies of its
        inputs): its scores (float32 [B]) and its flags (a
        :class:`~ppokit.components.reward.Scored`'s, float32 [B] each; none for bare
        scores)."""
        return self.scores_of(self.reply(*args, **kwargs), args, kwargs)

    def reply(self, *args: Any, **kwargs: Any) -> Any:
        """A reward's answer as it returned it, unchecked: in its worker processes (the
        batch split at group boundaries over them, the answers joined in the rows'
        order), or here on its own copies of its inputs. Safe on any thread: it counts
        nothing."""
        versions = _versions(args, kwargs)
        if self.pool is not None:
            pieces = split_groups(args, kwargs, self.pool.size)
            calls = [Call(None, a, k) for a, k, _ in pieces]
            outs = call_in_worker(
                self.where, self.pool, calls, self.timeout, self.setting, code=self.code
            )
            out = outs[0] if len(outs) == 1 else join_answers(outs, [n for _, _, n in pieces])
        else:  # its own copies: what it changes, no other reward sees
            mine, theirs = copy.deepcopy((args, kwargs))
            out = call_here(self.where, self.component, mine, theirs)
        _unchanged(self.where, versions)
        return out

    def scores_of(
        self, out: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """A reward's answer ``out`` (:meth:`reply`) checked against its contract and
        counted into the round's non-finite counter: its scores and flags."""
        flags: dict[str, Tensor] = {}
        if isinstance(out, Scored):
            n = len(responses_of(args, kwargs))
            out, flags = out.scores, as_flags(out.flags, n, self.where)
        return self._checked(out, args, kwargs), flags

    def _checked(self, out: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        out = self._contract(self.where, out, args, kwargs)
        if self._unit is not None:  # into the round's active non-finite counter
            count(str(self.where), out, self._unit)
        return out

    @functools.cached_property
    def code(self) -> str | None:
        """Where the component's code is (:func:`code_of`), read once."""
        return code_of(self.component)

    def close(self) -> None:
        """End its worker process, if it has one."""
        if self.pool is not None:
            self.pool.close()

    def __getattr__(self, name: str) -> Any:
        try:
            component = self.__dict__["component"]
        except KeyError:
            raise AttributeError(name) from None
        return getattr(component, name)

    def __repr__(self) -> str:
        return f"Checked({self.where}: {self.component!r})"


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
    return finish(fn, where, reply(fn, prompts, responses, fields), prompts, responses, fields)


def reply(fn: Any, prompts: list[str], responses: list[str], fields: dict[str, list[Any]]) -> Any:
    """A reward's answer for ``responses``, unchecked (:meth:`Checked.reply`; a bare reward
    called as it is)."""
    if isinstance(fn, Checked):
        return fn.reply(prompts, responses, **fields)
    return fn(prompts, responses, **fields)


def finish(
    fn: Any,
    where: Where | str,
    out: Any,
    prompts: list[str],
    responses: list[str],
    fields: dict[str, list[Any]],
) -> tuple[Any, dict[str, Tensor]]:
    """A reward's answer ``out`` (:func:`reply`) as its scores and flags, checked when
    the reward is behind the boundary (:meth:`Checked.scores_of`)."""
    if isinstance(fn, Checked):
        return fn.scores_of(out, (prompts, responses), fields)
    if isinstance(out, Scored):
        return out.scores, as_flags(out.flags, len(responses), where)
    return out, {}


def waits(fn: Any) -> bool:
    """Whether a reward mostly waits on something outside the trainer's threads
    (:attr:`Checked.waits`; a bare reward: its ``blocking`` member)."""
    if isinstance(fn, Checked):
        return fn.waits
    return bool(getattr(fn, "blocking", False))


def split_groups(
    args: tuple[Any, ...], kwargs: dict[str, Any], parts: int
) -> list[tuple[tuple[Any, ...], dict[str, Any], int]]:
    """A reward's call ``(prompts, responses, **fields)`` as at most ``parts`` calls of
    about equal size, each cut where the prompt changes (a group, the responses to one
    prompt, stays whole): (args, kwargs, rows) each, in the rows' order."""
    prompts = list(args[0]) if args else list(kwargs.get("prompts", []))
    b = len(prompts)
    if parts <= 1 or b <= 1 or len(args) != 2:
        return [(args, kwargs, b)]
    starts = [i for i in range(1, b) if prompts[i] != prompts[i - 1]]
    cuts: list[int] = []
    for j in range(1, parts):
        at = next((s for s in starts if s >= round(b * j / parts)), None)
        if at is not None and at not in cuts:
            cuts.append(at)
    edges = [0, *cuts, b]
    out = []
    for lo, hi in itertools.pairwise(edges):
        piece = slice(lo, hi)
        a = tuple(list(x)[piece] for x in args)
        k = {
            key: list(v)[piece] if isinstance(v, (list, tuple)) and len(v) == b else v
            for key, v in kwargs.items()
        }
        out.append((a, k, hi - lo))
    return out


def join_answers(outs: list[Any], sizes: list[int]) -> Any:
    """The answers of a call's pieces (:func:`split_groups`) as one answer, in the rows'
    order: their scores concatenated, and their flags (a piece without a flag: False on
    its rows). A piece whose scores are not one per row is returned as it is, for the
    contract to refuse."""
    scores: list[Any] = []
    flags: dict[str, list[Any]] = {}
    for out, n in zip(outs, sizes, strict=True):
        got = out.scores if isinstance(out, Scored) else out
        if isinstance(got, Tensor) and got.dim() == 1 and got.numel() == n:
            got = got.tolist()
        if not isinstance(got, (list, tuple)) or len(got) != n:
            return out
        scores.append(list(got))
    for i, out in enumerate(outs):
        if isinstance(out, Scored):
            for name, values in out.flags.items():
                if isinstance(values, Tensor):
                    values = values.tolist()
                flags.setdefault(name, [[False] * m for m in sizes])[i] = list(values)
    joined = [s for piece in scores for s in piece]
    if any(isinstance(out, Scored) for out in outs):
        return Scored(joined, {k: [f for piece in v for f in piece] for k, v in flags.items()})
    if all(isinstance(out, Tensor) for out in outs):
        return torch.tensor(joined, dtype=torch.float32)
    return joined


class CheckedEngine:
    """A rollout engine behind the trainer's boundary: ``generate``, ``sync`` and ``close``
    run under ``rollout.engine_timeout``; whatever a member raises is one line naming the
    slot, the engine, its plugin and the member; ``generate``'s :class:`Generation` is
    checked against the contract (:func:`~ppokit.trainer.contract.check_generation`). The
    optional members get their defaults here."""

    SETTING = "rollout.engine_timeout"

    def __init__(self, where: Where, engine: RolloutEngine, timeout: float | None = None) -> None:
        self.where = where
        self.engine = engine
        self.timeout = timeout
        self.limits = EngineLimits()

    @property
    def samples_from_policy(self) -> bool:
        return bool(getattr(self.engine, "samples_from_policy", False))

    def _call(self, what: str, fn: Callable[..., Any], *args: Any, bounded: bool = True) -> Any:
        timeout = self.timeout if bounded else None
        return call_here(self.where, fn, args, what=what, timeout=timeout, setting=self.SETTING)

    def start(self, context: EngineContext) -> None:
        config = getattr(context.model, "config", None)
        vocab = getattr(config, "vocab_size", None)
        length = getattr(config, "max_position_embeddings", None)
        self.limits = EngineLimits(
            vocab if isinstance(vocab, int) else None, length if isinstance(length, int) else None
        )
        self._call("start", self.engine.start, context, bounded=False)

    def generate(self, prompt_ids: Tensor, prompt_mask: Tensor, sampling: Sampling) -> Generation:
        out = self._call("generate", self.engine.generate, prompt_ids, prompt_mask, sampling)
        return check_generation(self.where, out, prompt_ids, sampling, self.limits)

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
    """An environment behind the trainer's boundary: ``reset`` and ``step`` run in its worker
    process under ``rollout.environment_timeout`` (null: here, unbounded); whatever they
    raise is one line naming the slot, the environment, its plugin and the member; ``reset``
    returns text or None and ``step`` a :class:`~ppokit.environments.Step` (checked: its
    observation text or None, a finite reward, a bool ``done``). What the environment writes
    into an episode's row is in the trainer's row after the call; the optional
    ``state_dict``/``load_state_dict`` carry what it keeps on ``self`` into checkpoints."""

    SETTING = "rollout.environment_timeout"

    def __init__(self, where: Where, environment: Environment, timeout: float | None) -> None:
        self.where = where
        self.environment = environment
        self.timeout = timeout
        self.pool: WorkerPool | None = None
        if timeout is not None and not self.single_turn:
            self.pool = start_pool(where, EnvironmentInWorker(environment), self.SETTING)

    @property
    def single_turn(self) -> bool:
        return bool(optional(self.environment, "environment", "single_turn"))

    @functools.cached_property
    def code(self) -> str | None:
        """Where the environment's code is (:func:`code_of`), read once."""
        return code_of(self.environment)

    def _calls(self, what: str, rows: list[dict[str, Any]], calls: list[Call]) -> list[Any]:
        """The results of ``calls`` of ``what`` (reset or step) on ``rows``, which take in
        what the environment wrote into them."""
        if self.pool is not None:
            code = self.code
            replies = call_in_worker(
                self.where, self.pool, calls, self.timeout, self.SETTING, what, code
            )
        else:
            local = EnvironmentInWorker(self.environment)
            replies = [
                call_here(self.where, getattr(local, what), c.args, what=what) for c in calls
            ]
        out = []
        for row, (value, changed) in zip(rows, replies, strict=True):
            if changed is not row:
                row.clear()
                row.update(changed)
            out.append(value)
        return out

    def resets(self, rows: list[dict[str, Any]]) -> list[str | None]:
        """``reset(row)`` of each episode's row: its opening text or None."""
        out = self._calls("reset", rows, [Call("reset", (row,)) for row in rows])
        for value in out:
            if value is not None and not isinstance(value, str):
                raise ComponentError(
                    f"{self.where} returned {describe(value)} from reset: expected text or None"
                )
        return out

    def steps(self, rows: list[dict[str, Any]], responses: list[str], turn: int) -> list[Any]:
        """``step(row, response, turn)`` of each running episode: its checked Step."""
        calls = [Call("step", (row, text, turn)) for row, text in zip(rows, responses, strict=True)]
        out = self._calls("step", rows, calls)
        return [
            check_step(self.where, step, (row, text, turn), {})
            for step, row, text in zip(out, rows, responses, strict=True)
        ]

    def reset(self, row: dict[str, Any]) -> str | None:
        return self.resets([row])[0]

    def step(self, row: dict[str, Any], response: str, turn: int) -> Any:
        return self.steps([row], [response], turn)[0]

    def state_dict(self) -> Any:
        """What the environment keeps across episodes (its optional ``state_dict()``), or
        None."""
        read = optional(self.environment, "environment", "state_dict")
        if read is None:
            return None
        if self.pool is not None:
            call = [Call("state_dict")]
            return call_in_worker(self.where, self.pool, call, self.timeout, self.SETTING)[0]
        return call_here(self.where, read, what="state_dict")

    def load_state_dict(self, state: Any) -> None:
        """Give a checkpoint's state back to an environment that has ``load_state_dict``."""
        load = optional(self.environment, "environment", "load_state_dict")
        if state is None or load is None:
            return
        if self.pool is not None:
            call = [Call("load_state_dict", (state,))]
            call_in_worker(self.where, self.pool, call, self.timeout, self.SETTING)
            return
        call_here(self.where, load, (state,), what="load_state_dict")

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()

    def __repr__(self) -> str:
        return f"CheckedEnvironment({self.where}: {self.environment!r})"
