"""Variants and tasks on the command line: ``ppokit variants``, ``ppokit tasks``,
``ppokit show variant|task NAME`` and ``ppokit new-spec VARIANT``.

A variant is a paper method and a task is prompts with their reward (:mod:`ppokit.catalogue`);
both are registered like components, by the built-ins and by plugins. Nothing here imports
torch (``show variant`` explains the objective from the catalogue entries).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from ppokit.catalogue import Task, Variant
from ppokit.errors import UserError, printable
from ppokit.registry import Registry, get_registry
from ppokit.slots import SLOTS
from ppokit.spec import DEFAULT_TASK, SpecError, compose, leaf_values, validate_spec

__all__ = ["entry_rows", "new_spec", "paper_names", "sets_text", "show_entry"]


def paper_names(papers: tuple[Any, ...]) -> str:
    """``Yu et al., 2025; ...``: each paper's authors and year (text as it is)."""
    names = []
    for paper in papers:
        if hasattr(paper, "authors"):
            names.append(f"{paper.authors}, {paper.year}")
            continue
        cited = re.search(r"\(([^()]*\d{4})\)", str(paper))  # "Title (Authors, Year), where"
        names.append(printable(cited.group(1) if cited else str(paper)))
    return "; ".join(names) or "-"


def _component(value: Any) -> str:
    return str(value.get("name", "?")) if isinstance(value, dict) else str(value)


def sets_text(settings: Any) -> str:
    """What a spec fragment sets, in one line: its slots' components, then how many other
    values (``advantage grpo, policy.loss ppo_clip, kl.estimator k3 (+7 values)``)."""
    slots = {s.path for s in SLOTS}
    named, other = [], 0
    for path, node in leaf_values(dict(settings)).items():
        if path in slots:
            if isinstance(node, list):
                named.append(f"{path} " + ("+".join(_component(v) for v in node) or "none"))
            else:
                named.append(f"{path} {_component(node)}")
        else:
            other += 1
    more = f" (+{other} value{'s' if other != 1 else ''})" if other else ""
    return printable(", ".join(named) + more) if named else f"{other} value(s)"


def entry_rows(word: str, registry: Registry | None = None) -> list[dict[str, Any]]:
    """One row per registered variant or task: name, title, papers or source, what it sets,
    plugin."""
    rows = []
    for info in (registry or get_registry()).entries(word):
        entry = info.entry
        row: dict[str, Any] = {"name": info.name, "title": info.title, "plugin": info.plugin}
        if isinstance(entry, Variant):
            row["papers"] = paper_names(entry.papers)
            row["base"] = entry.base or None
        else:
            row["source"] = printable(entry.source)
        row["sets"] = sets_text(entry.settings)
        rows.append(row)
    return rows


def _yaml(settings: Any) -> str:
    return yaml.safe_dump(
        json.loads(json.dumps(settings, default=str)), sort_keys=False, width=88
    ).rstrip()


def show_entry(word: str, name: str, registry: Registry | None = None) -> dict[str, Any]:
    """What ``ppokit show variant|task NAME`` prints: the entry's facts, its settings as YAML
    and (for a variant) the objective it assembles on the default task."""
    from ppokit.explain import explain

    registry = registry or get_registry()
    info = registry.entry(word, name)
    entry = info.entry
    data: dict[str, Any] = {
        word: info.name,
        "title": info.title,
        "plugin": info.plugin,
        "version": info.version,
        "settings": _yaml(entry.settings),
    }
    if isinstance(entry, Variant):
        data["papers"] = [printable(str(p)) for p in entry.papers]
        data["base"] = entry.base or None
        data["choices"] = printable(entry.choices)
        data["scaled"] = printable(entry.scaled)
        spec = validate_spec(compose({"variant": name, "task": DEFAULT_TASK}, (), registry).data)
        data["explain"] = explain(spec, registry=registry, source=f"variant {name}")
    else:
        assert isinstance(entry, Task)
        data["about"] = printable(entry.about)
        data["source"] = printable(entry.source)
    return data


def _comment(text: str, width: int = 88) -> list[str]:
    import textwrap

    return ["# " + line for line in textwrap.wrap(printable(text), width - 2)]


def new_spec(
    variant: str, task: str = DEFAULT_TASK, model: str = "tiny", registry: Registry | None = None
) -> str:
    """A commented spec that names ``variant`` and ``task`` on ``model``: what each sets
    written out as comments, validated before it is returned."""
    registry = registry or get_registry()
    v = registry.entry("variant", variant).entry
    t = registry.entry("task", task).entry
    assert isinstance(v, Variant) and isinstance(t, Task)
    lines = _comment(f"{v.title}: the {variant} variant ('ppokit show variant {variant}').")
    if v.papers:
        lines += _comment("Paper: " + "; ".join(str(p) for p in v.papers))
    lines += _comment(f"On the {task} task: {t.title} ('ppokit show task {task}').")
    lines += [
        "# Set here only what differs: a value set below wins over the variant's and the",
        "# task's ('ppokit train SPEC --print-spec' shows each value and where it comes from).",
        f"variant: {variant}",
        f"task: {task}",
        "model:",
        f"  actor: {json.dumps(model)}",
        "# The variant sets:",
        *("#   " + line for line in _yaml(v.settings).splitlines()),
        "# The task sets:",
        *("#   " + line for line in _yaml(t.settings).splitlines()),
        "output:",
        f"  dir: runs/{variant}-{task}",
    ]
    text = "\n".join(lines) + "\n"
    data = yaml.safe_load(text)
    try:
        validate_spec(compose(data, (), registry).data, registry)
    except SpecError as exc:
        raise SpecError(exc.errors, source=f"variant {variant} on task {task}") from None
    return text


def write_new_spec(text: str, out: Path | None) -> None:
    """Print ``text`` (``out`` None) or write it to a new file ``out`` (never over one)."""
    if out is None:
        print(text, end="")
        return
    try:
        with out.open("x", encoding="utf-8") as f:
            f.write(text)
    except FileExistsError:
        raise UserError(f"{out}: already exists; choose another file or remove it") from None
    except OSError as exc:
        raise UserError(f"{out}: {exc.strerror or exc}") from None
