"""Every registered component's implementation agrees with its catalogue entry.

The params model states the parameters once (names, defaults, bounds): the implementation
takes exactly those names. A built-in takes them keyword-only and without defaults (the
registry fills them in from the model); a plugin's own defaults, where it has them, equal
the model's. A built-in's docstring is written from its entry (summary, formula, source),
and ``requires`` lives in the entry only.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest

from ppokit.registry import BUILTIN_PLUGIN, KINDS, ComponentInfo, build_registry
from tests.helpers.components import REQUIRED

#: A registry of its own: loading the factories leaves the process-wide one as it was.
REGISTRY = build_registry()
ALL = REGISTRY.components()
BUILTINS = [info for info in ALL if info.plugin == BUILTIN_PLUGIN]


def _id(info: ComponentInfo) -> str:
    return f"{info.kind}:{info.name}"


def parameters(factory: Callable[..., Any]) -> dict[str, inspect.Parameter]:
    """The named parameters the factory is called with (``self``, ``*args`` and
    ``**kwargs`` left out): ``__init__``'s for a class, the signature of a function."""
    target = factory.__init__ if inspect.isclass(factory) else factory
    params = inspect.signature(target).parameters.values()
    if inspect.isclass(factory):
        params = list(params)[1:]  # self
    return {p.name: p for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}


def test_every_kind_has_builtins():
    for kind in KINDS:
        assert any(info.kind == kind for info in BUILTINS), kind


@pytest.mark.parametrize("info", ALL, ids=_id)
def test_the_signature_takes_the_params_model_fields(info: ComponentInfo):
    factory = info.load()
    names = set(parameters(factory))
    fields = set(info.params.model_fields)
    assert names == fields, (
        f"{_id(info)} ({info.plugin}): the implementation takes {sorted(names)}, "
        f"the params model has {sorted(fields)}"
    )


@pytest.mark.parametrize("info", ALL, ids=_id)
def test_defaults_live_in_the_params_model(info: ComponentInfo):
    """A built-in takes its parameters keyword-only and without defaults; a plugin's own
    defaults, where it has them, equal the params model's."""
    fields = info.params.model_fields
    for p in parameters(info.load()).values():
        if info.plugin == BUILTIN_PLUGIN:
            assert p.kind is p.KEYWORD_ONLY, f"{_id(info)}: {p.name} is not keyword-only"
            assert p.default is p.empty, (
                f"{_id(info)}: {p.name} has a default ({p.default!r}); "
                "defaults belong to the params model"
            )
        elif p.default is not p.empty and p.name in fields:
            field = fields[p.name]
            assert not field.is_required(), f"{_id(info)}: {p.name} is required by the model"
            assert p.default == field.get_default(call_default_factory=True), (
                f"{_id(info)} ({info.plugin}): {p.name} defaults to {p.default!r} in the "
                f"implementation, {field.get_default()!r} in the params model"
            )


@pytest.mark.parametrize("info", BUILTINS, ids=_id)
def test_builtin_docstrings_are_written_from_the_entry(info: ComponentInfo):
    factory = info.load()
    doc = factory.__doc__ or ""
    assert info.formula, f"{_id(info)} has no formula"
    assert info.source, f"{_id(info)} has no source"
    assert info.formula in doc
    assert info.source in doc
    assert info.summary.rstrip(".") in doc
    entry = factory.component  # set by Component.implementation
    assert (entry.kind, entry.name) == (info.kind, info.name)


@pytest.mark.parametrize("info", BUILTINS, ids=_id)
def test_builtins_state_requires_in_the_entry_only(info: ComponentInfo):
    factory = info.load()
    assert not hasattr(factory, "requires"), (
        f"{_id(info)}: the implementation has a 'requires' attribute; it belongs to the "
        "catalogue entry"
    )
    assert info.requires == factory.component.requires


def test_required_values_name_registered_components_and_required_params():
    """The generic tests' values for required parameters (tests/helpers/components.py REQUIRED) are
    not stale: each names a registered component and one of its required parameters."""
    for kind, by_name in REQUIRED.items():
        for name, values in by_name.items():
            fields = REGISTRY.info(kind, name).params.model_fields
            for field in values:
                assert field in fields and fields[field].is_required(), (kind, name, field)
