"""The component registry: a pluggy plugin manager over the entry-point group ``ppokit``.

Every component, built-in or third-party, arrives through the same hook,
:func:`ppokit.hookspecs.ppokit_register`. The built-ins are the default plugin
``ppokit.components``, registered exactly as an installed plugin is. A registration is a
:class:`~ppokit.catalogue.Component` entry: every fact about a component, stated once.

Nothing here imports torch: listing components, reading their parameter schemas and
validating a spec stay light. A component's factory is imported only when it is created
(or when its formula must be read from it).
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import inspect
import io
import os
import re
import sys
import traceback
import unicodedata
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from importlib.metadata import EntryPoint, PackageNotFoundError, distribution, entry_points
from typing import Any, NoReturn

import pluggy
from pydantic import BaseModel, ConfigDict, ValidationError, create_model

from ppokit import hookspecs
from ppokit.bounded import TimedOut, run_bounded
from ppokit.catalogue import Component, implementation_of
from ppokit.errors import one_line, printable
from ppokit.metrics_table import declare
from ppokit.slots import FIELDS, KINDS

__all__ = [
    "KINDS",
    "ComponentInfo",
    "PluginRecord",
    "Registry",
    "RegistryError",
    "get_registry",
    "name_problem",
    "reset_registry",
]


#: Batch fields a component may require: the optional fields of a RolloutBatch.
REQUIREMENTS: tuple[str, ...] = tuple(f.name for f in FIELDS)

BUILTIN_PLUGIN = "ppokit"

#: Components of the plugins published with ppokit (in its ``plugins/`` folder), so that a
#: spec naming one without the plugin installed is told what to install (a test keeps this
#: table equal to what those plugins register).
KNOWN_PLUGINS: dict[tuple[str, str], str] = {
    ("regression_loss", "hlgauss"): "ppokit-hlgauss",
    ("advantage", "lite_ppo"): "ppokit-example",
}
ENTRY_POINT_GROUP = "ppokit"

#: A component's name: an ASCII identifier, so that no look-alike letter (Cyrillic,
#: full-width) can pass for another component's name.
COMPONENT_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
#: A plugin's (entry point's) name: ASCII letters, digits, '_', '-' and '.'.
PLUGIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
#: Seconds an installed plugin may take to import and register (PPOKIT_PLUGIN_IMPORT_TIMEOUT
#: changes it); one that takes longer is reported as failed and the command goes on.
PLUGIN_IMPORT_TIMEOUT = 30.0


class RegistryError(LookupError):
    """Unknown kind or component, conflicting registration, or invalid parameters."""


def suggest(word: str, candidates: Iterable[str]) -> str:
    """`` (did you mean 'x', 'y'?)`` for close names, else ``""``."""
    close = difflib.get_close_matches(word, list(candidates), n=3, cutoff=0.5)
    if not close:
        return ""
    return " (did you mean " + ", ".join(repr(c) for c in close) + "?)"


def format_validation_error(err: ValidationError, prefix: str = "") -> list[str]:
    """One ``path: message`` line per pydantic error."""
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in (prefix, *e["loc"]) if p != "")
        lines.append(f"{loc}: {e['msg']}" if loc else e["msg"])
    return lines


def _params_from_signature(name: str, factory: Callable[..., Any]) -> type[BaseModel]:
    """A pydantic model whose fields are the keyword parameters of ``factory``."""
    fields: dict[str, Any] = {}
    for p in inspect.signature(factory).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.name == "self":
            continue
        annotation = Any if p.annotation is inspect.Parameter.empty else p.annotation
        default = ... if p.default is inspect.Parameter.empty else p.default
        fields[p.name] = (annotation, default)
    model_name = "".join(part.title() for part in name.split("_")) + "Params"
    return create_model(model_name, __config__=ConfigDict(extra="forbid"), **fields)


def _check_unique(infos: list[ComponentInfo]) -> None:
    """A plugin may register each (kind, name) once."""
    seen: set[tuple[str, str]] = set()
    for info in infos:
        key = (info.kind, info.name)
        if key in seen:
            raise RegistryError(f"{info.kind} {info.name!r} is registered twice by this plugin")
        seen.add(key)


def name_problem(
    name: Any, what: str = "component name", pattern: re.Pattern[str] = COMPONENT_NAME
) -> str | None:
    """Why ``name`` is not a valid name (``pattern``), in one line; None if it is. A
    non-ASCII character is named with its code point, since it may look like an ASCII one."""
    if isinstance(name, str) and pattern.fullmatch(name):
        return None
    if not isinstance(name, str):
        return f"{what} must be a string, got {type(name).__name__}"
    if pattern is COMPONENT_NAME:
        rule = "an ASCII identifier (letters, digits and '_', not starting with a digit)"
    else:
        rule = "an ASCII name (letters, digits, '_', '-' and '.')"
    problem = f"{what} {name!a} is not {rule}"
    odd = next((c for c in name if not c.isascii()), None)
    if odd is not None:
        problem += f": {odd!a} is U+{ord(odd):04X} {unicodedata.name(odd, 'unnamed')}"
    return problem


class PluginExit(Exception):
    """A plugin called ``os._exit`` while it loaded."""


#: What a plugin may raise while it loads without taking the command line down with it
#: (``sys.exit`` and ``os._exit`` included); KeyboardInterrupt still stops the program.
PLUGIN_ERRORS = (Exception, SystemExit)


class PluginPrinted(RuntimeError):
    """A plugin wrote to standard output while it loaded (which would corrupt JSON output)."""


@contextlib.contextmanager
def isolated_output() -> Iterator[None]:
    """Run plugin code with standard output captured: anything it prints raises
    :class:`PluginPrinted` (the text goes to standard error)."""
    buffer = io.StringIO()
    try:
        with contextlib.redirect_stdout(buffer):
            yield
    finally:
        text = buffer.getvalue()
        if text:
            sys.stderr.write(text)
    if text:
        first = text.strip().splitlines()[0][:80] if text.strip() else repr(text[:20])
        raise PluginPrinted(f"wrote to standard output while loading: {first!r}")


@contextlib.contextmanager
def _stdout_fd_to_stderr() -> Iterator[None]:
    """File descriptor 1 points to standard error for the block (what code writes to it
    directly, ``os.write(1, ...)`` or a C library's ``printf``, cannot corrupt a command's
    JSON output); put back after."""
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:  # no standard output to protect
        yield
        return
    try:
        with contextlib.suppress(OSError):
            os.dup2(2, 1)
        yield
    finally:
        _flush_c_streams()  # what C code buffered for fd 1 goes where fd 1 pointed
        os.dup2(saved, 1)
        os.close(saved)


def _flush_c_streams() -> None:
    """The C library's ``fflush(NULL)``, where there is one (best effort)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None).fflush(None)


@contextlib.contextmanager
def _exit_refused() -> Iterator[None]:
    """``os._exit`` raises :class:`PluginExit` for the block instead of ending the process
    (``sys.exit`` raises ``SystemExit``, which the callers catch)."""
    real = os._exit

    def refuse(status: int) -> NoReturn:
        raise PluginExit(f"called os._exit({status}) while loading")

    os._exit = refuse
    try:
        yield
    finally:
        os._exit = real


@contextlib.contextmanager
def guarded() -> Iterator[None]:
    """The guards around plugin code run while plugins load: standard output captured (a
    print is an error), file descriptor 1 sent to standard error, ``os._exit`` refused."""
    with _stdout_fd_to_stderr(), _exit_refused(), isolated_output():
        yield


def plugin_import_timeout() -> float:
    """PPOKIT_PLUGIN_IMPORT_TIMEOUT (seconds, > 0), else PLUGIN_IMPORT_TIMEOUT."""
    raw = os.environ.get("PPOKIT_PLUGIN_IMPORT_TIMEOUT", "").strip()
    if not raw:
        return PLUGIN_IMPORT_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = 0.0
    if not (value > 0 and value < float("inf")):
        raise RegistryError(
            f"PPOKIT_PLUGIN_IMPORT_TIMEOUT={raw!r}: expected a positive number of seconds"
        )
    return value


def _normalise(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


#: A lazy factory: the dotted name of the module that holds the implementation. Plugins
#: written for ppokit 0.x may still add ``:attr``, the implementation's name in it (read
#: when the module marks no implementation of the entry).
_DOTTED = r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*"
LAZY_FACTORY = re.compile(rf"(?P<module>{_DOTTED})(:(?P<attr>{_DOTTED}))?")


def _implementation(entry: Component | None, factory: str) -> Any:
    """Import a lazy factory's module; the object ``@entry.implementation`` recorded, else
    (the older ``"module:attr"`` spelling) the attribute; None when neither is there."""
    match = LAZY_FACTORY.fullmatch(factory)
    if match is None:
        raise RegistryError(f"factory {factory!r} is not a module name")
    obj: Any = importlib.import_module(match["module"])
    found = None if entry is None else implementation_of(entry)
    if found is not None or match["attr"] is None:
        return found
    for part in match["attr"].split("."):
        obj = getattr(obj, part)
    return obj


@dataclass
class ComponentInfo:
    """Everything known about one registered component."""

    kind: str
    name: str
    factory: Any
    plugin: str
    entry: Component | None = None
    version: str | None = None
    summary: str = ""
    requires: tuple[str, ...] = ()
    source: str = ""
    _params: type[BaseModel] | None = None
    _formula: str = ""

    def load(self) -> Callable[..., Any]:
        """The factory itself: on first use, a lazy factory's module is imported and the
        object its ``@entry.implementation`` decorator recorded is taken."""
        if isinstance(self.factory, str):
            who = f"{self.kind} {self.name!r} (plugin {self.plugin})"
            try:
                with guarded():
                    found = _implementation(self.entry, self.factory)
            except RegistryError:
                raise
            except PLUGIN_ERRORS as exc:
                raise RegistryError(f"{who} cannot be imported: {one_line(exc)}") from exc
            if found is None:
                raise RegistryError(
                    f"{who} cannot be imported: module {self.factory!r} marks no "
                    "implementation of it (decorate it with @ENTRY.implementation)"
                )
            self.factory = found
        return self.factory

    @cached_property
    def params(self) -> type[BaseModel]:
        """The pydantic model of the parameters (from the factory's signature if not given)."""
        if self._params is not None:
            return self._params
        return _params_from_signature(self.name, self.load())

    @property
    def formula(self) -> str:
        if self._formula:
            return self._formula
        try:
            factory = self.load()
        except RegistryError:
            return ""
        formula = getattr(factory, "formula", "")
        if isinstance(formula, str) and formula:
            return printable(formula)
        if getattr(factory, "component", None) is not None:  # its docstring is the entry's
            return ""
        return printable((inspect.getdoc(factory) or "").split("\n\n")[0].strip())

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


@dataclass
class PluginRecord:
    """A plugin that was loaded (or failed to load)."""

    name: str
    distribution: str | None = None
    version: str | None = None
    components: list[tuple[str, str]] = field(default_factory=list)
    error: str | None = None
    traceback: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


class Registry:
    """Components by kind and name, as registered by the loaded plugins."""

    def __init__(self) -> None:
        self._components: dict[tuple[str, str], ComponentInfo] = {}
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
        :func:`guarded`, on a worker thread for at most ``timeout`` seconds when given).

        Its registrations are committed only if the whole hook succeeds.
        """
        record = PluginRecord(name, distribution, version)
        self.plugins[name] = record
        try:
            with guarded():
                pending = run_bounded(
                    lambda: self._run_hook(name, plugin, version), timeout, f"ppokit-{name}"
                )
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

    def _run_hook(self, name: str, plugin: object, version: str | None) -> list[ComponentInfo]:
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
        pending: list[ComponentInfo] = []

        def register(entry: Component, *args: Any, **facts: Any) -> None:
            if not isinstance(entry, Component) or args or facts:
                raise RegistryError(
                    "register(entry) takes one ppokit.Component (kind, name, factory, ...), "
                    f"got {type(entry).__name__}" + (" and more arguments" if args or facts else "")
                )
            pending.append(self._make_info(entry, name, version))

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
        requires = tuple(entry.requires)
        if not requires and not isinstance(factory, str):  # an eager factory may declare them
            requires = tuple(getattr(factory, "requires", ()))
        for r in requires:
            if r not in REQUIREMENTS:
                raise RegistryError(
                    f"{kind} {name!r} requires unknown batch field {r!r}{suggest(r, REQUIREMENTS)}"
                )
        declare(entry.metrics)
        summary = entry.summary
        if not summary:
            doc = "" if isinstance(factory, str) else inspect.getdoc(factory) or ""
            summary = doc.split("\n")[0].strip()
        return ComponentInfo(  # what a plugin wrote is shown on terminals: no control codes
            kind=kind,
            name=name,
            factory=factory,
            plugin=plugin,
            entry=entry,
            version=version,
            summary=printable(str(summary)),
            requires=requires,
            source=printable(str(entry.source)),
            _params=params,
            _formula=printable(str(entry.formula)),
        )

    def _add(self, info: ComponentInfo, record: PluginRecord) -> None:
        key = (info.kind, info.name)
        record.components.append(key)
        if key in self._conflicts:
            self._conflicts[key].append(info.plugin)
            return
        existing = self._components.get(key)
        if existing is not None:
            self._conflicts[key] = [existing.plugin, info.plugin]
            del self._components[key]
            return
        self._components[key] = info

    def load_entry_points(self, only: set[str] | None = None) -> None:
        """Load installed plugins of the ``ppokit`` entry-point group (``only``: by name).

        Each plugin is imported and its hook run on a worker thread, for at most
        :func:`plugin_import_timeout` seconds, under :func:`guarded`: a plugin that hangs,
        exits or prints is recorded as failed and the others load. A name in ``only`` that
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
            with guarded():
                module = run_bounded(ep.load, timeout, f"ppokit-import-{name}")
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


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


def env_flag(name: str) -> bool:
    """A boolean environment switch: 1/true/yes/on or 0/false/no/off (any case; unset: off)."""
    raw = os.environ.get(name, "").strip().lower()
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise RegistryError(
        f"{name}={os.environ[name]!r}: expected one of 1, true, yes, on or 0, false, no, off"
    )


#: The environment switch that turns installed plugins off (``ppokit --no-plugins`` sets it,
#: so that the processes ``ppokit train --nproc`` starts run without them too).
NO_PLUGINS = "PPOKIT_NO_PLUGINS"


def plugins_off() -> bool:
    """Whether installed plugins are off (PPOKIT_NO_PLUGINS)."""
    return env_flag(NO_PLUGINS)


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


def _plugin_filter() -> set[str] | None:
    raw = os.environ.get("PPOKIT_LOAD_PLUGINS")
    if raw is None:
        return None
    return {p.strip() for p in raw.split(",") if p.strip()}


def build_registry(strict: bool | None = None) -> Registry:
    """A fresh registry: the built-ins, then the installed plugins that the environment allows.

    ``PPOKIT_NO_PLUGINS=1`` (``ppokit --no-plugins``) loads none, not even imports them;
    ``PPOKIT_LOAD_PLUGINS=a,b`` loads only those plugins ('' = built-ins only);
    ``PPOKIT_STRICT_PLUGINS=1`` turns a broken plugin or a conflicting name into an error.
    """
    if strict is None:
        strict = env_flag("PPOKIT_STRICT_PLUGINS")
    registry = Registry()
    from ppokit import components

    registry.load_plugin(BUILTIN_PLUGIN, components, distribution="ppokit", version=_own_version())
    if not plugins_off():
        registry.load_entry_points(_plugin_filter())
    if strict:
        problems = [f"plugin {p.name}: {p.error}" for p in registry.failed]
        problems += registry.conflict_errors()
        if problems:
            raise RegistryError("; ".join(problems))
    return registry


def _own_version() -> str | None:
    from ppokit import __version__

    return __version__


@lru_cache(maxsize=1)
def get_registry() -> Registry:
    """The process-wide registry, built once on first use."""
    return build_registry()


def reset_registry() -> None:
    """Forget the cached registry (after installing a plugin, or changing the env switches)."""
    get_registry.cache_clear()
