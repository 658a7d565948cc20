"""A component's catalogue entry: everything known about it before its tensor code is imported.

One :class:`Component` states each fact once: kind, name, where the implementation lives
(``"module:attr"``, imported only when the component is created), the params model (defaults
and bounds), ``requires``, summary, formula and paper. The registry, ``ppokit show``,
``explain``, the JSON Schema and the generated docs read them from here; the implementation's
docstring is written from them too (:meth:`Component.implementation`).

Built-ins and plugins use the same shape: a torch-free module of entries, registered in
``ppokit_register`` with ``register(entry)``, and a tensor module whose classes take the
parameters as keyword arguments without defaults.

Nothing here imports torch.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict

__all__ = ["Component", "NoParams", "Params"]

T = TypeVar("T")


class Params(BaseModel):
    """Parameters of a component: validated, immutable, no unknown keys."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class NoParams(Params):
    """A component without parameters."""


@dataclass(frozen=True)
class Component:
    """The catalogue entry of one component.

    ``factory`` is the implementation (a class or function called with the validated
    parameters as keywords) or a lazy ``"module:attr"`` string. ``params`` is its pydantic
    model; without one, the factory's signature defines the parameters.
    """

    kind: str
    name: str
    factory: Any
    params: type[BaseModel] | None = None
    summary: str = ""
    formula: str = ""
    source: str = ""
    requires: tuple[str, ...] = field(default=())

    def implementation(self, obj: T) -> T:
        """Decorator of the implementation: its docstring becomes the entry's summary, formula
        and source, followed by the implementation's own notes (which state neither)."""
        notes = inspect.cleandoc(obj.__doc__ or "")
        obj.__doc__ = self.docstring() + (f"\n\n{notes}" if notes else "")
        obj.component = self  # type: ignore[attr-defined]
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
