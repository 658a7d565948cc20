"""A test of the ``code_tests`` reward (:mod:`ppokit.components.reward.sandbox`) split, in
ppokit's own process which never runs it, into what the sandbox runs (setup, the test's
constants its code names, the source of each query) and the checks ppokit keeps
(:func:`plan_test`, a :class:`Plan`): its loops over constants unrolled and its simple
functions inlined, and flagged ``forgeable`` where its verdict does not rest on a check.

It imports the checks (:mod:`~ppokit.components.reward.checks`) and the tagged encoding
(:mod:`~ppokit.components.reward.tagged_values`) only: never the harness or the sandbox.
"""

from __future__ import annotations

import ast
import copy
import itertools
from dataclasses import dataclass, field
from typing import Any

from ppokit.components.reward.checks import (
    FUNCTIONS,
    NO_VALUE,
    TYPES,
    Held,
    Query,
    callee,
    evaluate,
)
from ppokit.components.reward.tagged_values import REPORT_BYTES, encode

#: The most statements a test's loops over constants and inlined functions unroll to.
MAX_UNROLLED = 2000


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
class Plan:
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
            return all(bool(evaluate(check, values)) for check in self.checks)
        except Exception:  # an error in the check is the test's failure, as in Python
            return False


class _Planner:
    """Splits a test's statements in order (:func:`plan_test`); ``held``: the test's constants
    (``expected = 9``) ppokit holds, sent only when code sent to the sandbox names them."""

    def __init__(self, expand: bool) -> None:
        self.plan = Plan()
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
            self.items.append(["b", name, encode(value, [REPORT_BYTES])])
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
            items = list(itertools.islice(evaluate(iterable, {}), self.left + 1))
            rows = [[item] if isinstance(target, ast.Name) else list(item) for item in items]
            for row in rows:
                for value in row:
                    encode(value, [REPORT_BYTES])
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
            held = evaluate(value, {})
            for name in names:
                if isinstance(name, str):
                    bound[name] = held
                    continue
                parts = list(held)
                if len(parts) != len(name):
                    return False
                bound.update(zip(name, parts, strict=True))
            for item in bound.values():
                encode(item, [REPORT_BYTES])  # it must be sendable should code name it
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
            if name in bound or self.given.get(name, NO_VALUE) is not value:
                self.items.append(["b", name, encode(value, [REPORT_BYTES])])
                self.given[name] = value
        self.sent |= bound

    def query(self, node: ast.expr) -> Query:
        self.send(node, setup=False)
        query = Query(self.plan.queries)
        self.items.append(["q", self.plan.queries, ast.unparse(node)])
        self.plan.queries += 1
        return query

    def check(self, node: ast.expr) -> ast.expr:
        """``node`` as a check: what ppokit evaluates kept, each other operand a query (in
        Python's order of evaluation)."""
        if isinstance(node, ast.Constant):
            return node
        if isinstance(node, ast.Name) and node.id in self.held:
            return Held(self.held[node.id])
        if isinstance(node, ast.Name) and node.id in TYPES:
            return Held(TYPES[node.id])
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
    if callee(node) not in FUNCTIONS:
        return False
    return not _starred(node.args) and all(k.arg is not None for k in node.keywords)


def _has_query(node: ast.AST) -> bool:
    return any(isinstance(sub, Query) for sub in ast.walk(node))


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


def plan_test(test: str) -> Plan:
    """``test`` split into what the sandbox runs and what ppokit checks (its loops over
    constants unrolled and its simple functions inlined where they stay within
    MAX_UNROLLED statements)."""
    try:
        module = ast.parse(test)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return Plan(items=None)
    for expand in (True, False):
        planner = _Planner(expand)
        try:
            for node in module.body:
                planner.statement(node)
        except _TooLarge:
            continue
        except (ValueError, RecursionError, MemoryError):
            return Plan(items=None)
        break
    plan = planner.plan
    plan.items = planner.items
    if not plan.checks:
        plan.forgeable = True  # passes by reaching its end
    return plan
