"""A check of the ``code_tests`` reward (:mod:`ppokit.components.reward.sandbox`) evaluated
in ppokit's own process: the part of a test's ``assert`` that ppokit keeps (comparisons,
``and``/``or``/``not``, arithmetic, the test's constants, a few pure built-ins), with its
queries' leaves (:class:`Query`) given the plain values the sandbox answered. Each operation
is refused (the test fails) where its cost would not be bounded by its operands'.

It imports only the tagged encoding (:mod:`~ppokit.components.reward.tagged_values`): never
the splitting of tests (:mod:`~ppokit.components.reward.plans`), the harness or the sandbox.
"""

from __future__ import annotations

import ast
import itertools
import math
from collections.abc import Callable
from typing import Any

from ppokit.components.reward.tagged_values import refuse_shared_hashes

#: The largest int (in bits) the check's arithmetic makes (1/16 of it: divides or writes
#: out), and the most items it makes a sequence of: bounds on its time.
MAX_BITS = 1 << 20


class _Failed(Exception):
    """A check cannot be evaluated (a query without a value, an operation refused)."""


class Query(ast.expr):
    """A leaf of a check answered by the sandbox: the test's query number ``index``."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index


class Held(ast.expr):
    """A leaf of a check whose value ppokit holds (a test's constant, a built-in type)."""

    def __init__(self, value: Any) -> None:
        super().__init__()
        self.value = value


#: A query that raised in the sandbox, or whose answer did not decode.
NO_VALUE = object()
_NUMBERS = (bool, int, float, complex)
_SEQUENCES = (str, bytes, list, tuple)
TYPES: dict[str, type] = {
    t.__name__: t
    for t in (int, float, complex, str, bytes, bool, list, tuple, dict, set, frozenset, type)
}
_COMPARE: dict[type[ast.cmpop], Callable[[Any, Any], Any]] = {
    ast.Eq: lambda a, b: a == b,
    ast.NotEq: lambda a, b: a != b,
    ast.Lt: lambda a, b: a < b,
    ast.LtE: lambda a, b: a <= b,
    ast.Gt: lambda a, b: a > b,
    ast.GtE: lambda a, b: a >= b,
    ast.Is: lambda a, b: a is b,
    ast.IsNot: lambda a, b: a is not b,
    ast.In: lambda a, b: a in b,
    ast.NotIn: lambda a, b: a not in b,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {
    ast.Not: lambda a: not a,
    ast.USub: lambda a: -_number(a),
    ast.UAdd: lambda a: +_number(a),
    ast.Invert: lambda a: ~_number(a),
}


def _number(value: Any) -> Any:
    if not isinstance(value, _NUMBERS):
        raise _Failed("not a number")
    return value


def _small(*values: Any) -> None:
    """Refuse ints too large for an operation quadratic in their size (division, str)."""
    if any(isinstance(v, int) and v.bit_length() > MAX_BITS >> 4 for v in values):
        raise _Failed("too large")


def _binop(op: ast.operator, a: Any, b: Any) -> Any:
    """``a op b`` on plain values, refused where its cost would not be bounded by theirs."""
    if isinstance(op, ast.Add):
        if isinstance(a, _NUMBERS) and isinstance(b, _NUMBERS):
            return a + b
        if type(a) is type(b) and isinstance(a, _SEQUENCES):
            return a + b
        raise _Failed("unsupported +")
    if isinstance(op, ast.Mult):
        if isinstance(a, _SEQUENCES) or isinstance(b, _SEQUENCES):
            seq, times = (a, b) if isinstance(a, _SEQUENCES) else (b, a)
            if type(times) is not int or len(seq) * max(times, 0) > MAX_BITS:
                raise _Failed("unsupported *")
            return seq * times
        _number(a), _number(b)
        if isinstance(a, int) and isinstance(b, int) and a.bit_length() + b.bit_length() > MAX_BITS:
            raise _Failed("too large")
        return a * b
    a, b = _number(a), _number(b)
    if isinstance(op, ast.Pow):
        big = isinstance(a, int) and isinstance(b, int) and b > 0 and abs(a) > 1
        if big and a.bit_length() * b > MAX_BITS:
            raise _Failed("too large")
        return a**b
    operations: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
        ast.Sub: lambda x, y: x - y,
        ast.Div: lambda x, y: x / y,
        ast.FloorDiv: lambda x, y: x // y,
        ast.Mod: lambda x, y: x % y,
    }
    if type(op) not in operations:
        raise _Failed("unsupported operator")
    if not isinstance(op, ast.Sub):
        _small(a, b)
    return operations[type(op)](a, b)


def _sum(values: Any, start: Any = 0) -> Any:
    items = list(values)
    if not all(isinstance(v, _NUMBERS) for v in [*items, start]):
        raise _Failed("sum of non-numbers")
    _small(*items, start)
    return sum(items, start)


def _round(value: Any, ndigits: Any = None) -> Any:
    if ndigits is not None and (type(ndigits) is not int or abs(ndigits) > 1000):
        raise _Failed("unsupported round")
    _small(value)
    return round(_number(value), ndigits)


def _str(value: Any) -> str:
    if not isinstance(value, (*_NUMBERS, str, bytes, type(None))):
        raise _Failed("str of a container")
    _small(value)
    return str(value)


def _int(value: Any, *base: Any) -> int:
    if isinstance(value, (str, bytes)) and len(value) > 4000:
        raise _Failed("too long")
    return int(value, *base)


def _isinstance(value: Any, kinds: Any) -> bool:
    members = kinds if isinstance(kinds, tuple) else (kinds,)
    if not all(isinstance(k, type) for k in members):
        raise _Failed("isinstance of a non-type")
    return isinstance(value, kinds)


def _type(value: Any) -> type:
    return type(value)


def _finite(value: Any) -> Any:
    """A lazy iterable (``range``, ``zip``, ...) as a list of at most MAX_BITS items."""
    if isinstance(value, (range, zip, enumerate, reversed)):
        items = list(itertools.islice(value, MAX_BITS + 1))
        if len(items) > MAX_BITS:
            raise _Failed("too long")
        return items
    return value


def _spread_out(items: Any) -> list[Any]:
    """``items`` as a list, refused where building a set of them would be quadratic."""
    items = list(items)
    try:
        refuse_shared_hashes(items)
    except ValueError:
        raise _Failed("too many equal hashes") from None
    return items


def _over(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` with its first argument (if any) made finite."""

    def bounded(*args: Any, **kwargs: Any) -> Any:
        return function(*(_finite(a) if i == 0 else a for i, a in enumerate(args)), **kwargs)

    return bounded


#: The built-ins a check may call, evaluated here (a test of a function the program names
#: like one of these is checked with the built-in).
FUNCTIONS: dict[str, Callable[..., Any]] = {
    "abs": lambda v: abs(_number(v)),
    "len": len,
    "round": _round,
    "sorted": _over(sorted),
    "min": _over(min),
    "max": _over(max),
    "sum": _over(_sum),
    "any": _over(any),
    "all": _over(all),
    "isinstance": _isinstance,
    "type": _type,
    "zip": zip,
    "enumerate": enumerate,
    "reversed": reversed,
    "int": _int,
    "float": float,
    "complex": complex,
    "str": _str,
    "bool": bool,
    "list": _over(list),
    "tuple": _over(tuple),
    "set": _over(lambda items=(): set(_spread_out(items))),
    "frozenset": _over(lambda items=(): frozenset(_spread_out(items))),
    "range": range,
    "math.isclose": math.isclose,
    "math.isnan": math.isnan,
    "math.isinf": math.isinf,
    "math.isfinite": math.isfinite,
    "math.fabs": math.fabs,
    "math.floor": lambda v: math.floor(_number(v)),
    "math.ceil": lambda v: math.ceil(_number(v)),
    "math.sqrt": math.sqrt,
}


def evaluate(node: ast.expr, values: dict[int, Any]) -> Any:
    """``node`` (a check) with Python's semantics (``and``/``or`` short-circuit) on the
    queries' ``values``; raises on a query without a value, as Python would on its error."""
    if isinstance(node, Query):
        value = values.get(node.index, NO_VALUE)
        if value is NO_VALUE:
            raise _Failed("no value")
        return value
    if isinstance(node, Held):
        return node.value
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.BoolOp):
        result = evaluate(node.values[0], values)
        for operand in node.values[1:]:
            if bool(result) != isinstance(node.op, ast.And):
                return result
            result = evaluate(operand, values)
        return result
    if isinstance(node, ast.Compare):
        left = evaluate(node.left, values)
        for op, comparator in zip(node.ops, node.comparators, strict=True):
            right = evaluate(comparator, values)
            if not _COMPARE[type(op)](left, right):
                return False
            left = right
        return True
    if isinstance(node, ast.UnaryOp):
        return _UNARY[type(node.op)](evaluate(node.operand, values))
    if isinstance(node, ast.BinOp):
        return _binop(node.op, evaluate(node.left, values), evaluate(node.right, values))
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        items = [evaluate(e, values) for e in node.elts]
        kind = {ast.Tuple: tuple, ast.List: list, ast.Set: set}[type(node)]
        return kind(items)
    if isinstance(node, ast.Dict):
        out = {}
        for key, value in zip(node.keys, node.values, strict=True):
            assert key is not None  # a ** entry is a query, never a check
            out[evaluate(key, values)] = evaluate(value, values)
        return out
    if isinstance(node, ast.Subscript):
        return evaluate(node.value, values)[evaluate(node.slice, values)]
    if isinstance(node, ast.Slice):
        parts = (node.lower, node.upper, node.step)
        return slice(*(None if p is None else evaluate(p, values) for p in parts))
    if isinstance(node, ast.Call):
        name = callee(node)
        function = FUNCTIONS[name]
        args = [evaluate(a, values) for a in node.args]
        kwargs = {k.arg: evaluate(k.value, values) for k in node.keywords if k.arg}
        return function(*args, **kwargs)
    raise _Failed(f"not a check: {type(node).__name__}")


def callee(node: ast.Call) -> str:
    """``name`` or ``math.name`` of a call's function, else ""."""
    func = node.func
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        return f"{func.value.id}.{func.attr}"
    return ""
