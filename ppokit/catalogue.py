"""The catalogue entries: a component's, and a variant's and a task's, everything known about
each before any tensor code is imported.

One :class:`Component` states each fact once: kind, name, the module its implementation lives
in (imported only when the component is created), the params model (defaults and bounds),
``requires``, summary, formula, paper and the metrics it reports. The registry, ``ppokit show``, ``explain``, the JSON
Schema and the generated docs read them from here. The implementation names its entry, not
the other way round: ``@ENTRY.implementation`` on the class or function records it as the
entry's implementation (:func:`implementation_of`) and writes its docstring from the entry.

Built-ins and plugins use the same shape: a torch-free module of entries, registered in
``ppokit_register`` with ``register(entry)``, and a tensor module whose classes take the
parameters as keyword arguments without defaults.

A :class:`Variant` (a paper method: the part of a spec its paper sets) and a :class:`Task`
(prompts, reward, held-out split, the generation length it needs) are registered through the
same ``register(entry)`` as components; a spec names them (``variant: dapo``, ``task: demo``)
and sets only what differs (``ppokit.spec.compose``).

Nothing here imports torch.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ppokit.metrics_table import Metric

__all__ = [
    "LOG_RATIO_BOUND",
    "TASK_SECTIONS",
    "VARIANT_REFUSED",
    "Component",
    "Contract",
    "Gamma",
    "NoParams",
    "Params",
    "Task",
    "Variant",
    "implementation_of",
]

T = TypeVar("T")

#: Bound on log-ratios before exponentiation (exp(20) ~ 5e8 stays finite in float32): the
#: tensor code clamps with it (``ppokit.ops.LOG_RATIO_BOUND``) and the formulas state it.
LOG_RATIO_BOUND = 20.0

#: The implementation each entry's decorator recorded, by the entry's id (with the entry,
#: which keeps the id from being reused).
_IMPLEMENTED: dict[int, tuple[Component, Any]] = {}


def implementation_of(entry: Component) -> Any:
    """What ``@entry.implementation`` decorated (None while its module is not imported)."""
    found = _IMPLEMENTED.get(id(entry))
    return found[1] if found is not None and found[0] is entry else None


class Params(BaseModel):
    """Parameters of a component: validated, immutable, no unknown keys."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class NoParams(Params):
    """A component without parameters."""


class Bounds(Params):
    """Parameters with an interval ``[low, high]``: refused when ``low > high``. A subclass
    declares ``low`` and ``high`` with its own defaults and bounds."""

    low: float
    high: float

    @model_validator(mode="after")
    def _ordered(self) -> Bounds:
        if self.low > self.high:
            raise ValueError(f"low must not exceed high, got low={self.low}, high={self.high}")
        return self


class Gamma(Params):
    """The discount factor γ, shared by every params model that discounts (subclass it)."""

    gamma: float = Field(default=1.0, ge=0.0, le=1.0, description="discount factor gamma in [0, 1]")


@dataclass(frozen=True)
class Contract:
    """A kind's contract, stated beside its Protocol (``CONTRACT`` of each kind package).

    ``returns`` names the check the trainer applies to the return value where it crosses
    into the trainer (``ppokit/trainer/assembly.py`` holds the tensor code of each check):
    ``scores`` (one number per response), ``batch`` (a RolloutBatch), ``estimate`` (float
    [B, T] without grad), ``position_mask`` (float or bool [B, T]), ``prompt_weight`` (float
    [B]), ``elementwise`` (float, shaped like the argument ``like`` and differentiable in
    ``differentiable``), ``scalar`` (a 0-d float). ``optional`` lists the members the trainer
    reads when a component has them, and what each gives; the trainer reads no other.
    """

    returns: str
    like: tuple[int, str] | None = None
    differentiable: str = ""
    optional: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Component:
    """The catalogue entry of one component.

    ``factory`` is the implementation (a class or function called with the validated
    parameters as keywords) or, lazily, the name of the module that holds it: the module is
    imported when the component is created, and the implementation is the object in it
    decorated with ``@entry.implementation``. ``params`` is its pydantic model; without one,
    the factory's signature defines the parameters.
    """

    kind: str
    name: str
    factory: Any
    params: type[BaseModel] | None = None
    summary: str = ""
    formula: str = ""
    source: str = ""
    requires: tuple[str, ...] = field(default=())
    #: the diagnostics its optional ``metrics(batch, out)`` member reports each round
    metrics: tuple[Metric, ...] = field(default=())
    #: (import name, how to install it) of each package it needs beyond ppokit's own: a
    #: spec naming it is refused at validation while one is missing
    packages: tuple[tuple[str, str], ...] = field(default=())
    #: ``check(spec, params)``: the ``path: message`` lines of what a run would refuse
    #: about this component in ``spec`` (``params``: its validated parameters), found at
    #: validation, without heavy imports; called once its parameters and packages pass
    #: (``spec`` is a :class:`ppokit.spec.Spec`: the catalogue sits below the spec's models)
    check: Callable[[Any, Any], Iterable[str]] | None = None
    #: the parameter whose value makes ppokit run code or contact a server the spec names (a
    #: python reward's ``function``, an http reward's ``url``): a run folder's spec that
    #: names such a component is refused by ``eval`` and ``export`` without
    #: ``--trust-remote-code`` ("" for none)
    consent: str = ""

    def implementation(self, obj: T) -> T:
        """Decorator of the implementation: records ``obj`` as this entry's implementation
        (what the registry creates when ``factory`` names ``obj``'s module); its docstring
        becomes the entry's summary, formula and source, followed by the implementation's own
        notes (which state neither)."""
        notes = inspect.cleandoc(obj.__doc__ or "")
        obj.__doc__ = self.docstring() + (f"\n\n{notes}" if notes else "")
        obj.component = self  # type: ignore[attr-defined]
        _IMPLEMENTED[id(self)] = (self, obj)
        return obj

    def docstring(self) -> str:
        parts = [
            self.summary.rstrip(".") + "." if self.summary else f"The {self.name} {self.kind}."
        ]
        if self.formula:
            parts.append(self.formula)
        if self.source:
            parts.append(f"Source: {self.source}")
        return "\n\n".join(parts)


#: What a variant leaves to the task, the model and the run (a spec path, or a section):
#: a variant that sets one of them is refused when it is registered.
VARIANT_REFUSED: tuple[str, ...] = (
    "seed",
    "variant",
    "task",
    "data",
    "reward",
    "eval",
    "output",
    "health",
    "model.actor",
    "model.tiny",
    "model.lora",
    "model.device",
    "rollout.max_new_tokens",
)
#: The sections a task may set: its prompts, reward(s), held-out split, generation length
#: (and environment) and the health signs its answers make meaningless.
TASK_SECTIONS: tuple[str, ...] = ("data", "reward", "eval", "rollout", "health")


def _settings_problem(settings: Any, refused: Iterable[str], allowed: Iterable[str] = ()) -> str:
    """Why ``settings`` is not a spec fragment this entry may set ("" if it is)."""
    if not isinstance(settings, Mapping) or not all(isinstance(k, str) for k in settings):
        return f"settings must be a mapping of spec sections, got {type(settings).__name__}"
    allowed = tuple(allowed)
    for key in settings:
        if allowed and key not in allowed:
            return f"settings set {key!r}: a task sets only " + ", ".join(allowed)
    for path in refused:
        head, _, rest = path.partition(".")
        section = settings.get(head) if rest else None
        if (not rest and head in settings) or (isinstance(section, Mapping) and rest in section):
            return f"settings set {path!r}, which the task, the model or the run sets"
    return ""


@dataclass(frozen=True)
class Variant:
    """The catalogue entry of a variant: a paper method, as the part of a spec it sets.

    ``settings`` is a spec fragment (the algorithm's slots and sections: advantage, critic,
    policy, kl, truncation, the rollout settings the method defines such as ``n`` and
    ``filter``, and the training settings its paper prescribes), merged under the task and
    the spec file; a value may be ``${path}``, read from the merged spec (``${rollout.
    max_new_tokens}``, with ``+ - * //`` and numbers). ``base`` names a variant this one
    extends: its settings are merged over the base's. ``papers`` are :class:`ppokit.papers.
    Paper` objects (or text); ``choices`` says what the method chooses and ``scaled`` what
    it scales down from its paper and why.
    """

    name: str
    title: str
    settings: Mapping[str, Any]
    papers: tuple[Any, ...] = ()
    choices: str = ""
    scaled: str = ""
    base: str = ""

    def problem(self) -> str:
        """Why this entry cannot be registered ("" if it can)."""
        return _settings_problem(self.settings, VARIANT_REFUSED)


@dataclass(frozen=True)
class Task:
    """The catalogue entry of a task: where its prompts come from, how an answer is scored,
    its held-out split and the generation length it needs, as a spec fragment (``data``,
    ``reward``, ``eval``, ``rollout``: ``max_new_tokens`` and an environment's settings, and
    ``health``: a sign its answers make meaningless). ``about`` describes the prompts and the
    answer format; ``source`` cites where the task comes from."""

    name: str
    title: str
    settings: Mapping[str, Any]
    about: str = ""
    source: str = ""

    def problem(self) -> str:
        """Why this entry cannot be registered ("" if it can)."""
        return _settings_problem(self.settings, (), TASK_SECTIONS)
