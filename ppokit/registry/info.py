"""One registered component: its catalogue entry, the plugin that registered it, and its
implementation, imported on first use."""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from pydantic import BaseModel, ConfigDict, create_model

from ppokit.catalogue import Component, implementation_of
from ppokit.errors import one_line, printable
from ppokit.registry.errors import RegistryError
from ppokit.registry.guards import PLUGIN_ERRORS, guarded

#: A lazy factory: the dotted name of the module that holds the implementation (the object
#: in it decorated with ``@entry.implementation``).
LAZY_FACTORY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def params_from_signature(name: str, factory: Callable[..., Any]) -> type[BaseModel]:
    """A pydantic model whose fields are the keyword parameters of ``factory`` (an entry
    without a params model)."""
    fields: dict[str, Any] = {}
    for p in inspect.signature(factory).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.name == "self":
            continue
        annotation = Any if p.annotation is inspect.Parameter.empty else p.annotation
        default = ... if p.default is inspect.Parameter.empty else p.default
        fields[p.name] = (annotation, default)
    model_name = "".join(part.title() for part in name.split("_")) + "Params"
    return create_model(model_name, __config__=ConfigDict(extra="forbid"), **fields)


@dataclass
class ComponentInfo:
    """One registered component: its catalogue entry, the plugin (and version) that
    registered it, and its implementation once imported. Every fact is the entry's, read
    from it; the texts a plugin wrote are shown with control characters escaped."""

    entry: Component
    plugin: str
    version: str | None = None

    @property
    def kind(self) -> str:
        return self.entry.kind

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def summary(self) -> str:
        return printable(str(self.entry.summary))

    @property
    def formula(self) -> str:
        return printable(str(self.entry.formula))

    @property
    def source(self) -> str:
        return printable(str(self.entry.source))

    @property
    def requires(self) -> tuple[str, ...]:
        return tuple(self.entry.requires)

    @property
    def lazy(self) -> bool:
        """Whether the implementation is imported on first use (the entry names its module)."""
        return isinstance(self.entry.factory, str)

    @cached_property
    def implementation(self) -> Callable[..., Any]:
        """The class or function the entry creates: the factory itself, or, for a lazy one,
        the object its module's ``@entry.implementation`` recorded (the module imported
        under :func:`~ppokit.registry.guards.guarded` on first use)."""
        factory = self.entry.factory
        if not isinstance(factory, str):
            return factory
        who = f"{self.kind} {self.name!r} (plugin {self.plugin})"
        try:
            with guarded():
                importlib.import_module(factory)
        except PLUGIN_ERRORS as exc:
            raise RegistryError(f"{who} cannot be imported: {one_line(exc)}") from exc
        found = implementation_of(self.entry)
        if found is None:
            raise RegistryError(
                f"{who} cannot be imported: module {factory!r} marks no "
                "implementation of it (decorate it with @ENTRY.implementation)"
            )
        return found

    def load(self) -> Callable[..., Any]:
        """:attr:`implementation` (a ``RegistryError`` where it cannot be imported)."""
        return self.implementation

    @cached_property
    def params(self) -> type[BaseModel]:
        """The entry's params model, or one read from the implementation's signature."""
        if self.entry.params is not None:
            return self.entry.params
        return params_from_signature(self.name, self.load())

    def defaults(self) -> dict[str, Any]:
        out = {}
        for fname, f in self.params.model_fields.items():
            if not f.is_required():
                out[fname] = f.get_default(call_default_factory=True)
        return out

    def schema(self) -> dict[str, Any]:
        return self.params.model_json_schema()

    def validate(self, params: dict[str, Any]) -> BaseModel:
        return self.params.model_validate(params)

    def as_dict(self) -> dict[str, Any]:
        """Everything known, JSON-ready; a factory that cannot be imported gives ``error``."""
        out: dict[str, Any] = {
            "kind": self.kind,
            "name": self.name,
            "plugin": self.plugin,
            "version": self.version,
            "summary": self.summary,
            "formula": self.formula,
            "requires": list(self.requires),
            "source": self.source,
        }
        try:
            out.update(defaults=self.defaults(), params=self.schema())
        except RegistryError as exc:
            out.update(defaults=None, params=None, error=str(exc))
        return out
