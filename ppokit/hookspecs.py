"""Hook specifications of the ``ppokit`` plugin system. Specs only: implementations live in
plugins, the built-in components included (``ppokit.builtins``)."""

from __future__ import annotations

from typing import Protocol

import pluggy

hookspec = pluggy.HookspecMarker("ppokit")
hookimpl = pluggy.HookimplMarker("ppokit")


class Register(Protocol):
    """The callable handed to :func:`ppokit_register`.

    ``register(kind, name, factory, *, params=None, summary="", requires=(), formula="",
    source="")`` adds one component. ``factory`` is a class, a function, or a
    ``"module:attr"`` string imported only when the component is created.
    """

    def __call__(self, kind: str, name: str, factory: object, **options: object) -> None: ...


@hookspec
def ppokit_register(register: Register) -> None:
    """Register components: call ``register(kind, name, factory, ...)`` once per component."""
