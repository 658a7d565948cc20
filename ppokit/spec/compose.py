"""Composing a spec from a variant, a task, the file and ``--set``, and where each value
came from.

The one rule: **defaults ← variant ← task ← the file ← --set**. A spec names a variant
(``variant: dapo``, a paper method: the algorithm) and a task (``task: countdown``: prompts,
reward, generation length) and sets only what differs. Each layer is merged into the ones
before it:

- a mapping merges key by key; any other value (a list, a number, ``null``) replaces;
- a component slot is one value: a new name replaces the component and its parameters; a
  mapping with the same name, or with no name, changes only the parameters it gives
  (``policy: {loss: {clip_high: 0.3}}`` keeps the variant's loss; with no component from a
  layer before it, a mapping needs its name);
- a variant and a task that set the same value are an error naming both: neither wins
  silently;
- a variant may extend another (``base``): the base's settings first, then its own.

After the merge, a value written ``${path}`` (with ``+ - * / //`` and numbers, e.g.
``${(rollout.max_new_tokens + 4) // 5}``) is read from the merged spec or its defaults, so a
variant can follow the task's generation budget. ``ppokit train --print-spec`` shows each
value with the layer that set it. Hydra's config groups are the model for the semantics.

Nothing here imports torch.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ppokit.catalogue import Variant
from ppokit.registry import COMPONENT_NAME, Registry, RegistryError, get_registry, suggest
from ppokit.slots import SLOTS, SOURCE
from ppokit.spec.checks import validate_spec
from ppokit.spec.files import read_spec_file
from ppokit.spec.models import Spec, SpecError
from ppokit.spec.overrides import apply_overrides

__all__ = [
    "DEFAULT_TASK",
    "Composed",
    "annotated_yaml",
    "compose",
    "leaf_values",
    "leaves",
    "load_spec",
    "named_spec",
    "spec_mapping",
]

#: The task a variant named on the command line runs on (``ppokit train dapo``).
DEFAULT_TASK = "demo"
#: The keys that name a variant and a task: read before the layers are merged.
NAMED = ("variant", "task")


def _slot_paths() -> frozenset[str]:
    """The paths whose value is one component (the prompt source's included)."""
    return frozenset(s.path for s in (SOURCE, *SLOTS))


@dataclass
class Composed:
    """A merged spec mapping and, for each path a layer set, that layer's label."""

    data: dict[str, Any]
    origins: dict[str, str] = field(default_factory=dict)

    def origin(self, path: str) -> str:
        """The layer that set ``path`` (the longest prefix some layer set), or ``default``."""
        parts = path.split(".")
        for end in range(len(parts), 0, -1):
            found = self.origins.get(".".join(parts[:end]))
            if found is not None:
                return found
        return "default"

    def mark(self, path: str, label: str) -> None:
        """``path`` (and everything below it) now comes from ``label``."""
        for key in [k for k in self.origins if k.startswith(path + ".")]:
            del self.origins[key]
        self.origins[path] = label


def _name_of(component: Any) -> Any:
    return component.get("name") if isinstance(component, dict) else component


def _merge(
    base: dict[str, Any], layer: dict[str, Any], into: Composed, label: str, at: str
) -> None:
    """Merge ``layer`` into ``base`` (in place) by the rule of the module docstring."""
    slots = _slot_paths()
    for key, value in layer.items():
        path = f"{at}.{key}" if at else str(key)
        old = base.get(key)
        same = isinstance(value, dict) and value.get("name", _name_of(old)) == _name_of(old)
        if path in slots and isinstance(old, (str, dict)) and same:
            component = {"name": old} if isinstance(old, str) else dict(old)
            base[key] = {**component, **copy.deepcopy(value)}
            into.mark(path, label)
            continue
        if path not in slots and isinstance(value, dict):
            if not isinstance(old, dict):  # a new section: its values one by one
                into.mark(path, "default")
                base[key] = old = {}
            _merge(old, value, into, label, path)
            continue
        base[key] = copy.deepcopy(value)
        into.mark(path, label)


def leaves(data: Any, at: str = "") -> Iterator[str]:
    """The paths a spec fragment sets: a component slot or a non-mapping value is one."""
    if not isinstance(data, dict) or at in _slot_paths():
        yield at
        return
    for key, value in data.items():
        yield from leaves(value, f"{at}.{key}" if at else str(key))


def leaf_values(data: dict[str, Any]) -> dict[str, Any]:
    """Each path :func:`leaves` finds in a spec fragment, with its value."""
    out = {}
    for path in leaves(data):
        node: Any = data
        for part in path.split("."):
            node = node[part]
        out[path] = node
    return out


def _variant_chain(name: str, registry: Registry) -> list[Variant]:
    """The variant ``name`` and the variants it extends, the farthest base first."""
    chain: list[Variant] = []
    while name:
        entry = registry.entry("variant", name).entry
        assert isinstance(entry, Variant)
        if any(v.name == entry.name for v in chain):
            raise RegistryError(f"variant {chain[0].name!r} extends itself (through {name!r})")
        chain.append(entry)
        name = entry.base
    return chain[::-1]


def named_spec(name: str, registry: Registry | None = None) -> dict[str, Any] | None:
    """The spec a name stands for on the command line: a variant on the default task, or a
    task with the default algorithm; None if ``name`` is neither."""
    registry = registry or get_registry()
    if registry.has_entry("variant", name):
        return {"variant": name, "task": DEFAULT_TASK}
    if registry.has_entry("task", name):
        return {"task": name}
    return None


def spec_mapping(path: str | Path, registry: Registry | None = None) -> dict[str, Any]:
    """The mapping of a spec file, or of a variant or task name when no such file exists."""
    text = str(path)
    if not Path(text).exists() and COMPONENT_NAME.fullmatch(text):
        registry = registry or get_registry()
        found = named_spec(text, registry)
        if found is not None:
            return found
        names = [e.name for w in NAMED for e in registry.entries(w)]
        raise SpecError([f"no spec file, variant or task of that name{suggest(text, names)}"], text)
    return read_spec_file(path)


def compose(
    data: dict[str, Any],
    overrides: Sequence[str] = (),
    registry: Registry | None = None,
    label: str = "the spec",
) -> Composed:
    """Merge the variant and the task ``data`` names, ``data`` itself and ``overrides``
    (``path=value``; ``variant=`` and ``task=`` are read first), recording each value's layer.

    SpecError lists every problem: an unknown variant or task, one set by both, a bad override.
    """
    registry = registry or get_registry()
    named = [o for o in overrides if o.partition("=")[0].strip() in NAMED]
    rest = [o for o in overrides if o not in named]
    data = apply_overrides(data, named) if named else data
    layers: list[tuple[str, dict[str, Any]]] = []
    errors: list[str] = []
    for word in NAMED:
        name = data.get(word)
        if name is None:
            continue
        if not isinstance(name, str):
            errors.append(f"{word}: expected a {word} name, got {type(name).__name__}")
            continue
        try:
            if word == "variant":
                chain = _variant_chain(name, registry)
                layers += [(f"variant {v.name}", dict(v.settings)) for v in chain]
            else:
                layers.append((f"task {name}", dict(registry.entry("task", name).entry.settings)))
        except RegistryError as exc:
            errors.append(f"{word}: {exc}")
    task = [settings for lab, settings in layers if lab.startswith("task ")]
    if task:
        variant_sets = {p for lab, s in layers if lab.startswith("variant ") for p in leaves(s)}
        for path in sorted(variant_sets & set(leaves(task[0]))):
            errors.append(
                f"{path}: set by both variant {data['variant']} and task {data['task']}: set it "
                "in the spec to choose"
            )
    if errors:
        raise SpecError(errors)
    composed = Composed({})
    for layer_label, settings in [*layers, (label, data)]:
        _merge(composed.data, settings, composed, layer_label, "")
    if rest:
        composed.data = apply_overrides(composed.data, rest)
        for item in rest:
            composed.mark(item.partition("=")[0].strip(), "--set")
    return composed


def load_spec(
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
    registry: Registry | None = None,
    base: dict[str, Any] | None = None,
) -> Spec:
    """Read a spec file (or a variant's or task's name), compose it, apply ``overrides``
    and validate it (``path=None``: start from ``base`` or {})."""
    source = str(path) if path is not None else None
    try:
        data = spec_mapping(path, registry) if path is not None else copy.deepcopy(base or {})
        return validate_spec(compose(data, overrides, registry).data, registry)
    except SpecError as exc:
        raise SpecError(exc.errors, source=exc.source or source) from None


# ---------------------------------------------------------------------- --print-spec
def _flow(value: Any) -> str:
    text = yaml.safe_dump(
        value, default_flow_style=True, width=1 << 30, sort_keys=False, allow_unicode=True
    )
    return text.removesuffix("\n").removesuffix("\n...").strip()


def annotated_yaml(spec: Spec, composed: Composed) -> str:
    """``spec`` as YAML, each value followed by ``# <the layer that set it>``."""
    rows: list[tuple[str, str]] = []
    slots = _slot_paths()

    def emit(node: dict[str, Any], at: str, indent: str) -> None:
        for key, value in node.items():
            path = f"{at}.{key}" if at else key
            if isinstance(value, dict) and value and path not in slots:
                rows.append((f"{indent}{key}:", ""))
                emit(value, path, indent + "  ")
            else:
                rows.append((f"{indent}{key}: {_flow(value)}", composed.origin(path)))

    emit(spec.model_dump(), "", "")
    width = min(56, max(len(text) for text, origin in rows if origin))
    lines = [f"{text:<{width}}  # {origin}" if origin else text for text, origin in rows]
    return "\n".join(lines) + "\n"
