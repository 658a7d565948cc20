"""The environment switches of plugin loading: which plugins load, for how long, and how
strictly."""

from __future__ import annotations

import os

from ppokit.registry.errors import RegistryError

#: Seconds an installed plugin may take to import and register (PPOKIT_PLUGIN_IMPORT_TIMEOUT
#: changes it); one that takes longer is reported as failed and the command goes on.
PLUGIN_IMPORT_TIMEOUT = 30.0


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


def plugin_filter() -> set[str] | None:
    """The plugins PPOKIT_LOAD_PLUGINS names (None: unset, every installed plugin)."""
    raw = os.environ.get("PPOKIT_LOAD_PLUGINS")
    if raw is None:
        return None
    return {p.strip() for p in raw.split(",") if p.strip()}
