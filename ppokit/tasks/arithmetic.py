"""The arithmetic task: an expression over integers, and its exact answer.

Each prompt is ``"What is 3 + (-4) * 7? Put the final answer in \\boxed{}."``: ``terms``
integers drawn uniformly from ``[min_value, max_value]`` joined by operators drawn from
``ops``, with ``*`` and ``/`` binding tighter; the answer is the exact value (``a/b`` when a
division leaves a fraction), which the ``math_verify`` reward checks. The options and their
defaults are :class:`~ppokit.components.prompt_source.ArithmeticParams` (``data.options``).
"""

from __future__ import annotations

import random
from fractions import Fraction
from typing import Any

from ppokit.components.prompt_source import ArithmeticParams

__all__ = ["INSTRUCTION", "evaluate", "make_row"]

#: What each prompt asks of the answer's form.
INSTRUCTION = "Put the final answer in \\boxed{}."


def _format_number(value: int) -> str:
    return f"({value})" if value < 0 else str(value)


def _format_answer(value: Fraction) -> str:
    if value.denominator == 1:
        return str(value.numerator)
    return f"{value.numerator}/{value.denominator}"


def evaluate(numbers: list[int], ops: list[str]) -> Fraction:
    """The exact value of ``n0 op0 n1 op1 ...`` with ``*`` and ``/`` binding tighter."""
    total = Fraction(0)
    term = Fraction(numbers[0])
    sign = 1
    for op, number in zip(ops, numbers[1:], strict=True):
        if op == "*":
            term *= number
        elif op == "/":
            term /= number
        else:
            total += sign * term
            sign = 1 if op == "+" else -1
            term = Fraction(number)
    return total + sign * term


def make_row(rng: random.Random, options: ArithmeticParams | None = None) -> dict[str, Any]:
    """One problem: ``{"prompt", "answer", "expression"}``; the answer is exact (``a/b``
    when a division leaves a fraction). ``options``: ``data.options`` (defaults: those of
    :class:`~ppokit.components.prompt_source.ArithmeticParams`)."""
    o = options if options is not None else ArithmeticParams()
    ops, min_value, max_value, terms = o.ops, o.min_value, o.max_value, o.terms
    chosen = [rng.choice(ops) for _ in range(terms - 1)]
    numbers = [rng.randint(min_value, max_value)]
    for op in chosen:
        number = rng.randint(min_value, max_value)
        while op == "/" and number == 0:
            number = rng.randint(min_value, max_value)
        numbers.append(number)
    parts = [_format_number(numbers[0])]
    for op, number in zip(chosen, numbers[1:], strict=True):
        parts += [op, _format_number(number)]
    expression = " ".join(parts)
    return {
        "prompt": f"What is {expression}? {INSTRUCTION}",
        "answer": _format_answer(evaluate(numbers, chosen)),
        "expression": expression,
    }
