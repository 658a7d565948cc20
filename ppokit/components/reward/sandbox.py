"""The ``code_tests`` reward (catalogue: :mod:`ppokit.components.reward`): each response's
Python program run against its row's tests in a sandbox, scored by the fraction of the
tests it passes.

The verdict is never the sandbox's. Each test (a Python statement or several) is parsed
here, in ppokit's own process, which never runs the program: every top-level ``assert`` is
split into its *check* (comparisons, ``and``/``or``/``not``, arithmetic, the test's
constants and their items, a few pure built-ins such as ``abs``, ``len``, ``sorted``,
``math.isclose``) with its literal operands, kept here, and its *queries*, the other operands (``square(3)``), whose source alone goes
into the sandbox. A test's other statements go in as setup. The sandbox answers each query
with its value in a tagged encoding of plain built-in values (:data:`HARNESS`); ppokit
decodes them and evaluates each check itself. A program that subverts the harness, writes
on its channel or returns an object equal to everything can only ever answer the questions:
it never sees an expected value (no test, file or process in the sandbox holds one), and
only plain data crosses. What this does not cover (a test with no top-level ``assert``, a
check that compares queries only with each other) is flagged ``forgeable``; docs/rewards.md
has the table of attacks tried.

The sandbox is bubblewrap's (``bwrap``): new user, PID, network, IPC, UTS and cgroup
namespaces (no network but its own loopback; no process outside it visible or signalled),
a read-only root holding only ``/usr`` (the interpreter), ``/proc``, a few devices and the
harness at ``/task``; its one writable file system is ``/work``, of ``disk_mb`` (``/tmp``
and ``/dev/shm`` are folders in it), and a seccomp filter refuses memory no file system
bounds (a user namespace of its own, System V shared memory, memfds; :data:`_SYSCALLS`).
It ends with the process that started it.
Run by root, it runs as ``nobody``. Inside, the harness sets the resource limits (CPU
seconds and address space per process, processes, file size, open files; counted in the
sandbox's namespace), reads the program and the questions from its stdin (then empty),
runs the program once, then each test in a fresh fork of it (a crash or exit costs that
test alone), which sends its answers on a pipe as it goes. A wall-clock timeout kills the
whole sandbox; the tests answered before it still count.

Where bubblewrap is missing (or cannot make namespaces here) the reward refuses to start,
unless the spec sets ``unsafe: true`` and the environment ``PPOKIT_UNSAFE_CODE=1``: then the
same harness runs with the resource limits in a fresh folder and its own process group,
without OS isolation; the verdict is still ppokit's, but a program run as ppokit's own user
could read the expected values from ppokit's memory.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import errno
import functools
import inspect
import itertools
import json
import math
import os
import re
import resource
import selectors
import shutil
import signal
import struct
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ppokit.bounded import in_threads
from ppokit.components.reward import CODE_TESTS, Scored
from ppokit.errors import UserError, one_line

__all__ = ["HARNESS", "UNSAFE_ENV", "CodeTestsReward", "extract_program", "sandbox_problem"]

#: The environment variable a run sets to let ``unsafe: true`` run programs unisolated.
UNSAFE_ENV = "PPOKIT_UNSAFE_CODE"
#: The user a sandbox runs as when ppokit runs as root.
NOBODY = 65534
#: The most bytes of answers read from one sandbox (and the most one answer may take).
REPORT_BYTES = 1 << 20
#: The deepest nesting of lists, tuples, dicts and sets an answer may have.
MAX_DEPTH = 100
#: The most files a sandboxed process may hold open (RLIMIT_NOFILE).
OPEN_FILES = 256
#: The largest int (in bits) the check's arithmetic makes (1/16 of it: divides or writes
#: out), and the most items it makes a sequence of: bounds on its time.
MAX_BITS = 1 << 20
#: The most statements a test's loops over constants and inlined functions unroll to.
MAX_UNROLLED = 2000

# --- the encoding of values: the only thing that crosses out of the sandbox ------------------
# Both functions run in the sandbox too (their source is part of HARNESS): they may use only
# builtins and the constants above.


def _encode(value: Any, budget: list[int], depth: int = 0) -> list[Any]:
    """``value`` as JSON-able tagged data of plain built-in values: None, bool, int,
    float, complex, str, bytes, list, tuple, dict, set, frozenset, nested at most MAX_DEPTH
    deep; a subclass of one of them (a bytearray too) as its built-in base, read with the
    base's own methods (its ``__eq__`` stays behind). Anything else, or more than
    ``budget[0]`` characters, raises ValueError."""
    if depth > MAX_DEPTH:
        raise ValueError("nested too deep")
    budget[0] -= 8
    tagged: list[Any]
    if value is None:
        tagged = ["n"]
    elif value is True or value is False:
        tagged = ["b", value is True]
    elif isinstance(value, int):
        tagged = ["i", hex(int.__index__(value))]
    elif isinstance(value, float):
        tagged = ["f", float.hex(value)]
    elif isinstance(value, complex):
        real, imag = complex.real.__get__, complex.imag.__get__  # type: ignore[attr-defined]
        tagged = ["c", [float.hex(real(value)), float.hex(imag(value))]]
    elif isinstance(value, str):
        tagged = ["s", str.__str__(value)]
    elif isinstance(value, bytes):
        tagged = ["y", bytes.hex(value)]
    elif isinstance(value, bytearray):
        tagged = ["y", bytearray.hex(value)]
    elif isinstance(value, dict):
        pairs = dict.items(value)
        tagged = [
            "d",
            [[_encode(k, budget, depth + 1), _encode(v, budget, depth + 1)] for k, v in pairs],
        ]
    else:
        for kind, tag in ((list, "l"), (tuple, "t"), (set, "S"), (frozenset, "F")):
            if isinstance(value, kind):
                members = kind.__iter__(value)  # type: ignore[attr-defined,arg-type]
                return [tag, [_encode(v, budget, depth + 1) for v in members]]
        raise ValueError("not a plain value: " + type(value).__name__)
    if len(tagged) == 2 and isinstance(tagged[1], str):
        budget[0] -= len(tagged[1])
    if budget[0] < 0:
        raise ValueError("too large")
    return tagged


def _decode(data: Any, depth: int = 0) -> Any:
    """The plain value ``data`` (from :func:`_encode`, via ``json.loads``) stands for; builds
    only built-in values and runs no other code. Malformed data raises ValueError (or
    TypeError: an unhashable member of a set or key of a dict)."""
    if depth > MAX_DEPTH:
        raise ValueError("nested too deep")
    if type(data) is not list or not data or type(data[0]) is not str:
        raise ValueError("not an encoded value")
    tag = data[0]
    if tag == "n" and len(data) == 1:
        return None
    if len(data) != 2:
        raise ValueError("not an encoded value")
    arg = data[1]
    if tag == "b" and type(arg) is bool:
        return arg
    if tag in ("i", "f", "s", "y") and type(arg) is str:
        if tag == "i":
            return int(arg, 16)  # base 16: linear time whatever its length
        if tag == "f":
            return float.fromhex(arg)
        return arg if tag == "s" else bytes.fromhex(arg)
    if type(arg) is not list:
        raise ValueError("not an encoded value")
    if tag == "c" and len(arg) == 2 and type(arg[0]) is str and type(arg[1]) is str:
        return complex(float.fromhex(arg[0]), float.fromhex(arg[1]))
    if tag == "d":
        pairs = []
        for pair in arg:
            if type(pair) is not list or len(pair) != 2:
                raise ValueError("not an encoded value")
            pairs.append((_decode(pair[0], depth + 1), _decode(pair[1], depth + 1)))
        _spread([key for key, _ in pairs])
        return dict(pairs)
    kinds: dict[str, Callable[[list[Any]], Any]] = {
        "l": list,
        "t": tuple,
        "S": set,
        "F": frozenset,
    }
    if tag in kinds:
        items = [_decode(item, depth + 1) for item in arg]
        if tag in ("S", "F"):
            _spread(items)
        return kinds[tag](items)
    raise ValueError("not an encoded value")


def _spread(items: list[Any]) -> None:
    """Refuse members of a set (keys of a dict) many of which share a hash (ints chosen
    equal modulo 2**61 - 1 would make building it quadratic)."""
    if len(items) - len({hash(item) for item in items}) > 64:
        raise ValueError("too many equal hashes")


_HARNESS_MAIN = """\
import json, os, resource


def _send(fd, message):
    data = json.dumps(message, separators=(",", ":")).encode() + b"\\n"
    if len(data) > REPORT_BYTES:  # it could not be read: its number alone
        data = json.dumps(message[:2]).encode() + b"\\n"
    while data:
        data = data[os.write(fd, data):]


def _test(fd, t, items, space):
    name = "test_%d" % t
    for item in items:
        if item[0] == "x":  # setup: an exception ends the test (no "done")
            exec(compile(item[1], name, "exec"), space)
        elif item[0] == "b":  # a constant the test's code names
            space[item[1]] = _decode(item[2])
        else:  # a query: its value, or only its number when it raised or cannot cross
            try:
                value = eval(compile(item[2], name, "eval"), space)
                message = [t, item[1], _encode(value, [REPORT_BYTES])]
            except BaseException:
                message = [t, item[1]]
            _send(fd, message)
    _send(fd, [t])


def _main():
    chunks = []
    while True:
        chunk = os.read(0, 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
    request = json.loads(b"".join(chunks))
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for name, value in request["limits"].items():
        resource.setrlimit(getattr(resource, name), (value, value))
    fd, tests = request["fd"], request["tests"]
    space = {"__name__": "solution"}
    try:
        exec(compile(request["program"], "program.py", "exec"), space)
    except BaseException:
        return
    for t, items in enumerate(tests):
        if items is None:
            continue
        try:
            pid = os.fork()
        except OSError:  # the program holds every process it may have
            continue
        if pid == 0:
            try:
                _test(fd, t, items, space)
            finally:
                os._exit(0)
        try:
            os.waitpid(pid, 0)
        except OSError:  # reaped already (the program ignores SIGCHLD)
            pass


_main()
os._exit(0)
"""

#: What runs inside the sandbox (``python -I harness.py``): it reads
#: ``{"limits", "fd", "program", "tests"}`` as JSON on its stdin, each test a list of items
#: ``["x", setup source]``, ``["b", name, encoded value]``, ``["q", k, query source]``, and
#: writes one JSON line per answer on the pipe ``fd``: ``[test, k, encoded value]``,
#: ``[test, k]`` (the query raised or its value cannot cross), ``[test]`` (the test's end).
HARNESS = "\n\n".join(
    [
        "from __future__ import annotations",
        f"MAX_DEPTH = {MAX_DEPTH}\nREPORT_BYTES = {REPORT_BYTES}",
        inspect.getsource(_encode),
        inspect.getsource(_decode),
        inspect.getsource(_spread),
        _HARNESS_MAIN,
    ]
)

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_program(response: str) -> str:
    """The last fenced code block of ``response`` (```python, ```py or bare), or all of it."""
    blocks = _FENCE.findall(response)
    return blocks[-1] if blocks else response


# --- the checks: evaluated here, on decoded plain values --------------------------------------


class _Failed(Exception):
    """A check cannot be evaluated (a query without a value, an operation refused)."""


class _Query(ast.expr):
    """A leaf of a check answered by the sandbox: the test's query number ``index``."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index


class _Held(ast.expr):
    """A leaf of a check whose value ppokit holds (a test's constant, a built-in type)."""

    def __init__(self, value: Any) -> None:
        super().__init__()
        self.value = value


_ERROR = object()  # a query that raised in the sandbox, or whose answer did not decode
_NUMBERS = (bool, int, float, complex)
_SEQUENCES = (str, bytes, list, tuple)
_TYPES: dict[str, type] = {
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
        _spread(items)
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
_FUNCTIONS: dict[str, Callable[..., Any]] = {
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


def _evaluate(node: ast.expr, values: dict[int, Any]) -> Any:
    """``node`` (a check) with Python's semantics (``and``/``or`` short-circuit) on the
    queries' ``values``; raises on a query without a value, as Python would on its error."""
    if isinstance(node, _Query):
        value = values.get(node.index, _ERROR)
        if value is _ERROR:
            raise _Failed("no value")
        return value
    if isinstance(node, _Held):
        return node.value
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.BoolOp):
        result = _evaluate(node.values[0], values)
        for operand in node.values[1:]:
            if bool(result) != isinstance(node.op, ast.And):
                return result
            result = _evaluate(operand, values)
        return result
    if isinstance(node, ast.Compare):
        left = _evaluate(node.left, values)
        for op, comparator in zip(node.ops, node.comparators, strict=True):
            right = _evaluate(comparator, values)
            if not _COMPARE[type(op)](left, right):
                return False
            left = right
        return True
    if isinstance(node, ast.UnaryOp):
        return _UNARY[type(node.op)](_evaluate(node.operand, values))
    if isinstance(node, ast.BinOp):
        return _binop(node.op, _evaluate(node.left, values), _evaluate(node.right, values))
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        items = [_evaluate(e, values) for e in node.elts]
        kind = {ast.Tuple: tuple, ast.List: list, ast.Set: set}[type(node)]
        return kind(items)
    if isinstance(node, ast.Dict):
        out = {}
        for key, value in zip(node.keys, node.values, strict=True):
            assert key is not None  # a ** entry is a query, never a check
            out[_evaluate(key, values)] = _evaluate(value, values)
        return out
    if isinstance(node, ast.Subscript):
        return _evaluate(node.value, values)[_evaluate(node.slice, values)]
    if isinstance(node, ast.Slice):
        parts = (node.lower, node.upper, node.step)
        return slice(*(None if p is None else _evaluate(p, values) for p in parts))
    if isinstance(node, ast.Call):
        name = _callee(node)
        function = _FUNCTIONS[name]
        args = [_evaluate(a, values) for a in node.args]
        kwargs = {k.arg: _evaluate(k.value, values) for k in node.keywords if k.arg}
        return function(*args, **kwargs)
    raise _Failed(f"not a check: {type(node).__name__}")


def _callee(node: ast.Call) -> str:
    """``name`` or ``math.name`` of a call's function, else ""."""
    func = node.func
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        return f"{func.value.id}.{func.attr}"
    return ""


def _names(node: ast.AST) -> set[str]:
    """Every name ``node``'s code spells (used, bound, declared, imported, a parameter, a
    pattern's capture): a superset of those it can reach without a string."""
    found: set[str] = set()
    for sub in ast.walk(node):
        for key in ("id", "name", "arg", "asname", "rest"):
            value = getattr(sub, key, None)
            if isinstance(value, str):
                found.add(value.split(".")[0])
        if isinstance(sub, (ast.Global, ast.Nonlocal)):
            found.update(sub.names)
    return found


@dataclass
class _Plan:
    """One test, split: ``items`` go to the sandbox (None: the test cannot run, e.g. a
    syntax error), ``checks`` stay here; ``forgeable``: a verdict the program could decide
    without the test's computation (no top-level assert, an assert or raise in its setup,
    or a comparison of queries only with each other)."""

    items: list[list[Any]] | None = field(default_factory=list)
    checks: list[ast.expr] = field(default_factory=list)
    queries: int = 0
    forgeable: bool = False

    def passed(self, values: dict[int, Any], done: bool) -> bool:
        if self.items is None or not done:
            return False
        try:
            return all(bool(_evaluate(check, values)) for check in self.checks)
        except Exception:  # an error in the check is the test's failure, as in Python
            return False


class _Planner:
    """Splits a test's statements in order (:func:`_plan`); ``held``: the test's constants
    (``expected = 9``) ppokit holds, sent only when code sent to the sandbox names them."""

    def __init__(self, expand: bool) -> None:
        self.plan = _Plan()
        self.items: list[list[Any]] = []
        self.held: dict[str, Any] = {}
        #: the test's functions ppokit holds: inlined where called, sent where named
        self.defs: dict[str, ast.FunctionDef] = {}
        #: names the test's code in the sandbox may change: their assignments go there too
        self.sent: set[str] = set()
        #: the values of held names the sandbox has been given (each sent once)
        self.given: dict[str, Any] = {}
        self.expand, self.left, self.depth = expand, MAX_UNROLLED, 0

    def mark(self) -> tuple[Any, ...]:
        state = dict(self.held), dict(self.defs), set(self.sent), dict(self.given)
        return len(self.items), self.plan.queries, self.plan.forgeable, *state

    def back(self, mark: tuple[Any, ...]) -> None:
        """Undo what was planned since ``mark``."""
        del self.items[mark[0] :]
        self.plan.queries, self.plan.forgeable = mark[1], mark[2]
        self.held, self.defs, self.sent, self.given = mark[3:]

    def statement(self, node: ast.stmt) -> None:
        if isinstance(node, ast.Assert):
            self.plan.checks.append(self.check(node.test))
            return
        if self.constant(node):
            return
        if self.expand and (self.define(node) or self.inline(node) or self.unroll(node)):
            return
        self.setup(node)

    def setup(self, node: ast.stmt) -> None:
        """``node`` run in the sandbox as it is."""
        if _asserts(node):
            self.plan.forgeable = True  # its verdict rides on the test reaching its end
        self.send(node)
        source = ast.unparse(node)
        if self.items and self.items[-1][0] == "x":
            self.items[-1][1] += "\n" + source
        else:
            self.items.append(["x", source])

    def bind(self, name: str, value: Any) -> None:
        if name in self.sent:  # the test's code there may read it: it gets the value now
            self.items.append(["b", name, _encode(value, [REPORT_BYTES])])
            self.given[name] = value
        else:
            self.held[name] = value
        self.defs.pop(name, None)

    def define(self, node: ast.stmt) -> bool:
        """Hold a simple function (``def check(candidate): assert ...``) to inline it."""
        if not isinstance(node, ast.FunctionDef) or node.name in self.sent:
            return False
        if not _inlinable(node):
            return False
        self.held.pop(node.name, None)
        self.defs[node.name] = node
        return True

    def inline(self, node: ast.stmt) -> bool:
        """``check(f)`` of a held function, as its body with ``f`` for its parameter."""
        if not isinstance(node, ast.Expr) or not isinstance(node.value, ast.Call):
            return False
        call = node.value
        if not isinstance(call.func, ast.Name) or call.func.id not in self.defs:
            return False
        definition = self.defs[call.func.id]
        params = [a.arg for a in (*definition.args.posonlyargs, *definition.args.args)]
        simple = all(isinstance(a, (ast.Name, ast.Constant)) for a in call.args)
        if call.keywords or not simple or len(params) != len(call.args) or self.depth > 8:
            return False
        mapping = dict(zip(params, call.args, strict=True))
        self.depth += 1
        for statement in definition.body:
            self.expanded(_Substitute(mapping).visit(copy.deepcopy(statement)))
        self.depth -= 1
        return True

    def unroll(self, node: ast.stmt) -> bool:
        """``for a, b in [(1, 1), (2, 4)]: assert f(a) == b`` over a held iterable, as
        its body once per item with the target's names held."""
        if not isinstance(node, ast.For) or node.orelse:
            return False
        if any(isinstance(sub, (ast.Break, ast.Continue)) for sub in ast.walk(node)):
            return False
        target = node.target
        names = [target] if isinstance(target, ast.Name) else getattr(target, "elts", [None])
        if not isinstance(target, (ast.Name, ast.Tuple)) or not all(
            isinstance(n, ast.Name) for n in names
        ):
            return False
        mark = self.mark()
        iterable = self.check(node.iter)
        self.back(mark)
        if _has_query(iterable):
            return False
        try:
            items = list(itertools.islice(_evaluate(iterable, {}), self.left + 1))
            rows = [[item] if isinstance(target, ast.Name) else list(item) for item in items]
            for row in rows:
                for value in row:
                    _encode(value, [REPORT_BYTES])
        except Exception:
            return False
        if len(rows) * len(node.body) > self.left or any(len(r) != len(names) for r in rows):
            return False
        for row in rows:
            for name, value in zip(names, row, strict=True):
                self.bind(name.id, value)
            for statement in node.body:
                self.expanded(statement)
        return True

    def expanded(self, node: ast.stmt) -> None:
        """A statement an inlined call or an unrolled loop made."""
        self.left -= 1
        if self.left < 0:
            raise _TooLarge
        self.statement(node)

    def constant(self, node: ast.stmt) -> bool:
        """Hold ``NAME = value`` (or ``a, b = value``) whose value needs no query."""
        if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
            return False
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        names: list[str | list[str]] = []
        for target in targets:
            if isinstance(target, ast.Name):
                names.append(target.id)
            elif isinstance(target, ast.Tuple) and all(
                isinstance(e, ast.Name) for e in target.elts
            ):
                names.append([e.id for e in target.elts])  # type: ignore[attr-defined]
            else:
                return False
        mark = self.mark()
        value = self.check(node.value)
        self.back(mark)
        if _has_query(value):
            return False
        bound: dict[str, Any] = {}
        try:
            held = _evaluate(value, {})
            for name in names:
                if isinstance(name, str):
                    bound[name] = held
                    continue
                parts = list(held)
                if len(parts) != len(name):
                    return False
                bound.update(zip(name, parts, strict=True))
            for item in bound.values():
                _encode(item, [REPORT_BYTES])  # it must be sendable should code name it
        except Exception:
            return False
        for name, value in bound.items():
            self.bind(name, value)
        return True

    def send(self, node: ast.AST, setup: bool = True) -> None:
        """Before ``node`` goes to the sandbox: the held functions and constants it names
        go first. A setup statement may change them there: they are held no longer. A
        query only reads them (but what it binds with ``:=``): they stay held, and are given
        again where the sandbox's copy is not the value held."""
        names = _names(node)
        for name in sorted(names & self.defs.keys()):
            self.setup(self.defs.pop(name))
        bound = names if setup else _walrus(node)
        for name in sorted(names & self.held.keys()):
            value = self.held.pop(name) if name in bound else self.held[name]
            if name in bound or self.given.get(name, _ERROR) is not value:
                self.items.append(["b", name, _encode(value, [REPORT_BYTES])])
                self.given[name] = value
        self.sent |= bound

    def query(self, node: ast.expr) -> _Query:
        self.send(node, setup=False)
        query = _Query(self.plan.queries)
        self.items.append(["q", self.plan.queries, ast.unparse(node)])
        self.plan.queries += 1
        return query

    def check(self, node: ast.expr) -> ast.expr:
        """``node`` as a check: what ppokit evaluates kept, each other operand a query (in
        Python's order of evaluation)."""
        if isinstance(node, ast.Constant):
            return node
        if isinstance(node, ast.Name) and node.id in self.held:
            return _Held(self.held[node.id])
        if isinstance(node, ast.Name) and node.id in _TYPES:
            return _Held(_TYPES[node.id])
        if isinstance(node, ast.BoolOp):
            return ast.BoolOp(op=node.op, values=[self.check(v) for v in node.values])
        if isinstance(node, ast.Compare):
            operands = [self.check(node.left), *(self.check(c) for c in node.comparators)]
            if all(_has_query(o) for o in operands):
                self.plan.forgeable = True  # the program answers every side
            return ast.Compare(left=operands[0], ops=node.ops, comparators=operands[1:])
        if isinstance(node, ast.UnaryOp):
            return ast.UnaryOp(op=node.op, operand=self.check(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _ARITHMETIC:
            return ast.BinOp(left=self.check(node.left), op=node.op, right=self.check(node.right))
        if isinstance(node, (ast.Tuple, ast.List)) and not _starred(node.elts):
            return type(node)(elts=[self.check(e) for e in node.elts], ctx=ast.Load())
        if isinstance(node, ast.Set) and not _starred(node.elts):
            return ast.Set(elts=[self.check(e) for e in node.elts])
        if isinstance(node, ast.Dict) and None not in node.keys:
            keys: list[ast.expr | None] = []
            values = []
            for key, value in zip(node.keys, node.values, strict=True):
                keys.append(self.check(key))  # type: ignore[arg-type]
                values.append(self.check(value))
            return ast.Dict(keys=keys, values=values)
        if isinstance(node, ast.Call) and _checkable(node):
            args = [self.check(a) for a in node.args]
            keywords = [ast.keyword(arg=k.arg, value=self.check(k.value)) for k in node.keywords]
            return ast.Call(func=node.func, args=args, keywords=keywords)
        if isinstance(node, ast.Subscript):  # of a held value (of a query's: one query)
            mark = self.mark()
            value = self.check(node.value)
            if not _has_query(value):
                return ast.Subscript(value=value, slice=self.index(node.slice), ctx=ast.Load())
            self.back(mark)
        return self.query(node)

    def index(self, node: ast.expr) -> ast.expr:
        if isinstance(node, ast.Slice):
            parts = [
                None if p is None else self.check(p) for p in (node.lower, node.upper, node.step)
            ]
            return ast.Slice(lower=parts[0], upper=parts[1], step=parts[2])
        return self.check(node)


_ARITHMETIC = (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow)


def _starred(elts: list[ast.expr]) -> bool:
    return any(isinstance(e, ast.Starred) for e in elts)


def _checkable(node: ast.Call) -> bool:
    """A call of a built-in a check evaluates, without ``*args`` or ``**kwargs``."""
    if _callee(node) not in _FUNCTIONS:
        return False
    return not _starred(node.args) and all(k.arg is not None for k in node.keywords)


def _has_query(node: ast.AST) -> bool:
    return any(isinstance(sub, _Query) for sub in ast.walk(node))


class _TooLarge(Exception):
    """A test's loops and inlined calls would unroll to more than MAX_UNROLLED statements."""


class _Substitute(ast.NodeTransformer):
    """A parameter's uses replaced by the call's argument (a name or a literal)."""

    def __init__(self, mapping: dict[str, ast.expr]) -> None:
        self.mapping = mapping

    def visit_Name(self, node: ast.Name) -> ast.expr:
        if node.id in self.mapping and isinstance(node.ctx, ast.Load):
            return copy.deepcopy(self.mapping[node.id])
        return node


def _walrus(node: ast.AST) -> set[str]:
    """The names ``node`` binds with ``:=``."""
    return {
        sub.target.id
        for sub in ast.walk(node)
        if isinstance(sub, ast.NamedExpr) and isinstance(sub.target, ast.Name)
    }


def _asserts(node: ast.AST) -> bool:
    return any(isinstance(sub, (ast.Assert, ast.Raise)) for sub in ast.walk(node))


def _inlinable(node: ast.FunctionDef) -> bool:
    """Plain parameters, no decorator, and a body that neither returns, yields nor
    declares a name global, nor binds a parameter's name anywhere (then a parameter
    replaced by the argument means what it meant)."""
    args = node.args
    if node.decorator_list or args.vararg or args.kwarg or args.kwonlyargs or args.defaults:
        return False
    params = {a.arg for a in (*args.posonlyargs, *args.args)}
    for sub in ast.walk(ast.Module(body=node.body, type_ignores=[])):
        if isinstance(sub, (ast.Return, ast.Yield, ast.YieldFrom, ast.Await)):
            return False
        if isinstance(sub, (ast.Global, ast.Nonlocal)):
            return False
        if isinstance(sub, ast.Name):
            bound = set() if isinstance(sub.ctx, ast.Load) else {sub.id}
        elif isinstance(sub, ast.alias):
            bound = {(sub.asname or sub.name).split(".")[0]}
        else:  # a def's, a class's, a parameter's, an except's or a pattern's name
            bound = {str(getattr(sub, key, "")) for key in ("name", "arg", "rest")}
        if bound & params:
            return False
    return True


def _plan(test: str) -> _Plan:
    """``test`` split into what the sandbox runs and what ppokit checks (its loops over
    constants unrolled and its simple functions inlined where they stay within
    MAX_UNROLLED statements)."""
    try:
        module = ast.parse(test)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return _Plan(items=None)
    for expand in (True, False):
        planner = _Planner(expand)
        try:
            for node in module.body:
                planner.statement(node)
        except _TooLarge:
            continue
        except (ValueError, RecursionError, MemoryError):
            return _Plan(items=None)
        break
    plan = planner.plan
    plan.items = planner.items
    if not plan.checks:
        plan.forgeable = True  # passes by reaching its end
    return plan


# --- the answers: read here, bounded, decoded without running code ---------------------------


def _index(text: str) -> int:
    if len(text) > 18:
        raise ValueError("not an index")
    return int(text)


def _refuse(text: str) -> Any:
    raise ValueError(f"unexpected {text}")


def _answers(report: bytes, plans: list[_Plan]) -> tuple[list[dict[int, Any]], list[bool]]:
    """Each test's query values (the first answer to each query) and whether it ended."""
    values: list[dict[int, Any]] = [{} for _ in plans]
    done = [False] * len(plans)
    for line in report.split(b"\n")[:-1]:  # the last piece is empty or was cut off
        try:
            message = json.loads(
                line, parse_int=_index, parse_float=_refuse, parse_constant=_refuse
            )
        except (ValueError, RecursionError):
            continue
        if type(message) is not list or not 1 <= len(message) <= 3:
            continue
        t = message[0]
        if type(t) is not int or not 0 <= t < len(plans):
            continue
        if len(message) == 1:
            done[t] = True
            continue
        k = message[1]
        if type(k) is not int or not 0 <= k < plans[t].queries or k in values[t]:
            continue
        try:
            values[t][k] = _decode(message[2]) if len(message) == 3 else _ERROR
        except (ValueError, TypeError, OverflowError, RecursionError):
            values[t][k] = _ERROR
    return values, done


# --- the sandbox ------------------------------------------------------------------------------


#: Per machine: its seccomp architecture, whether the x32 numbers (``nr | 0x40000000``) are
#: to be refused, and the numbers of the system calls the filter refuses (``shmget``,
#: ``msgget``, ``memfd_create``, ``memfd_secret``: memory no file system bounds;
#: ``unshare``: a user namespace, where a tmpfs of no bound could be mounted), of
#: ``clone`` (refused with CLONE_NEWUSER) and of ``clone3`` (ENOSYS: its flags cannot be
#: read, and the C library then falls back to ``clone``).
_SYSCALLS = {
    "x86_64": (0xC000003E, True, (29, 68, 319, 447, 272), 56, 435),
    "aarch64": (0xC00000B7, False, (194, 186, 279, 447, 97), 220, 435),
}


def _seccomp_filter() -> bytes | None:
    """A classic BPF program for bubblewrap's ``--seccomp`` (see _SYSCALLS): the refused
    calls fail with EPERM, as does any call of another architecture (a 32-bit call from a
    64-bit process); None on a machine not in _SYSCALLS."""
    known = _SYSCALLS.get(os.uname().machine)
    if known is None:
        return None
    arch, x32, refused, clone, clone3 = known
    load, equal, at_least, has_bits, answer = 0x20, 0x15, 0x35, 0x45, 0x06
    code: list[tuple[int, int, str | None, str | None]] = []  # (op, k, if true, if false)
    code += [(load, 4, None, None), (equal, arch, None, "refuse")]  # its architecture
    code += [(load, 0, None, None)]  # its number
    code += [(at_least, 0x40000000, "refuse", None)] if x32 else []
    code += [(equal, nr, "refuse", None) for nr in refused]
    code += [(equal, clone3, "nosys", None), (equal, clone, None, "allow")]
    code += [(load, 16, None, None), (has_bits, 0x10000000, "refuse", None)]  # CLONE_NEWUSER
    results = {
        "allow": 0x7FFF0000,
        "refuse": 0x50000 | errno.EPERM,
        "nosys": 0x50000 | errno.ENOSYS,
    }
    at = {label: len(code) + n for n, label in enumerate(results)}
    code += [(answer, k, None, None) for k in results.values()]

    def jump(label: str | None, i: int) -> int:
        return 0 if label is None else at[label] - i - 1

    return b"".join(
        struct.pack("=HBBI", op, jump(yes, i), jump(no, i), k)
        for i, (op, k, yes, no) in enumerate(code)
    )


@functools.cache
def _disables_userns(bwrap: str) -> bool:
    """Whether this bubblewrap has ``--disable-userns`` (0.8 and later)."""
    try:
        done = subprocess.run([bwrap, "--help"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "--disable-userns" in done.stdout + done.stderr


def _bwrap_args(python: Path, task: Path, disk_mb: int, seccomp: int | None) -> list[str]:
    """bubblewrap's arguments: the namespaces (``--disable-userns`` where this bubblewrap
    has it; the seccomp filter refuses a user namespace anyway), /usr
    read-only (and the interpreter's prefix when it lives elsewhere), /bin, /lib, ... as
    this machine has them, /proc, a few devices, one tmpfs of ``disk_mb`` at /work (the
    working folder) holding /tmp and /dev/shm, the task read-only at /task; then the root
    and /dev read-only: /work is the one writable place. ``seccomp``: the fd of
    :func:`_seccomp_filter`'s program."""
    args = ["--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL"]
    bwrap = shutil.which("bwrap")
    if bwrap is not None and _disables_userns(bwrap):  # else the seccomp filter's unshare
        args += ["--unshare-user", "--disable-userns"]
    args += ["--ro-bind", "/usr", "/usr"]
    prefix = python.resolve().parent.parent
    if not str(prefix).startswith("/usr"):
        args += ["--ro-bind", str(prefix), str(prefix)]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    args += ["--proc", "/proc", "--tmpfs", "/dev"]
    for device in ("null", "zero", "full", "random", "urandom"):
        args += ["--dev-bind", f"/dev/{device}", f"/dev/{device}"]
    for name, target in (("fd", ""), ("stdin", "/0"), ("stdout", "/1"), ("stderr", "/2")):
        args += ["--symlink", f"/proc/self/fd{target}", f"/dev/{name}"]
    args += ["--size", str(disk_mb << 20), "--tmpfs", "/work"]
    args += ["--dir", "/work/.tmp", "--dir", "/work/.shm"]
    args += ["--symlink", "/work/.tmp", "/tmp", "--symlink", "/work/.shm", "/dev/shm"]
    args += ["--ro-bind", str(task), "/task", "--remount-ro", "/dev", "--remount-ro", "/"]
    if seccomp is not None:
        args += ["--seccomp", str(seccomp)]
    args += ["--chdir", "/work", "--clearenv"]
    for key, value in (("PATH", "/usr/bin:/bin"), ("HOME", "/work"), ("LANG", "C.UTF-8")):
        args += ["--setenv", key, value]
    return args


@contextlib.contextmanager
def _filter_fd() -> Iterator[int | None]:
    """The read end of a pipe holding :func:`_seccomp_filter`'s program (None where there
    is none), closed on leaving."""
    program = _seccomp_filter()
    if program is None:
        yield None
        return
    read, write = os.pipe()
    try:
        os.write(write, program)  # a few hundred bytes: the pipe holds them
    finally:
        os.close(write)
    try:
        yield read
    finally:
        os.close(read)


def _as_nobody() -> dict[str, Any]:
    """Popen's arguments that drop root to ``nobody`` (none for another user)."""
    if os.geteuid() != 0:
        return {}
    return {"user": NOBODY, "group": NOBODY, "extra_groups": []}


def sandbox_problem(python: str) -> str | None:
    """Why no sandbox can be made here (one line), or None: bwrap missing, or failing to
    make its namespaces (a kernel without unprivileged user namespaces), or no
    interpreter."""
    if not Path(python).is_file() or not os.access(python, os.X_OK):
        return f"the interpreter {python} is not there"
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return "bubblewrap is not installed (apt-get install bubblewrap)"
    with tempfile.TemporaryDirectory(prefix="ppokit-sandbox-") as task, _filter_fd() as fd:
        os.chmod(task, 0o755)
        args = _bwrap_args(Path(python), Path(task), 1, fd)
        cmd = [bwrap, *args, python, "-I", "-c", "pass"]
        try:
            done = subprocess.run(
                cmd,
                capture_output=True,
                text=True,
                timeout=60,
                pass_fds=() if fd is None else (fd,),
                **_as_nobody(),
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"bubblewrap failed to start ({one_line(exc)})"
    if done.returncode != 0:
        return f"bubblewrap cannot make its sandbox here ({one_line(done.stderr.strip())})"
    return None


@CODE_TESTS.implementation
class CodeTestsReward:
    """The program is the response's last fenced code block (``extract``) or the whole
    response; its module name is ``solution`` (an ``if __name__ == "__main__"`` block does
    not run). A row's tests are a list of Python statements (or a JSON text of one). Each
    response gets a fresh folder; nothing it writes outlives its sandbox. Flags
    ``timed_out`` (reward/code_tests/timed_out_frac) on responses the timeout stopped, and
    ``forgeable`` (reward/code_tests/forgeable_frac) on responses whose row has a test
    whose verdict the program could forge (the module docstring)."""

    blocking = True  # its calls wait on a server or a sandbox

    def __init__(
        self,
        *,
        field: str,
        timeout: float,
        cpu_seconds: int,
        memory_mb: int,
        processes: int,
        file_mb: int,
        disk_mb: int,
        concurrency: int,
        python: str,
        extract: bool,
        unsafe: bool,
    ) -> None:
        self.field, self.timeout, self.extract = field, timeout, extract
        self.python, self.disk_mb, self.concurrency = python, disk_mb, concurrency
        problem = sandbox_problem(python)
        self.isolated = problem is None
        if problem is not None and not (unsafe and os.environ.get(UNSAFE_ENV) == "1"):
            how = (
                f"the spec sets unsafe: true but the environment has no {UNSAFE_ENV}=1"
                if unsafe
                else f"set unsafe: true and {UNSAFE_ENV}=1 to run them without it"
            )
            raise UserError(
                f"the code_tests reward runs programs in a sandbox: {problem}; it refuses to "
                f"run them unisolated ({how})"
            )
        hard_files = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        # processes: the sandbox's own init, the harness and a test's fork count too
        self.limits = {
            "RLIMIT_CPU": cpu_seconds,
            "RLIMIT_AS": memory_mb << 20,
            "RLIMIT_NPROC": processes + 3,
            "RLIMIT_FSIZE": file_mb << 20,
            "RLIMIT_CORE": 0,
            "RLIMIT_NOFILE": OPEN_FILES if hard_files < 0 else min(OPEN_FILES, hard_files),
        }

    def _tests(self, value: Any) -> list[str]:
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                value = [value]
        if hasattr(value, "tolist"):
            value = value.tolist()
        if not isinstance(value, (list, tuple)) or not all(isinstance(t, str) for t in value):
            raise UserError(
                f"the code_tests reward: the field {self.field!r} must hold a list of Python "
                f"statements, got {type(value).__name__}"
            )
        return list(value)

    def _command(self, task: Path, seccomp: int | None) -> list[str]:
        if self.isolated:
            args = _bwrap_args(Path(self.python), task, self.disk_mb, seccomp)
            return ["bwrap", *args, self.python, "-I", "/task/harness.py"]
        return [self.python, "-I", str(task / "harness.py")]

    def run(self, program: str, tests: list[str]) -> tuple[float, bool]:
        """(the fraction of ``tests`` passed, whether the timeout stopped it)."""
        score, timed_out, _ = self._run(program, [_plan(t) for t in tests])
        return score, timed_out

    def _run(self, program: str, plans: list[_Plan]) -> tuple[float, bool, bool]:
        """(the fraction of the tests passed, timed out, forgeable)."""
        if not plans:
            return 0.0, False, False
        forgeable = any(p.forgeable for p in plans)
        with tempfile.TemporaryDirectory(prefix="ppokit-code-") as folder:
            task = Path(folder)
            (task / "harness.py").write_text(HARNESS, encoding="utf-8")
            os.chmod(task, 0o755)
            os.chmod(task / "harness.py", 0o644)
            if os.geteuid() == 0 and not self.isolated:  # nobody's folder to write in
                os.chown(task, NOBODY, NOBODY)
            limits = dict(self.limits)
            if not self.isolated:  # counted over all the user's processes: those now too
                limits["RLIMIT_NPROC"] += _processes_of(
                    NOBODY if os.geteuid() == 0 else os.getuid()
                )
            read, write = os.pipe()
            request = {
                "limits": limits,
                "fd": write,
                "program": program,
                "tests": [p.items for p in plans],
            }
            try:
                report, timed_out = self._exchange(task, json.dumps(request).encode(), read, write)
            finally:
                os.close(read)
        values, done = _answers(report, plans)
        passed = sum(p.passed(v, d) for p, v, d in zip(plans, values, done, strict=True))
        return passed / len(plans), timed_out, forgeable

    def _exchange(self, task: Path, request: bytes, read: int, write: int) -> tuple[bytes, bool]:
        """Start the sandbox, give it ``request`` on its stdin, read its answers from
        ``read`` (at most REPORT_BYTES) until it ends or the timeout; then kill it whole.
        (the answers, whether the timeout stopped it)."""
        cwd = None if self.isolated else str(task)
        env = {"PATH": "/usr/bin:/bin", "HOME": str(task), "LANG": "C.UTF-8"}
        stdin, feed = os.pipe()
        try:
            with _filter_fd() if self.isolated else contextlib.nullcontext() as seccomp:
                proc = subprocess.Popen(
                    self._command(task, seccomp),
                    stdin=stdin,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    pass_fds=(write,) if seccomp is None else (write, seccomp),
                    start_new_session=True,
                    cwd=cwd,
                    env=env,
                    **_as_nobody(),
                )
        except BaseException:
            os.close(feed)
            raise
        finally:
            os.close(stdin)
            os.close(write)
        try:
            return _converse(proc, feed, request, read, time.monotonic() + self.timeout)
        finally:  # the whole group: the sandbox goes with bwrap (--die-with-parent)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def __call__(self, prompts: list[str], responses: list[str], **fields: Any) -> Scored:
        from ppokit.components.reward.impl import require_field

        rows = require_field(fields, self.field, "code_tests", len(responses))
        plans: dict[str, _Plan] = {}  # a group's responses share their row's tests
        tests = [
            [plans.get(t) or plans.setdefault(t, _plan(t)) for t in self._tests(v)] for v in rows
        ]
        programs = [extract_program(r) if self.extract else r for r in responses]
        jobs = list(zip(programs, tests, strict=True))
        done = in_threads(lambda job: self._run(*job), jobs, self.concurrency, "ppokit-sandbox")
        for result in done:
            if isinstance(result, Exception):  # the sandbox itself failed: one line
                raise UserError(f"the code_tests reward: {one_line(result)}")
        ok = [r for r in done if not isinstance(r, Exception)]
        flags = {"timed_out": [r[1] for r in ok], "forgeable": [r[2] for r in ok]}
        return Scored([r[0] for r in ok], flags)


def _converse(
    proc: subprocess.Popen[bytes], feed: int, request: bytes, read: int, deadline: float
) -> tuple[bytes, bool]:
    """Write ``request`` to ``feed`` (closed then, or on return) and read ``read`` until its
    end, the process's end or ``deadline``: (what was read, at most REPORT_BYTES; whether
    the deadline came first)."""
    chunks: list[bytes] = []
    size = 0
    pending = memoryview(request)
    os.set_blocking(feed, False)
    os.set_blocking(read, False)
    try:
        exited: int | None = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):  # no pidfd: look at the process now and then
        exited = None
    selector = selectors.DefaultSelector()
    selector.register(read, selectors.EVENT_READ)
    selector.register(feed, selectors.EVENT_WRITE)
    if exited is not None:
        selector.register(exited, selectors.EVENT_READ)
    try:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return b"".join(chunks), True
            events = selector.select(remaining if exited is not None else min(remaining, 0.05))
            ended = exited is None and proc.poll() is not None
            for key, _ in events:
                if key.fd == feed and pending:
                    try:
                        pending = pending[os.write(feed, pending[: 1 << 16]) :]
                    except BlockingIOError:
                        continue
                    except OSError:  # the harness is gone
                        pending = pending[:0]
                    if not pending:
                        selector.unregister(feed)
                        os.close(feed)
                elif key.fd == read:
                    chunk = _read(read)
                    if chunk == b"":  # every process that held the pipe has ended
                        return b"".join(chunks), False
                    if chunk:
                        chunks.append(chunk[: REPORT_BYTES - size])
                        size += len(chunks[-1])
                    if size >= REPORT_BYTES:  # its writers wait now, until the end
                        selector.unregister(read)
                elif key.fd == exited:
                    ended = True
            if ended:  # what its processes wrote before they ended is in the pipe now
                while size < REPORT_BYTES and (chunk := _read(read)):
                    chunks.append(chunk[: REPORT_BYTES - size])
                    size += len(chunks[-1])
                return b"".join(chunks), False
    finally:
        selector.close()
        if pending:
            os.close(feed)
        if exited is not None:
            os.close(exited)


def _read(fd: int) -> bytes | None:
    """What the non-blocking pipe ``fd`` holds now (b"" at its end, None when empty)."""
    try:
        return os.read(fd, 1 << 16)
    except BlockingIOError:
        return None


def _processes_of(uid: int) -> int:
    """How many processes ``uid`` runs now (/proc)."""
    count = 0
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            text = status.read_text()
        except OSError:
            continue
        match = re.search(r"^Uid:\s+(\d+)", text, re.MULTILINE)
        count += bool(match and int(match.group(1)) == uid)
    return count
