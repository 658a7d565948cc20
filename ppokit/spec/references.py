"""``${...}`` values in a spec: a value read from the merged spec (or its defaults), with
``+ - * / //`` and numbers, so that a variant can follow the task's generation budget
(``${rollout.max_new_tokens}``, ``${(rollout.max_new_tokens + 4) // 5}``). Computed once
each, cycles and anything but paths, numbers and arithmetic refused. Nothing here imports
torch."""

from __future__ import annotations

import ast
import copy
import operator
import re
from collections.abc import Callable, Iterator
from typing import Any

from ppokit.spec.models import Spec, SpecError

__all__ = ["MAX_REFERENCE_VALUE", "REFERENCE", "resolve_references"]

#: A value read from the merged spec: ``${path}`` or ``${arithmetic over paths}``.
REFERENCE = re.compile(r"^\$\{(.{1,200})\}$", re.S)
#: No number a reference computes is larger than this (a spec's values are far smaller).
MAX_REFERENCE_VALUE = 1e18
_OPERATORS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
}


def _lookup(data: Any, path: str) -> tuple[bool, Any]:
    node = data
    for part in path.split("."):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return False, None
    return True, node


def _default(path: str) -> Any:
    """The value ``path`` has in a spec that sets nothing (KeyError if it names none)."""
    node: Any = Spec()
    for part in path.split("."):
        fields = getattr(type(node), "model_fields", None)
        if fields is None or part not in fields:
            raise KeyError(path)
        node = getattr(node, part)
    if getattr(type(node), "model_fields", None) is not None:
        raise KeyError(path)
    return node


def _path_of(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _path_of(node.value)
        return None if head is None else f"{head}.{node.attr}"
    return None


class _References:
    """The ``${...}`` values of one merged mapping, computed once each, cycles refused."""

    def __init__(self, data: dict[str, Any]) -> None:
        self.data = data
        self.done: dict[str, Any] = {}

    def value(self, path: str, stack: tuple[str, ...]) -> Any:
        if path in stack:
            raise ValueError("refers to itself through " + " -> ".join((*stack, path)))
        found, value = _lookup(self.data, path)
        if not found:
            try:
                return _default(path)
            except KeyError:
                raise ValueError(f"{path} is not a value of the spec") from None
        if isinstance(value, str) and REFERENCE.match(value):
            if path not in self.done:
                self.done[path] = self.compute(value, (*stack, path))
            return self.done[path]
        return value

    def compute(self, text: str, stack: tuple[str, ...]) -> Any:
        match = REFERENCE.match(text)
        assert match is not None
        try:
            tree = ast.parse(match.group(1).strip(), mode="eval")
        except SyntaxError:
            raise ValueError(f"{text}: not a path or arithmetic over paths") from None
        if sum(1 for _ in ast.walk(tree)) > 64:
            raise ValueError(f"{text}: too long an expression")
        return self.evaluate(tree.body, stack, text)

    def evaluate(self, node: ast.AST, stack: tuple[str, ...], text: str) -> Any:
        path = _path_of(node)
        if path is not None:
            return self.value(path, stack)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            number = self.number(node.operand, stack, text)
            return -number if isinstance(node.op, ast.USub) else number
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            left, right = self.number(node.left, stack, text), self.number(node.right, stack, text)
            if right == 0 and isinstance(node.op, (ast.Div, ast.FloorDiv)):
                raise ValueError(f"{text}: division by zero")
            result = _OPERATORS[type(node.op)](left, right)
            if abs(result) > MAX_REFERENCE_VALUE:
                raise ValueError(f"{text}: {result:g} is out of range")
            return result
        raise ValueError(f"{text}: only spec paths, numbers and + - * / // are allowed")

    def number(self, node: ast.AST, stack: tuple[str, ...], text: str) -> int | float:
        value = self.evaluate(node, stack, text)
        if type(value) not in (int, float):
            raise ValueError(f"{text}: {ast.unparse(node)} is {value!r}, not a number")
        return value  # type: ignore[no-any-return]


def _strings(node: Any, at: str) -> Iterator[tuple[str, Any, Any]]:
    """(path, container, key) of every string value in a mapping."""
    items = node.items() if isinstance(node, dict) else enumerate(node)
    for key, value in items:
        path = f"{at}.{key}" if at else str(key)
        if isinstance(value, str):
            yield path, node, key
        elif isinstance(value, (dict, list)):
            yield from _strings(value, path)


def resolve_references(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with every ``${...}`` value computed from the merged mapping (module
    docstring); SpecError with one ``path: problem`` line each."""
    if "${" not in repr(data):
        return data
    data = copy.deepcopy(data)
    refs, errors = _References(data), []
    found = [(p, c, k) for p, c, k in _strings(data, "") if REFERENCE.match(c[k])]
    values = {}
    for path, _, _ in found:
        try:
            values[path] = refs.value(path, ())
        except ValueError as exc:
            errors.append(f"{path}: {exc}")
    if errors:
        raise SpecError(errors)
    for path, container, key in found:
        container[key] = values[path]
    return data
