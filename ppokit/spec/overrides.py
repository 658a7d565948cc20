"""The ``--set path=value`` language."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from ppokit.slots import SLOTS, slot
from ppokit.spec.files import load_yaml
from ppokit.spec.models import SpecError


def _slot_of(prefix: str) -> str | None:
    """The slot path of ``prefix`` (``reward.1`` -> ``reward``), or None if not a slot."""
    parts = prefix.split(".")
    if parts[0] == "reward" and len(parts) <= 2 and (len(parts) == 1 or parts[1].isdigit()):
        return "reward"
    return prefix if prefix in {s.path for s in SLOTS} else None


def _child(node: Any, part: str) -> tuple[bool, Any]:
    """(found, value) of ``node[part]`` for a mapping key or a list index."""
    if isinstance(node, dict):
        return part in node, node.get(part)
    if (
        isinstance(node, list)
        and part.lstrip("-").isdigit()
        and -len(node) <= int(part) < len(node)
    ):
        return True, node[int(part)]
    return False, None


def _set(node: Any, part: str, value: Any) -> bool:
    if isinstance(node, dict):
        node[part] = value
        return True
    if isinstance(node, list) and _child(node, part)[0]:
        node[int(part)] = value
        return True
    return False


def _missing(node: Any, path: str) -> str:
    """Why ``path`` cannot be set inside ``node`` (the value at its parent)."""
    parent, _, last = path.rpartition(".")
    if isinstance(node, list):
        return f"index {last} is out of range: {parent} has {len(node)} item(s)"
    return f"{path} does not exist"


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Apply ``path=value`` overrides (values parsed as YAML scalars) to a spec mapping.

    ``advantage.lam=0.9`` works whether the slot was written as a name, a mapping, or left
    out (the default component gets the parameter); ``advantage=rloo`` swaps the component
    (dropping the old one's parameters). List items are addressed by index (``reward.1.weight``);
    with a single reward, ``reward.weight`` addresses it.
    """
    data = copy.deepcopy(data)
    errors = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key or "" in key.split("."):
            errors.append(f"--set {item!r}: expected path=value")
            continue
        try:
            value = load_yaml(raw, key) if raw.strip() else None
        except SpecError as exc:
            errors.extend(f"--set {item!r}: {line}" for line in exc.errors)
            continue
        parts = key.split(".")
        node: Any = data
        for i, part in enumerate(parts[:-1]):
            prefix = ".".join(parts[: i + 1])
            child = _child(node, part)[1]
            slot_path = _slot_of(prefix)
            if isinstance(child, list) and prefix == "reward" and not parts[i + 1].isdigit():
                if len(child) != 1:
                    errors.append(f"--set {key}: reward has {len(child)} items; use reward.N")
                    break
                child = child[0]
            if child is None and slot_path is not None:
                child = slot(slot_path).default
            if isinstance(child, str) and slot_path is not None:
                child = {"name": child}
            if child is None:
                child = {}
            if not _set(node, part, child):
                errors.append(f"--set {key}: {_missing(node, prefix)}")
                break
            if not isinstance(child, (dict, list)):
                errors.append(f"--set {key}: {prefix} is not a mapping")
                break
            node = child
        else:
            if not _set(node, parts[-1], value):
                errors.append(f"--set {key}: {_missing(node, key)}")
    if errors:
        raise SpecError(errors)
    return data
