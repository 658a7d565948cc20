"""Reading a spec file safely: YAML 1.2 numbers (a YAML 1.1 form read otherwise is
refused), merge keys that explicit keys override, duplicate keys refused, and bounded size,
nodes and nesting."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import yaml

from ppokit.spec.models import SpecError

#: No spec is larger than this; a larger file (or a device such as /dev/zero) is refused.
MAX_SPEC_BYTES = 1 << 20
#: Nodes a spec may hold once its YAML aliases are expanded (bounds alias "bombs").
MAX_SPEC_NODES = 100_000
#: How deeply a spec's mappings and lists may nest: the nodes from the top mapping down to a
#: value, both counted (a spec needs a handful; far deeper nesting would exhaust Python's
#: recursion while it is read).
MAX_SPEC_DEPTH = 64

_INT = "tag:yaml.org,2002:int"
_FLOAT = "tag:yaml.org,2002:float"
_MERGE = "tag:yaml.org,2002:merge"
#: A plain scalar that YAML 1.1 reads as a number and YAML 1.2 does not (or as another one).
_AMBIGUOUS = "tag:ppokit,2025:ambiguous-number"

#: The numbers of YAML 1.2's core schema: decimal, 0o octal and 0x hexadecimal integers;
#: floats with an optional exponent (``1e-5``); ``.inf``, ``.nan``. No sexagesimal (``1:00``),
#: no leading-zero octal (``010``), no ``0b`` binary, no ``_`` separators: YAML 1.1 forms.
_YAML12_NUMBERS: tuple[tuple[str, str, str], ...] = (
    (_INT, r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$", "-+0123456789"),
    (
        _FLOAT,
        r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
        r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$",
        "-+.0123456789",
    ),
)


@dataclass(frozen=True)
class _Yaml11Number:
    """A plain scalar read differently by YAML 1.1 and 1.2 (refused, naming its path)."""

    text: str
    yaml11: int | float
    yaml12: int | float | str

    def problem(self) -> str:
        if isinstance(self.yaml12, str):
            return (
                f"{self.text} is the number {self.yaml11!r} in YAML 1.1 and text in YAML 1.2: "
                f"write {self.yaml11!r} for the number, or quote '{self.text}' for text"
            )
        return (
            f"{self.text} is ambiguous: YAML 1.1 reads it as {self.yaml11!r}, YAML 1.2 as "
            f"{self.yaml12!r}: write {self.yaml12!r} or {self.yaml11!r}, whichever you mean"
        )


def _int12(text: str) -> int:
    sign, digits = (-1, text[1:]) if text[:1] == "-" else (1, text.lstrip("+"))
    base = {"0x": 16, "0o": 8}.get(digits[:2])
    return sign * (int(digits[2:], base) if base else int(digits))


class _SpecLoader(yaml.SafeLoader):
    """safe_load with YAML 1.2's numbers (a YAML 1.1 number that 1.2 reads otherwise, such
    as ``010`` or ``1:00``, is kept aside to be refused), no duplicate keys (keys merged
    with ``<<`` may be overridden, as YAML specifies) and nesting bounded by MAX_SPEC_DEPTH."""

    yaml_implicit_resolvers: ClassVar[dict[str, list[tuple[str, re.Pattern[str]]]]] = {
        first: [(tag, rx) for tag, rx in resolvers if tag not in (_INT, _FLOAT)]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        self._depth += 1
        try:
            if self._depth > MAX_SPEC_DEPTH:
                raise yaml.composer.ComposerError(
                    None,
                    None,
                    f"nested deeper than {MAX_SPEC_DEPTH} levels",
                    self.peek_event().start_mark,
                )
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def resolve(self, kind: Any, value: Any, implicit: Any) -> str:
        tag = super().resolve(kind, value, implicit)
        if kind is yaml.ScalarNode and implicit[0] and self.yaml11_reading(value) is not None:
            return _AMBIGUOUS
        return tag

    def yaml11_reading(self, text: str) -> _Yaml11Number | None:
        """``text`` as a :class:`_Yaml11Number` when YAML 1.1 reads it as a number that
        YAML 1.2 reads otherwise; else None."""
        old_tag = next(
            (
                tag
                for tag, pattern in yaml.SafeLoader.yaml_implicit_resolvers.get(text[:1], [])
                if pattern.match(text)
            ),
            None,
        )
        if old_tag not in (_INT, _FLOAT):
            return None
        node = yaml.ScalarNode(old_tag, text)
        try:
            old = (
                self.construct_yaml_int(node)
                if old_tag == _INT
                else self.construct_yaml_float(node)
            )
        except ValueError:  # '0x_': YAML 1.1's pattern, but no number
            return None
        new: int | float | str = text
        for tag, pattern, _ in _YAML12_NUMBERS:
            if re.match(pattern, text):
                node = yaml.ScalarNode(tag, text)
                new = _int12(text) if tag == _INT else self.construct_yaml_float(node)
                break
        same = type(new) is type(old) and (new == old or (new != new and old != old))
        return None if same else _Yaml11Number(text, old, new)


for _tag, _pattern, _first in _YAML12_NUMBERS:
    _SpecLoader.add_implicit_resolver(_tag, re.compile(_pattern), list(_first))


def _ambiguous_number(loader: _SpecLoader, node: yaml.ScalarNode) -> _Yaml11Number:
    found = loader.yaml11_reading(node.value)
    if found is None:  # an explicit tag: !<tag:ppokit,2025:ambiguous-number> 1
        raise yaml.constructor.ConstructorError(
            None, None, f"unknown tag {node.tag!r}", node.start_mark
        )
    return found


def _mapping_without_duplicates(loader: _SpecLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    """A mapping whose keys, as written, are unique; keys merged in by ``<<`` may be
    written again (the written key wins, as YAML's merge key specifies)."""
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = "<<" if key_node.tag == _MERGE else loader.construct_object(key_node, deep=True)
        try:
            hash(key)
        except TypeError:
            raise yaml.constructor.ConstructorError(
                None, None, "a mapping key must be a scalar", key_node.start_mark
            ) from None
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"duplicate key {key!r} (first on line {seen[key] + 1})",
                key_node.start_mark,
            )
        seen[key] = key_node.start_mark.line
    loader.flatten_mapping(node)
    return loader.construct_mapping(node, deep=True)


_SpecLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_without_duplicates
)
_SpecLoader.add_constructor(_INT, lambda loader, node: _int12(loader.construct_scalar(node)))
_SpecLoader.add_constructor(_AMBIGUOUS, _ambiguous_number)


def measure(node: Any, budget: int) -> tuple[int, int]:
    """(nodes, depth) of a loaded value, shared (aliased) nodes counted each time; stops
    past ``budget`` nodes or MAX_SPEC_DEPTH levels."""
    stack, count, depth = [(node, 1)], 0, 0
    while stack and count <= budget and depth <= MAX_SPEC_DEPTH:
        item, level = stack.pop()
        count += 1
        depth = max(depth, level)
        if isinstance(item, dict):
            stack.extend((k, level + 1) for k in item)
            stack.extend((v, level + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, level + 1) for v in item)
    return count, depth


def _ambiguous_numbers(node: Any, path: str) -> Iterator[str]:
    """``path: problem`` for every YAML 1.1 number in a loaded value (keys included)."""
    stack = [(node, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, _Yaml11Number):
            yield f"{where}: {item.problem()}" if where else item.problem()
        elif isinstance(item, dict):
            for key, value in item.items():
                here = f"{where}.{key}" if where else str(key)
                if isinstance(key, _Yaml11Number):
                    stack.append((key, where))
                stack.append((value, here))
        elif isinstance(item, list):
            stack.extend((v, f"{where}.{i}" if where else str(i)) for i, v in enumerate(item))


def load_yaml(text: str, path: str = "") -> Any:
    """``text`` read by :class:`_SpecLoader`; SpecError (one line each) for invalid YAML, too
    many nodes or levels, and YAML 1.1 numbers (named by their path below ``path``)."""
    try:
        data = yaml.load(text, Loader=_SpecLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}: " if mark is not None and not path else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise SpecError([f"{where}invalid YAML: {problem}"]) from None
    except RecursionError:  # aliases of deep nodes inside deep nodes
        raise SpecError([f"invalid YAML: nested deeper than {MAX_SPEC_DEPTH} levels"]) from None
    nodes, depth = measure(data, MAX_SPEC_NODES)
    if nodes > MAX_SPEC_NODES:
        raise SpecError([f"the spec expands to more than {MAX_SPEC_NODES} values (YAML aliases)"])
    if depth > MAX_SPEC_DEPTH:
        raise SpecError([f"the spec nests deeper than {MAX_SPEC_DEPTH} levels"])
    ambiguous = sorted(_ambiguous_numbers(data, path))
    if ambiguous:
        raise SpecError(ambiguous)
    return data


def parse_spec_text(text: str, source: str | None = None) -> dict[str, Any]:
    """A spec mapping from YAML text: safe YAML with YAML 1.2's numbers, no duplicate keys,
    aliases and nesting bounded."""
    try:
        data = load_yaml(text)
    except SpecError as exc:
        raise SpecError(exc.errors, source=source) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise SpecError([f"the spec must be a mapping, got {type(data).__name__}"], source=source)
    return data


def read_spec_file(path: str | Path) -> dict[str, Any]:
    """The mapping of a spec file: at most MAX_SPEC_BYTES of UTF-8 YAML (parse_spec_text)."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_SPEC_BYTES + 1)
    except FileNotFoundError:
        raise SpecError(["file not found"], source=str(path)) from None
    except IsADirectoryError:
        raise SpecError(["is a directory, not a spec file"], source=str(path)) from None
    except OSError as exc:
        raise SpecError([exc.strerror or str(exc)], source=str(path)) from None
    if len(raw) > MAX_SPEC_BYTES:
        raise SpecError(
            [f"larger than {MAX_SPEC_BYTES // 1024} KiB: not a spec file"], source=str(path)
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpecError(
            [f"not UTF-8 text (byte {exc.start}): not a spec file"], source=str(path)
        ) from None
    return parse_spec_text(text, source=str(path))


#: The packaged demo spec, what ``ppokit train`` and ``ppokit eval MODEL`` run without one.
DEMO_SPEC = "ppokit/specs/demo.yaml"
#: How a message about the packaged demo spec names it.
DEMO_SOURCE = DEMO_SPEC.rsplit("/", 1)[1]


def read_demo_spec() -> dict[str, Any]:
    """The packaged demo spec's mapping (``DEMO_SPEC``, read as a spec file is)."""
    from importlib.resources import files

    from ppokit.errors import UserError

    resource = files("ppokit").joinpath(*DEMO_SPEC.split("/")[1:])
    if not resource.is_file():
        raise UserError(f"the packaged demo spec {DEMO_SPEC} is missing")
    return parse_spec_text(resource.read_text(), DEMO_SOURCE)
