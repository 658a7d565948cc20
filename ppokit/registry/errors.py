"""What the registry says is wrong: its error, the close names it suggests, one line per
parameter error, and the rules a component's or a plugin's name follows."""

from __future__ import annotations

import difflib
import re
import unicodedata
from collections.abc import Iterable
from typing import Any

from pydantic import ValidationError

#: A component's name: an ASCII identifier, so that no look-alike letter (Cyrillic,
#: full-width) can pass for another component's name.
COMPONENT_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
#: A plugin's (entry point's) name: ASCII letters, digits, '_', '-' and '.'.
PLUGIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


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
