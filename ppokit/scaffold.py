"""``ppokit new-plugin``: scaffold a plugin distribution from ``ppokit/templates/plugin``.

The generated ``ppokit-NAME/`` holds a pyproject.toml with the ``ppokit`` entry point, a
package with one working component (an advantage estimator with a params model, a docstring
formula and lazy registration), its tests (hypothesis) and a README. Template files end in
``.tmpl``; ``{{key}}`` placeholders are filled in and ``__pkg__`` in a path becomes the
package name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib.resources import files
from importlib.resources.abc import Traversable
from pathlib import Path

from ppokit.errors import UserError

__all__ = ["PluginNames", "new_plugin", "plugin_names"]

_NAME = re.compile(r"^[a-z][a-z0-9]*(?:[-_][a-z0-9]+)*$")
_SUFFIX = ".tmpl"


@dataclass(frozen=True)
class PluginNames:
    """The names derived from a plugin name such as ``my-adv``."""

    name: str  # entry-point name: my_adv
    dist: str  # distribution: ppokit-my-adv
    pkg: str  # import package: ppokit_my_adv
    component: str  # the example component: my_adv_centered
    cls: str  # its class: MyAdvCentered

    def substitutions(self) -> dict[str, str]:
        from ppokit import __version__

        return {
            "name": self.name,
            "dist": self.dist,
            "pkg": self.pkg,
            "component": self.component,
            "class": self.cls,
            "const": self.component.upper(),
            "ppokit_version": __version__,
        }


def plugin_names(name: str) -> PluginNames:
    """Validate ``name`` (lowercase letters, digits, ``-`` or ``_``) and derive the others."""
    raw = name.strip()
    if raw.startswith("ppokit-") or raw.startswith("ppokit_"):
        raw = raw[len("ppokit-") :]
    if not _NAME.match(raw):
        raise UserError(
            f"plugin name {name!r} must start with a lowercase letter and contain only "
            "lowercase letters, digits, '-' and '_'"
        )
    snake = raw.replace("-", "_")
    return PluginNames(
        name=snake,
        dist="ppokit-" + raw.replace("_", "-"),
        pkg="ppokit_" + snake,
        component=f"{snake}_centered",
        cls="".join(part.title() for part in snake.split("_")) + "Centered",
    )


def _render(text: str, values: dict[str, str]) -> str:
    for key, value in values.items():
        text = text.replace("{{" + key + "}}", value)
    left = re.search(r"\{\{\w+\}\}", text)
    if left:
        raise UserError(f"template placeholder {left.group(0)} has no value")
    return text


def _walk(node: Traversable, rel: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], str]]:
    """(relative path parts, text) of every template file under ``node``."""
    found = []
    for child in sorted(node.iterdir(), key=lambda c: c.name):
        if child.is_dir():
            if child.name != "__pycache__":
                found.extend(_walk(child, (*rel, child.name)))
        elif child.name.endswith(_SUFFIX):
            found.append(((*rel, child.name[: -len(_SUFFIX)]), child.read_text(encoding="utf-8")))
    return found


def template_root() -> Traversable:
    return files("ppokit") / "templates" / "plugin"


def new_plugin(name: str, directory: str | Path = ".") -> Path:
    """Create ``DIRECTORY/ppokit-NAME/`` from the template; return its path."""
    names = plugin_names(name)
    root = Path(directory) / names.dist
    if root.exists():
        raise UserError(f"{root} already exists")
    values = names.substitutions()
    templates = _walk(template_root())
    if not templates:
        raise UserError("the plugin template is missing from the ppokit installation")
    for parts, text in templates:
        target = root.joinpath(*(names.pkg if p == "__pkg__" else p for p in parts))
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(_render(text, values), encoding="utf-8")
    return root
