"""Conformance properties of a component: what its kind's contract (docs/design.md) says,
checked on one registered component over inputs generated with hypothesis.

For a plugin's own tests::

    from ppokit.testing import assert_conforms

    def test_my_advantage_conforms():
        assert_conforms("advantage", "my_adv", examples=20, scale=2.0)

``check_component(kind, name, params)`` returns one :class:`Result` per property (held,
failed with the smallest counterexample found, in one line, or not applicable);
``check(targets)`` runs a list of ``(kind, name, params)``, what ``ppokit check`` runs.
The properties of each kind (``PROPERTIES``) are listed in docs/plugins.md, "Checking a
component". Kinds whose inputs are a task's own (a reward, an environment, a rollout
engine) are only created from their parameters.

Nothing here imports torch or hypothesis: they are imported when a check runs
(:mod:`ppokit.testing.run`; the inputs are :mod:`ppokit.testing.strategies`, public too).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from ppokit.errors import one_line
from ppokit.registry import Registry, RegistryError, get_registry

__all__ = [
    "DEFAULT_EXAMPLES",
    "LIGHT",
    "Result",
    "Target",
    "assert_conforms",
    "check",
    "check_component",
]

#: Examples hypothesis draws for each property: a component's check takes seconds.
DEFAULT_EXAMPLES = 20

#: The kinds checked only by creating them, and why no generic property applies.
LIGHT: dict[str, str] = {
    "rollout_engine": "an engine needs a model to generate from",
    "environment": "an environment's episodes are its task's own",
    "reward": "a reward's inputs (texts, data columns) are its task's own",
}

#: A component to check: kind, name and its parameters (the defaults for the rest).
Target = tuple[str, str, dict[str, Any]]


@dataclass(frozen=True)
class Result:
    """One property of one component: ``status`` is ``held``, ``failed`` (``detail``: the
    counterexample, one line) or ``not applicable`` (``detail``: why)."""

    kind: str
    name: str
    prop: str
    status: str
    detail: str = ""
    meaning: str = ""

    @property
    def failed(self) -> bool:
        return self.status == "failed"

    def line(self) -> str:
        """``advantage/gae padding: failed: B=1 T=2 mask=[10]: ...``"""
        return f"{self.kind}/{self.name} {self.prop}: {self.status}" + (
            f": {self.detail}" if self.detail else ""
        )


def _missing(registry: Registry, kind: str, name: str, params: dict[str, Any]) -> str | None:
    """Why the component cannot be created here (a package it needs, a parameter without a
    default), or None."""
    info = registry.info(kind, name)
    for module, hint in info.entry.packages:
        if importlib.util.find_spec(module) is None:
            return f"it needs {module} ({hint})"
    try:
        model = info.params
    except Exception as exc:  # an implementation that cannot be imported: created fails
        del exc
        return None
    required = [
        f for f, field in model.model_fields.items() if field.is_required() and f not in params
    ]
    if required:
        given = ",".join(f"{f}=..." for f in required)
        return f"parameters without a default: {', '.join(required)} (give them: {kind}/{name}:{given})"
    return None


def check_component(
    kind: str,
    name: str,
    params: dict[str, Any] | None = None,
    *,
    examples: int = DEFAULT_EXAMPLES,
    registry: Registry | None = None,
) -> list[Result]:
    """Every property of ``kind`` on the registered component ``name`` created with
    ``params`` (its defaults for the rest): created first, then each property."""
    registry = registry or get_registry()
    params = dict(params or {})
    info = registry.info(kind, name)  # a RegistryError, with close names, for an unknown one
    missing = _missing(registry, kind, name, params)
    if missing is not None:
        return [Result(kind, name, "created", "not applicable", missing)]
    try:
        component = registry.create(kind, name, **params)
    except Exception as exc:  # SystemExit and Ctrl-C are the caller's
        why = str(exc) if isinstance(exc, RegistryError) else one_line(exc)
        return [Result(kind, name, "created", "failed", why)]
    results = [Result(kind, name, "created", "held", meaning="created from its parameters")]
    if kind in LIGHT:
        return [*results, Result(kind, name, "properties", "not applicable", LIGHT[kind])]
    from ppokit.testing.run import run_properties

    for prop, meaning, (status, detail) in run_properties(kind, component, info.requires, examples):
        results.append(Result(kind, name, prop, status, detail, meaning))
    return results


def check(
    targets: Iterable[Target], *, examples: int = DEFAULT_EXAMPLES, registry: Registry | None = None
) -> Iterator[Result]:
    """The results of every target, in order: what ``ppokit check`` prints (a variant's
    components are such a list too)."""
    for kind, name, params in targets:
        yield from check_component(kind, name, params, examples=examples, registry=registry)


def assert_conforms(
    kind: str,
    name: str,
    *,
    examples: int = DEFAULT_EXAMPLES,
    registry: Registry | None = None,
    **params: Any,
) -> None:
    """For a plugin's tests: an ``AssertionError`` listing each property that failed, with
    its counterexample (``registry``: where the component is registered; the process's
    registry of installed plugins by default)."""
    results = check_component(kind, name, params, examples=examples, registry=registry)
    failed = [r.line() for r in results if r.failed]
    if failed:
        raise AssertionError("\n".join(failed))
