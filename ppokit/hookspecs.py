"""Hook specifications of the ``ppokit`` plugin system. Specs only: implementations live in
plugins, the built-in components included (``ppokit.components``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import pluggy

if TYPE_CHECKING:
    from ppokit.catalogue import Component

hookspec = pluggy.HookspecMarker("ppokit")
hookimpl = pluggy.HookimplMarker("ppokit")


class Register(Protocol):
    """The callable handed to :func:`ppokit_register`.

    ``register(entry)`` adds one component, an :class:`ppokit.catalogue.Component` (kind,
    name, factory, params, summary, formula, source, requires): the one registration form.
    """

    def __call__(self, entry: Component) -> None: ...


@hookspec
def ppokit_register(register: Register) -> None:
    """Register components: call ``register(entry)`` once per component entry."""
