"""The registry: components by kind and name, as the loaded plugins registered them."""

from __future__ import annotations

import traceback
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint, PackageNotFoundError, distribution, entry_points
from typing import Any

import pluggy
from pydantic import BaseModel, ValidationError

from ppokit import hookspecs
from ppokit.bounded import TimedOut, deadline
from ppokit.catalogue import Component, Task, Variant
from ppokit.errors import one_line, printable
from ppokit.metrics_table import declare
from ppokit.registry.errors import (
    PLUGIN_NAME,
    RegistryError,
    format_validation_error,
    name_problem,
    suggest,
)
from ppokit.registry.guards import PLUGIN_ERRORS, guarded
from ppokit.registry.info import LAZY_FACTORY, ComponentInfo
from ppokit.registry.switches import plugin_import_timeout
from ppokit.slots import FIELDS, KINDS

#: Batch fields a component may require: the optional fields of a RolloutBatch.
REQUIREMENTS: tuple[str, ...] = tuple(f.name for f in FIELDS)

BUILTIN_PLUGIN = "ppokit"

#: Components of the plugins published with ppokit (in its ``plugins/`` folder), so that a
#: spec naming one without the plugin installed is told what to install (a test keeps this
#: table equal to what those plugins register).
KNOWN_PLUGINS: dict[tuple[str, str], str] = {
    ("regression_loss", "hlgauss"): "ppokit-hlgauss",
    ("advantage", "lite_ppo"): "ppokit-example",
    ("variant", "ppo_hlgauss"): "ppokit-hlgauss",
}
ENTRY_POINT_GROUP = "ppokit"


def _check_unique(infos: list[ComponentInfo | EntryInfo]) -> None:
    """A plugin may register each (kind, name) once, and each variant and task name once."""
    seen: set[tuple[str, str]] = set()
    for info in infos:
        key = (
            (_word(info.entry), info.name)
            if isinstance(info, EntryInfo)
            else (info.kind, info.name)
        )
        if key in seen:
            raise RegistryError(f"{key[0]} {info.name!r} is registered twice by this plugin")
        seen.add(key)


def _normalise(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


#: The entries that are not components, by the word the registry and the CLI use for them.
NAMED_ENTRIES: dict[str, type[Variant] | type[Task]] = {"variant": Variant, "task": Task}


@dataclass(frozen=True)
class EntryInfo:
    """A registered variant or task: its catalogue entry and the plugin that registered it."""

    entry: Variant | Task
    plugin: str
    version: str | None = None

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def title(self) -> str:
        return printable(self.entry.title)


@dataclass
class PluginRecord:
    """A plugin that was loaded (or failed to load)."""

    name: str
    distribution: str | None = None
    version: str | None = None
    components: list[tuple[str, str]] = field(default_factory=list)
    error: str | None = None
    traceback: str | None = None
    #: the variants and tasks it registered, as ("variant" | "task", name)
    entries: list[tuple[str, str]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.error is None


class Registry:
    """Components by kind and name, as registered by the loaded plugins."""

    def __init__(self) -> None:
        self._components: dict[tuple[str, str], ComponentInfo] = {}
        self._entries: dict[tuple[str, str], EntryInfo] = {}
        self._conflicts: dict[tuple[str, str], list[str]] = {}
        self.plugins: dict[str, PluginRecord] = {}
        self.pm = pluggy.PluginManager("ppokit")
        self.pm.add_hookspecs(hookspecs)

    # ---------------------------------------------------------------- loading
    def load_plugin(
        self,
        name: str,
        plugin: object,
        *,
        distribution: str | None = None,
        version: str | None = None,
        timeout: float | None = None,
    ) -> PluginRecord:
        """Register one plugin object (module) and run its ``ppokit_register`` hook (under
        :func:`guarded`, for at most ``timeout`` seconds when given: :func:`deadline`).

        Its registrations are committed only if the whole hook succeeds.
        """
        record = PluginRecord(name, distribution, version)
        self.plugins[name] = record
        try:
            with guarded(), deadline(timeout, f"plugin {name}'s ppokit_register hook"):
                pending = self._run_hook(name, plugin, version)
        except PLUGIN_ERRORS as exc:  # one broken plugin never breaks the others
            record.error = (
                f"its ppokit_register hook did not return within {timeout:g} s "
                "(PPOKIT_PLUGIN_IMPORT_TIMEOUT)"
                if isinstance(exc, TimedOut) and timeout is not None
                else one_line(exc)
            )
            record.traceback = traceback.format_exc()
            if self.pm.get_plugin(name) is plugin:
                self.pm.unregister(name=name)
            return record
        for info in pending:
            self._add(info, record)
        return record

    def _run_hook(
        self, name: str, plugin: object, version: str | None
    ) -> list[ComponentInfo | EntryInfo]:
        """The components a plugin's ``ppokit_register`` hook registers (not yet added)."""
        self.pm.register(plugin, name=name)
        for caller in self.pm.get_hookcallers(plugin) or []:
            if not caller.has_spec():
                raise RegistryError(
                    f"unknown hook {caller.name!r}{suggest(caller.name, ['ppokit_register'])}"
                )
        impls = [
            impl
            for impl in self.pm.hook.ppokit_register.get_hookimpls()
            if impl.plugin_name == name
        ]
        pending: list[ComponentInfo | EntryInfo] = []

        def register(entry: Component | Variant | Task, *args: Any, **facts: Any) -> None:
            if not isinstance(entry, (Component, Variant, Task)) or args or facts:
                raise RegistryError(
                    "register(entry) takes one ppokit.Component, ppokit.Variant or ppokit.Task, "
                    f"got {type(entry).__name__}" + (" and more arguments" if args or facts else "")
                )
            if isinstance(entry, Component):
                pending.append(self._make_info(entry, name, version))
            else:
                pending.append(_entry_info(entry, name, version))

        for impl in impls:
            impl.function(*(register for _ in impl.argnames))
        _check_unique(pending)
        return pending

    def _make_info(self, entry: Component, plugin: str, version: str | None) -> ComponentInfo:
        kind, name, factory, params = entry.kind, entry.name, entry.factory, entry.params
        if kind not in KINDS:
            raise RegistryError(f"unknown component kind {kind!r}{suggest(kind, KINDS)}")
        problem = name_problem(name)
        if problem is not None:
            raise RegistryError(problem)
        if not (callable(factory) or isinstance(factory, str)):
            raise RegistryError(f"{kind} {name!r}: factory must be callable or a module name")
        if isinstance(factory, str) and not LAZY_FACTORY.fullmatch(factory):
            raise RegistryError(f"{kind} {name!r}: factory {factory!r} is not a module name")
        if params is not None and not (isinstance(params, type) and issubclass(params, BaseModel)):
            raise RegistryError(f"{kind} {name!r}: params must be a pydantic model class")
        for r in entry.requires:
            if r not in REQUIREMENTS:
                raise RegistryError(
                    f"{kind} {name!r} requires unknown batch field {r!r}{suggest(r, REQUIREMENTS)}"
                )
        declare(entry.metrics)
        return ComponentInfo(entry, plugin, version)

    def _add(self, info: ComponentInfo | EntryInfo, record: PluginRecord) -> None:
        store: dict[tuple[str, str], Any]
        if isinstance(info, EntryInfo):
            key, store = (_word(info.entry), info.name), self._entries
            record.entries.append(key)
        else:
            key, store = (info.kind, info.name), self._components
            record.components.append(key)
        if key in self._conflicts:
            self._conflicts[key].append(info.plugin)
            return
        existing = store.get(key)
        if existing is not None:
            self._conflicts[key] = [existing.plugin, info.plugin]
            del store[key]
            return
        store[key] = info  # type: ignore[assignment]

    def load_entry_points(self, only: set[str] | None = None) -> None:
        """Load installed plugins of the ``ppokit`` entry-point group (``only``: by name).

        Each plugin is imported and its hook run for at most :func:`plugin_import_timeout`
        seconds (:func:`ppokit.bounded.deadline`: interrupted at the bound; one that holds
        the interpreter in C code past it ends the process), under :func:`guarded`: a plugin
        that hangs, exits or prints is recorded as failed and the others load. A name in ``only`` that
        matches no installed plugin is recorded as a failed plugin.
        """
        timeout = plugin_import_timeout()
        wanted = None if only is None else {_normalise(o): o for o in only}
        matched: set[str] = set()
        for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
            dist = getattr(ep, "dist", None)
            dist_name = printable(dist.metadata["Name"]) if dist is not None else None
            if wanted is not None:
                names = {_normalise(ep.name), _normalise(dist_name or "")} & set(wanted)
                if not names:
                    continue
                matched |= names
            version = printable(dist.version) if dist is not None else None
            name = ep.name
            problem = name_problem(name, "plugin name", PLUGIN_NAME)
            if problem is not None:
                name = ascii(name)[1:-1]
            if name in self.plugins:  # two distributions use the same entry-point name
                name = f"{dist_name}:{name}"
            if problem is not None:
                self.plugins[name] = PluginRecord(name, dist_name, version, error=problem)
                continue
            self._load_entry_point(ep, name, dist_name, version, timeout)
        for key, original in (wanted or {}).items():
            if key not in matched and key != _normalise(BUILTIN_PLUGIN):
                installed = sorted(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP))
                self.plugins[original] = PluginRecord(
                    original,
                    error="PPOKIT_LOAD_PLUGINS names no installed plugin "
                    f"{original!r}{suggest(original, installed)}",
                )

    def _load_entry_point(
        self, ep: EntryPoint, name: str, dist_name: str | None, version: str | None, timeout: float
    ) -> None:
        """Import one installed plugin (bounded and guarded), then run its hook."""
        try:
            with guarded(), deadline(timeout, f"plugin {name}'s import"):
                module = ep.load()
        except PLUGIN_ERRORS as exc:
            error = (
                f"its import did not finish within {timeout:g} s (PPOKIT_PLUGIN_IMPORT_TIMEOUT)"
                if isinstance(exc, TimedOut)
                else one_line(exc)
            )
            record = PluginRecord(name, dist_name, version, error=error)
            record.traceback = traceback.format_exc()
            self.plugins[name] = record
            return
        self.load_plugin(name, module, distribution=dist_name, version=version, timeout=timeout)

    def conflict_errors(self) -> list[str]:
        return [
            f"{kind} {name!r} is registered by more than one plugin: " + ", ".join(plugins)
            for (kind, name), plugins in sorted(self._conflicts.items())
        ]

    @property
    def failed(self) -> list[PluginRecord]:
        return [p for p in self.plugins.values() if not p.ok]

    # ---------------------------------------------------------------- lookup
    def kinds(self) -> tuple[str, ...]:
        return KINDS

    def names(self, kind: str) -> list[str]:
        self._check_kind(kind)
        return sorted(n for (k, n) in self._components if k == kind)

    def components(self, kind: str | None = None) -> list[ComponentInfo]:
        if kind is not None:
            self._check_kind(kind)
        return [
            self._components[key]
            for key in sorted(self._components, key=lambda kn: (KINDS.index(kn[0]), kn[1]))
            if kind is None or key[0] == kind
        ]

    def _check_kind(self, kind: str) -> None:
        if kind not in KINDS:
            raise RegistryError(f"unknown component kind {kind!r}{suggest(kind, KINDS)}")

    def has(self, kind: str, name: str) -> bool:
        return (kind, name) in self._components

    def info(self, kind: str, name: str) -> ComponentInfo:
        self._check_kind(kind)
        key = (kind, name)
        if key in self._conflicts:
            raise RegistryError(
                f"{kind} {name!r} is registered by more than one plugin ("
                + ", ".join(self._conflicts[key])
                + "); uninstall one or choose with PPOKIT_LOAD_PLUGINS"
            )
        try:
            return self._components[key]
        except KeyError:
            dist = KNOWN_PLUGINS.get(key)
            if dist is not None:
                raise RegistryError(
                    f"unknown {kind} {name!r}: {_known_plugin_hint(dist)}"
                ) from None
            raise RegistryError(
                f"unknown {kind} {name!r}{suggest(str(name), self.names(kind))}"
            ) from None

    # ------------------------------------------------------- variants and tasks
    def entries(self, word: str) -> list[EntryInfo]:
        """The registered variants (``word='variant'``) or tasks (``'task'``), in the order
        they were registered (the built-ins first)."""
        return [info for key, info in self._entries.items() if key[0] == word]

    def has_entry(self, word: str, name: str) -> bool:
        return (word, name) in self._entries

    def entry(self, word: str, name: str) -> EntryInfo:
        """The variant or task ``name``; RegistryError (one line, close names) if none or
        if several plugins register it."""
        key = (word, name)
        if key in self._conflicts:
            raise RegistryError(
                f"{word} {name!r} is registered by more than one plugin ("
                + ", ".join(self._conflicts[key])
                + "); uninstall one or choose with PPOKIT_LOAD_PLUGINS"
            )
        if key not in self._entries:
            dist = KNOWN_PLUGINS.get(key)
            if dist is not None:
                raise RegistryError(f"unknown {word} {name!r}: {_known_plugin_hint(dist)}")
            names = [n for w, n in self._entries if w == word]
            raise RegistryError(f"unknown {word} {name!r}{suggest(str(name), names)}")
        return self._entries[key]

    def create(self, kind: str, name: str, **params: Any) -> Any:
        """Build a component from validated parameters."""
        info = self.info(kind, name)
        try:
            model = info.validate(params)
        except ValidationError as err:
            raise RegistryError(
                f"{kind} {name!r}: " + "; ".join(format_validation_error(err))
            ) from None
        values = {k: getattr(model, k) for k in type(model).model_fields}
        component = info.load()(**values)
        return component


def _word(entry: Variant | Task) -> str:
    return "variant" if isinstance(entry, Variant) else "task"


def _entry_info(entry: Variant | Task, plugin: str, version: str | None) -> EntryInfo:
    """A variant's or task's registration, checked: its name, its base's, its settings."""
    word = _word(entry)
    problem = name_problem(entry.name, f"{word} name")
    if problem is None and isinstance(entry, Variant) and entry.base:
        problem = name_problem(entry.base, "base variant name")
    if problem is None and entry.problem():
        problem = f"{word} {entry.name!r}: {entry.problem()}"
    if problem is not None:
        raise RegistryError(problem)
    return EntryInfo(entry, plugin, version)


def _known_plugin_hint(dist: str) -> str:
    """What to do about a component of the published plugin ``dist`` that is not registered."""
    try:
        distribution(dist)
    except PackageNotFoundError:
        return (
            f"it comes with the plugin {dist}, which is not installed: pip install {dist} "
            f"(from a ppokit checkout: pip install ./plugins/{dist})"
        )
    return (
        f"it comes with the plugin {dist}, which is installed but not loaded (PPOKIT_LOAD_PLUGINS)"
    )
