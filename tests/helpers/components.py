"""Helpers of the component tests: components built through the registry (which fills in the
defaults of the params model), and the registry's name lists that the generic contract tests
run over, so that a new component enters them without anyone remembering to add it."""

from __future__ import annotations

from typing import Any

import pytest

from ppokit.registry import BUILTIN_PLUGIN, get_registry

__all__ = ["REQUIRED", "builtin_names", "make", "make_any", "names", "required_params"]

#: Values for the parameters without a default, by kind and component name: the generic tests
#: build every registered component with these (and the params model's defaults for the rest).
#: A registered component with a required parameter missing here fails those tests.
REQUIRED: dict[str, dict[str, dict[str, Any]]] = {
    "policy_loss": {"cispo": {"clip_high": 0.2}},
    "truncation": {"soft_overlong": {"max_length": 5, "buffer": 2}},
    "reward": {"regex": {"pattern": r"(\d+)"}},
}


def make(kind: str, name: str, **params: Any) -> Any:
    """The component built by the registry: ``params`` validated, defaults filled in."""
    return get_registry().create(kind, name, **params)


def names(kind: str) -> list[str]:
    """Every registered component of ``kind``, installed plugins included."""
    return get_registry().names(kind)


def builtin_names(kind: str) -> list[str]:
    """The built-in components of ``kind`` (registered by ppokit itself)."""
    return [i.name for i in get_registry().components(kind) if i.plugin == BUILTIN_PLUGIN]


def required_params(kind: str, name: str) -> dict[str, Any]:
    """The values of :data:`REQUIRED` for a component; fails the calling test when one of
    its required parameters has none."""
    info = get_registry().info(kind, name)
    given = REQUIRED.get(kind, {}).get(name, {})
    missing = sorted(
        f for f, field in info.params.model_fields.items() if field.is_required() and f not in given
    )
    if missing:
        pytest.fail(
            f"{kind} {name!r} (plugin {info.plugin}) has required parameters {missing}: "
            "add values for them to REQUIRED in tests/helpers/components.py"
        )
    return dict(given)


def make_any(kind: str, name: str, **params: Any) -> Any:
    """Any registered component, for the generic tests: :data:`REQUIRED` values, then
    ``params``, the defaults for the rest."""
    return make(kind, name, **{**required_params(kind, name), **params})
