"""The built-in environments: ``none``, the ``calculator`` tool and the ``echo`` game.

Plain Python: an environment reads and writes text, never tensors.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable
from fractions import Fraction
from typing import Any

from ppokit.components.environment import CALCULATOR, ECHO, NONE
from ppokit.environments import Step
from ppokit.tasks.demo import echo_score

__all__ = ["Calculator", "Echo", "NoEnvironment", "evaluate"]


@NONE.implementation
class NoEnvironment:
    """One model turn, nothing added (the trainer never calls it: ``single_turn``)."""

    single_turn = True

    def reset(self, row: dict[str, Any]) -> str | None:
        return None

    def step(self, row: dict[str, Any], response: str, turn: int) -> Step:
        return Step(None, 0.0, True)


_BINARY: dict[type[ast.operator], Callable[[Fraction, Fraction], Fraction]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Fraction], Fraction]] = {
    ast.UAdd: operator.pos,
    ast.USub: operator.neg,
}
#: The largest magnitude a value may reach (larger is an error, not a slow big integer).
LIMIT = Fraction(10) ** 100


def _value(node: ast.AST) -> Fraction:
    number = node.value if isinstance(node, ast.Constant) else None
    if isinstance(number, (int, float)) and not isinstance(number, bool):
        return Fraction(number)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow):
            if right.denominator != 1 or abs(right) > 64 or (left == 0 and right < 0):
                raise ValueError("powers take an integer exponent of at most 64")
            right = Fraction(int(right))
        elif isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise ValueError("division by zero")
        out = _BINARY[type(node.op)](left, right)
        if abs(out) > LIMIT:
            raise ValueError("the value is too large")
        return Fraction(out)
    raise ValueError("only numbers, + - * / // % ** and parentheses are allowed")


def evaluate(expression: str) -> str:
    """The value of an arithmetic expression in exact rational arithmetic, as text: an
    integer, or a decimal of at most 6 places. Nothing but numbers and operators is read
    (no names, calls or attributes): :class:`ValueError` otherwise, and for anything that
    overflows or nests too deeply."""
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, RecursionError, MemoryError):
        raise ValueError("not an arithmetic expression") from None
    try:
        value = _value(tree.body)
    except OverflowError:  # a float literal past the float range (1e999 is inf)
        raise ValueError("the value is too large") from None
    except RecursionError:
        raise ValueError("the expression is nested too deeply") from None
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.6f}".rstrip("0").rstrip(".")


@CALCULATOR.implementation
class Calculator:
    """The last ``open EXPR close`` of a turn is evaluated and its value returned as the
    observation (an error as ``Error: why``); a turn without a call ends the episode. With
    ``open_first`` the first turn begins inside a call (``reset`` returns ``open``)."""

    def __init__(self, *, open: str, close: str, max_length: int, open_first: bool) -> None:
        self.open = open
        self.close = close
        self.max_length = max_length
        self.open_first = open_first

    def reset(self, row: dict[str, Any]) -> str | None:
        return self.open if self.open_first else None

    def step(self, row: dict[str, Any], response: str, turn: int) -> Step:
        if turn == 0 and self.open_first:  # the opening text is reset's, before the turn
            response = self.open + response
        start = response.rfind(self.open)
        end = response.find(self.close, start + len(self.open)) if start >= 0 else -1
        if end < 0:
            return Step(None, 0.0, True)
        expression = response[start + len(self.open) : end]
        if len(expression) > self.max_length:
            return Step(f"Error: an expression of at most {self.max_length} characters")
        try:
            return Step(f"Result: {evaluate(expression)}")
        except ValueError as exc:
            return Step(f"Error: {exc}")


@ECHO.implementation
class Echo:
    """Turn k answers symbol ``row[field][k]``; the next symbol is shown after it."""

    def __init__(self, *, field: str) -> None:
        self.field = field

    def reset(self, row: dict[str, Any]) -> str | None:
        symbols = row.get(self.field)
        if not isinstance(symbols, str) or not symbols:
            raise ValueError(
                f"the echo environment reads a string of symbols from the data's "
                f"{self.field!r} column (data: {{source: demo, options: {{turns: 3}}}})"
            )
        return None

    def step(self, row: dict[str, Any], response: str, turn: int) -> Step:
        symbols: str = row[self.field]
        reward = echo_score(response, symbols[turn]) / len(symbols)
        if turn + 1 >= len(symbols):
            return Step(None, reward, True)
        return Step(f"\necho {symbols[turn + 1]}", reward)
