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

from functools import lru_cache

from ppokit.registry.errors import (
    COMPONENT_NAME,
    PLUGIN_NAME,
    RegistryError,
    format_validation_error,
    name_problem,
    suggest,
)
from ppokit.registry.guards import (
    PLUGIN_ERRORS,
    PluginExit,
    PluginPrinted,
    guarded,
    isolated_output,
)
from ppokit.registry.info import (
    LAZY_FACTORY,
    ComponentInfo,
    params_from_signature,
)
from ppokit.registry.plugins import (
    BUILTIN_PLUGIN,
    ENTRY_POINT_GROUP,
    KINDS,
    KNOWN_PLUGINS,
    REQUIREMENTS,
    PluginRecord,
    Registry,
)
from ppokit.registry.switches import (
    NO_PLUGINS,
    PLUGIN_IMPORT_TIMEOUT,
    env_flag,
    plugin_filter,
    plugin_import_timeout,
    plugins_off,
)

__all__ = [
    "BUILTIN_PLUGIN",
    "COMPONENT_NAME",
    "ENTRY_POINT_GROUP",
    "KINDS",
    "KNOWN_PLUGINS",
    "LAZY_FACTORY",
    "NO_PLUGINS",
    "PLUGIN_ERRORS",
    "PLUGIN_IMPORT_TIMEOUT",
    "PLUGIN_NAME",
    "REQUIREMENTS",
    "ComponentInfo",
    "PluginExit",
    "PluginPrinted",
    "PluginRecord",
    "Registry",
    "RegistryError",
    "build_registry",
    "env_flag",
    "format_validation_error",
    "get_registry",
    "guarded",
    "isolated_output",
    "name_problem",
    "params_from_signature",
    "plugin_filter",
    "plugin_import_timeout",
    "plugins_off",
    "reset_registry",
    "suggest",
]


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
        registry.load_entry_points(plugin_filter())
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
