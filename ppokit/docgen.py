"""``ppokit docs``: docs/components.md, variants.md and spec.md, generated from the registry
(its components and variants), the spec's models and the slot table.

The prose lives in the Markdown templates of ``ppokit/templates/docs``; this module fills their
placeholders and states no fact of its own. :func:`param_rows` is the parameter table of
``ppokit show`` and of the docs alike. In a checkout the output does not depend on the
installed plugins: components.md and spec.md read the built-ins only, and variants.md the
built-ins and the plugins kept in ``plugins/``, loaded from source; elsewhere variants.md
lists the installed plugins' variants too.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import re
import sys
import types
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin
from unittest import mock

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import to_jsonable_python
from rich.table import Table
from rich.text import Text

from ppokit.catalogue import Variant
from ppokit.errors import UserError, printable
from ppokit.registry import BUILTIN_PLUGIN, KINDS, ComponentInfo, Registry, build_registry
from ppokit.slots import FIELDS, SLOTS, SOURCE, Slot
from ppokit.spec import DEFAULT_TASK, ComponentSpec, Spec, compose, validate_spec

__all__ = ["ParamRow", "builtin_registry", "generate", "method_registry", "param_rows"]
__all__ += ["params_markdown", "params_table", "variants_registry", "write_docs"]

DASH, SECTION = "—", "(section defaults)"
_PLACEHOLDER = re.compile(r"\{\{\s*(\w+)\s*(?:\|\s*(.*?)\s*)?\}\}")
_SCALARS = {int: "integer", float: "number", str: "string", bool: "boolean", Any: "any"}
_BOUNDS: tuple[tuple[str, str], ...] = (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))
_BOUNDS += (("min_length", "len >="), ("max_length", "len <="))


# ---------------------------------------------------------------------- parameter tables
@dataclass(frozen=True)
class ParamRow:
    """One field of a params model or of a spec section."""

    name: str
    type: str
    required: bool
    default: Any
    bounds: str
    description: str

    @classmethod
    def of(cls, name: str, f: FieldInfo) -> ParamRow:
        bounds = [(s, getattr(m, a, None)) for a, s in _BOUNDS for m in f.metadata]
        text = ", ".join(f"{s} {v}" for s, v in bounds if v is not None)
        default = None if f.is_required() else f.get_default(call_default_factory=True)
        return cls(
            name, type_name(f.annotation), f.is_required(), default, text, f.description or ""
        )

    def as_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "default": to_jsonable_python(self.default, fallback=str)}

    @property
    def default_text(self) -> str:
        """The default as a spec writes it, ``required`` or ``(section defaults)``."""
        if self.required:
            return "required"
        if type_name(type(self.default)) == "section":
            return SECTION
        if isinstance(self.default, list) and self.default:
            return ", ".join(map(value_text, self.default))
        return value_text(self.default)

    def cells(self, markdown: bool = False) -> list[str]:
        """name, type, default, bounds, description; as Markdown: code, and — for nothing."""
        if not markdown:
            return [self.name, self.type, self.default_text, self.bounds, self.description]
        d = self.default_text
        d = d if self.required or d == SECTION else f"`{d}`"
        return [f"`{self.name}`", self.type, d, self.bounds or DASH, self.description or DASH]


def type_name(ann: Any) -> str:
    """A field's type in JSON-Schema words: ``number | null``, ``"a" | "b"``, ``list[...]``."""
    origin, args = get_origin(ann), get_args(ann)
    if origin is Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (Union, types.UnionType, Annotated):
        return " | ".join(type_name(a) for a in args[: 1 if origin is Annotated else None])
    if origin in (list, tuple, set, frozenset):
        return f"list[{type_name(args[0]) if args else 'any'}]"
    if dict in (origin, ann):
        return "mapping"
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return "component" if issubclass(ann, ComponentSpec) else "section"
    return "null" if ann is type(None) else _SCALARS.get(ann, getattr(ann, "__name__", str(ann)))


def param_rows(model: type[BaseModel], prefix: str = "") -> list[ParamRow]:
    """One row per field of ``model`` (its name prefixed with ``prefix``)."""
    return [ParamRow.of(prefix + name, f) for name, f in model.model_fields.items()]


def value_text(v: Any) -> str:
    """A value as a spec writes it (a component as ``name(p=v)``)."""
    if isinstance(v, ComponentSpec):
        return compact(v)
    return json.dumps(to_jsonable_python(v, fallback=str), ensure_ascii=False)


def params_markdown(rows: list[ParamRow]) -> str:
    """The rows of a Markdown table (``| name | type | default | bounds | description |``)."""
    return table(r.cells(markdown=True) for r in rows)


def params_table(rows: list[ParamRow]) -> Table:
    """The rows as a rich table (``ppokit show``)."""
    out = Table("parameter", "type", "default", "bounds", "description", box=None)
    for r in rows:
        out.add_row(*(Text(printable(c)) for c in r.cells()))  # a plugin's descriptions
    return out


# ---------------------------------------------------------------------- markdown
def table(rows: Iterable[Sequence[str]]) -> str:
    """The rows as a Markdown table's lines (a `|` inside a cell escaped)."""
    return "\n".join("| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows)


def _plain(v: Any) -> str:
    if isinstance(v, (bool, type(None))):
        return json.dumps(v)
    return f"{v:g}" if isinstance(v, float) else str(v)


def compact(comp: ComponentSpec) -> str:
    """``name(param=value, ...)`` with the parameters the spec sets."""
    inner = ", ".join(f"{k}={_plain(v)}" for k, v in comp.params.items())
    return f"{comp.name}({inner})" if inner else comp.name


def _sentence(text: str) -> str:
    text = text.rstrip(".")
    return text[:1].upper() + text[1:] + "." if text else ""


def render(template: str, **values: str) -> str:
    """A template of ``ppokit/templates/docs`` with its ``{{ name }}`` placeholders filled.

    A paragraph whose placeholders are all empty is left out, or replaced by ``text`` where
    one of them is written ``{{ name | text }}``."""
    text = (files("ppokit") / "templates" / "docs" / template).read_text(encoding="utf-8")
    blocks = []
    for block in text.strip("\n").split("\n\n"):
        found = _PLACEHOLDER.findall(block)
        if found and not any(values[name] for name, _ in found):
            blocks += [fallback for _, fallback in found if fallback][:1]
        else:
            blocks.append(_PLACEHOLDER.sub(lambda m: values[m[1]].strip("\n"), block))
    return "\n\n".join(blocks) + "\n"


# ---------------------------------------------------------------------- registries
def builtin_registry() -> Registry:
    """The built-in components only, whatever third-party plugins are installed."""
    with mock.patch.dict(os.environ, {"PPOKIT_LOAD_PLUGINS": ""}):
        return build_registry(strict=False)


def method_registry(root: Path | None = None) -> tuple[Registry, list[str]]:
    """Built-ins plus the plugins of ``plugins/`` loaded from source; and those that failed."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    registry, failed = builtin_registry(), []
    for pyproject in sorted((root or Path.cwd()).glob("plugins/*/pyproject.toml")):
        dist, project = pyproject.parent, tomllib.loads(pyproject.read_text(encoding="utf-8"))
        sys.path += [] if str(dist) in sys.path else [str(dist)]
        for name, module in project["project"].get("entry-points", {}).get("ppokit", {}).items():
            try:
                plugin = importlib.import_module(module)
            except ImportError:
                plugin = None
            if plugin is None or not registry.load_plugin(name, plugin, distribution=dist.name).ok:
                failed.append(dist.name)
    return registry, failed


# ---------------------------------------------------------------------- variants.md
def variants_registry(root: Path) -> tuple[Registry, list[str]]:
    """In a checkout (``root`` holds ``plugins/``): the built-ins and the plugins kept there,
    loaded from source, whatever is installed; elsewhere: the installed registry."""
    if (root / "plugins").is_dir():
        return method_registry(root)
    return build_registry(strict=False), []


def _slot_cell(spec: Spec, s: Slot, registry: Registry, plugins: set[str]) -> str:
    """The slot's component(s) as code, † for a plugin's; for the KL estimator, β and placement."""
    owner = spec if s.section is None else getattr(spec, s.section)
    if owner is None:
        return DASH
    cells = []
    for c in value if isinstance(value := getattr(owner, s.key), list) else [value]:
        info, weight = registry.info(s.kind, c.name), getattr(c, "weight", 1)
        record = registry.plugins[info.plugin]
        if info.plugin != BUILTIN_PLUGIN:
            plugins.add(f"`{c.name}` ({s.kind}, {record.distribution})")
        mark = "" if info.plugin == BUILTIN_PLUGIN else "†"
        cells.append(("" if weight == 1 else f"{weight:g}·") + f"`{compact(c)}`{mark}")
    kl_spec = spec.kl if s.section == "kl" else None
    kl = [f"β={kl_spec.coef:g}", kl_spec.placement] if kl_spec is not None else []
    target = kl_spec.target if kl_spec is not None else None
    adaptive = f" (adaptive, target {target:g})" if target is not None else ""
    return ", ".join([" + ".join(cells), *kl]) + adaptive


def header(entry: Variant) -> str:
    """A variant's paragraphs: its papers, its choices, what it scales down."""
    parts = []
    if entry.papers:
        parts.append("Paper: " + "; ".join(printable(str(p)) for p in entry.papers) + ".")
    if entry.base:
        parts.append(f"Extends [`{entry.base}`](#{entry.base}).")
    for label, text in (("Choices", entry.choices), ("Scaled", entry.scaled)):
        if text:
            parts.append(f"{label}: {_sentence(printable(text))}")
    return "\n\n".join(parts)


def variants_md(root: Path) -> str:
    from ppokit.explain import explain

    registry, failed = variants_registry(root)
    if failed:
        raise UserError(f"plugins of {root / 'plugins'} that do not load: {', '.join(failed)}")
    rows = [["method", *(s.path for s in SLOTS)], ["---"] * (len(SLOTS) + 1)]
    sections: list[str] = []
    plugins: set[str] = set()
    for info in registry.entries("variant"):
        entry = info.entry
        assert isinstance(entry, Variant)
        data = compose({"variant": info.name, "task": DEFAULT_TASK}, (), registry).data
        spec = validate_spec(data, registry)
        cells = [_slot_cell(spec, s, registry, plugins) for s in SLOTS]
        rows.append([f"[{info.name}](#{info.name})", *cells])
        text = explain(spec, registry=registry, source=f"variant {info.name}")
        title = printable(entry.title)
        if info.plugin != BUILTIN_PLUGIN:
            record = registry.plugins[info.plugin]
            title += f" (plugin {record.distribution or info.plugin})"
        values = dict(name=info.name, title=title, header=header(entry))
        sections.append(render("variant.md", explain=text, **values))
    plugins_text = "; ".join(sorted(plugins)) or DASH
    return render(
        "variants.md", table=table(rows), plugins=plugins_text, methods="\n".join(sections)
    )


# ---------------------------------------------------------------------- components.md
def _anchor(kind: str, name: str) -> str:
    return f"{kind}-{name}".replace("_", "-")


def convention(kind: str) -> str:
    """A kind's call convention: the first paragraph of its package's docstring, then the
    optional members its Protocol lists (the Protocol docstring's further paragraphs)."""
    package = importlib.import_module(f"ppokit.components.{kind}")
    parts = inspect.cleandoc(package.__doc__ or "").split("\n\n")[:1]
    for proto in vars(package).values():
        if getattr(proto, "_is_protocol", False) and proto.__module__ == package.__name__:
            parts += inspect.cleandoc(proto.__doc__ or "").split("\n\n")[1:]
    text = "\n\n".join(" ".join(p.split()) for p in parts)
    return re.sub(r":\w+:`~?([\w.]+)`", r"`\1`", text).replace("``", "`")


def _component(info: ComponentInfo, slot: Slot) -> str:
    rows, defaults = param_rows(info.params), info.defaults()
    values = [f"{r.name}: {_plain(defaults.get(r.name, f'<{r.name}>'))}" for r in rows]
    value = f"{{name: {', '.join([info.name, *values])}}}" if values else info.name
    return render(
        "component.md",
        anchor=_anchor(info.kind, info.name),
        name=info.name,
        summary=_sentence(info.summary),
        formula=info.formula,
        parameters=params_markdown(rows),
        requires=", ".join(f"`{r}`" for r in info.requires),
        source=info.source.rstrip("."),
        spec=f"{slot.section}: {{{slot.key}: {value}}}" if slot.section else f"{slot.key}: {value}",
    )


def components_md(root: Path) -> str:
    registry, contents, kinds = builtin_registry(), [], []
    for kind in KINDS:
        infos, slots = registry.components(kind), [s for s in (SOURCE, *SLOTS) if s.kind == kind]
        links = ", ".join(f"[`{i.name}`](#{_anchor(kind, i.name)})" for i in infos)
        contents.append(f"- [{kind}](#{kind}): {links}")
        kinds.append(
            render(
                "kind.md",
                kind=kind,
                convention=convention(kind),
                slots="\n".join(f"- `{s.path}` ({s.symbol}): {s.description}" for s in slots),
                components="\n".join(_component(i, slots[-1]) for i in infos),
            )
        )
    return render("components.md", contents="\n".join(contents), kinds="\n".join(kinds))


# ---------------------------------------------------------------------- spec.md
def _section(f: FieldInfo) -> type[BaseModel] | None:
    """The section model of a Spec field (``X`` or ``X | None``), else None."""
    models = [t for t in (f.annotation, *get_args(f.annotation)) if type_name(t) == "section"]
    return models[0] if models else None


def spec_md(root: Path) -> str:
    sections = [
        render(
            "spec_section.md",
            name=name,
            description=_sentence(f.description or ""),
            optional=name if type(None) in get_args(f.annotation) else "",
            table=params_markdown(param_rows(model, f"{name}.")),
        )
        for name, f in Spec.model_fields.items()
        if (model := _section(f)) is not None
    ]
    kinds = [f"[{s.kind}](components.md#{s.kind})" for s in SLOTS]
    slots = [
        [f"`{s.path}`", k, f"`{s.default}`", s.symbol, s.description]
        for s, k in zip(SLOTS, kinds, strict=True)
    ]
    infos = builtin_registry().components()
    users = [
        ", ".join(f"`{i.name}` ({i.kind})" for i in infos if f.name in i.requires) for f in FIELDS
    ]
    fields = [
        [f"`{f.name}`", f"[{','.join(f.shape)}] {f.dtype}", f.provided_by, u or DASH]
        for f, u in zip(FIELDS, users, strict=True)
    ]
    from ppokit import spec as limits

    return render(
        "spec.md",
        top_level=params_markdown(param_rows(Spec)),
        sections="\n".join(sections),
        slots=table(slots),
        requirements=table(fields),
        max_weight=f"{int(limits.MAX_REWARD_WEIGHT):,}",
        max_positions=f"2^{limits.MAX_ROUND_POSITIONS.bit_length() - 1}",
        max_kib=str(limits.MAX_SPEC_BYTES // 1024),
        max_nodes=f"{limits.MAX_SPEC_NODES:,}",
        max_depth=str(limits.MAX_SPEC_DEPTH),
    )


# ---------------------------------------------------------------------- files
def generate(root: Path | None = None) -> dict[str, str]:
    """File name -> text, generated from the project at ``root`` (default: the cwd)."""
    root = (root or Path.cwd()).resolve()
    return {f"{f.__name__[:-3]}.md": f(root) for f in (components_md, variants_md, spec_md)}


def write_docs(out: Path, root: Path | None = None, check: bool = False) -> list[Path]:
    """Write the generated docs that differ from those in ``out`` (``check``: write nothing);
    return their paths."""
    docs = generate(root)
    old = {n: (out / n).read_text(encoding="utf-8") if (out / n).is_file() else None for n in docs}
    stale = [out / n for n, text in docs.items() if old[n] != text]
    for path in [] if check else stale:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(docs[path.name], encoding="utf-8")
    return stale
