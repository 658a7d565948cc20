"""Hook specifications of the ``ppokit`` plugin system. Specs only: implementations live in
plugins, the built-in components included (``ppokit.components``)."""

from __future__ import annotations

from typing import Protocol

import pluggy

hookspec = pluggy.HookspecMarker("ppokit")
hookimpl = pluggy.HookimplMarker("ppokit")


class Register(Protocol):
    """The callable handed to :func:`ppokit_register`.

    ``register(entry)`` adds one component, an :class:`ppokit.catalogue.Component` (kind,
    name, factory, params, summary, formula, source, requires). ``register(kind, name,
    factory, **facts)`` builds the same entry from its fields.
    """

    def __call__(self, entry: object, *args: object, **facts: object) -> None: ...


@hookspec
def ppokit_register(register: Register) -> None:
    """Register components: call ``register(kind, name, factory, ...)`` once per component."""
