"""Hook specifications of the ``ppokit`` plugin system. Specs only: implementations live in
plugins, the built-in components included (``ppokit.components``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import pluggy

if TYPE_CHECKING:
    from ppokit.catalogue import Component, Task, Variant

hookspec = pluggy.HookspecMarker("ppokit")
hookimpl = pluggy.HookimplMarker("ppokit")


class Register(Protocol):
    """The callable handed to :func:`ppokit_register`.

    ``register(entry)`` adds one component, an :class:`ppokit.catalogue.Component` (kind,
    name, factory, params, summary, formula, source, requires), one variant, a
    :class:`ppokit.catalogue.Variant` (a paper method: the part of a spec it sets), or one
    task, a :class:`ppokit.catalogue.Task` (prompts, reward, held-out split): the one
    registration form.
    """

    def __call__(self, entry: Component | Variant | Task) -> None: ...


@hookspec
def ppokit_register(register: Register) -> None:
    """Register components, variants and tasks: call ``register(entry)`` once per entry."""
