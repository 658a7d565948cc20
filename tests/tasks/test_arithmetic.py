"""The arithmetic task: exact answers (by hand, over generated expressions, through
math-verify), the rows' form, and the options' checks."""

from __future__ import annotations

import random
import re
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ppokit.data import ArithmeticSource, JsonlSource, PromptSource, make_prompt_source
from ppokit.errors import UserError
from ppokit.spec import ArithmeticOptions, DataSpec, SpecError, validate_spec
from ppokit.tasks.arithmetic import evaluate, make_row

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "data" / "arithmetic_sample.jsonl"


def _exact(expression: str) -> Fraction:
    """The exact value of an arithmetic expression, evaluated by Python over Fractions."""
    code = re.sub(r"\d+", lambda m: f"Fraction({m.group()})", expression)
    return eval(code, {"Fraction": Fraction, "__builtins__": {}})


def _answer(text: str) -> Fraction:
    return Fraction(text)


# ------------------------------------------------------------------- arithmetic
@pytest.mark.parametrize(
    ("numbers", "ops", "value"),
    [
        ([23, 45], ["+"], Fraction(68)),
        ([2, 3, 4], ["+", "*"], Fraction(14)),
        ([2, 3, 4], ["*", "-"], Fraction(2)),
        ([1, 2, 3], ["-", "-"], Fraction(-4)),
        ([8, 2, 2], ["/", "/"], Fraction(2)),
        ([7, 2], ["/"], Fraction(7, 2)),
        ([5, -3, 2, 4], ["-", "*", "/"], Fraction(13, 2)),
    ],
)
def test_evaluate_by_hand(numbers: list[int], ops: list[str], value: Fraction) -> None:
    assert evaluate(numbers, ops) == value


class Scripted(random.Random):
    """An rng returning given operands and always choosing ``op``."""

    def __init__(self, values: list[int], op: str) -> None:
        super().__init__(0)
        self.values = iter(values)
        self.op = op

    def randint(self, a: int, b: int) -> int:
        return next(self.values)

    def choice(self, seq: Any) -> Any:
        return self.op


def test_arithmetic_rows_by_hand() -> None:
    assert make_row(Scripted([23, 45], "+")) == {
        "prompt": "What is 23 + 45? Put the final answer in \\boxed{}.",
        "answer": "68",
        "expression": "23 + 45",
    }
    row = make_row(Scripted([-7, -2, 4], "-"), ArithmeticOptions(terms=3, min_value=-9))
    assert (row["expression"], row["answer"]) == ("(-7) - (-2) - 4", "-9")
    row = make_row(Scripted([3, 0, 6, 0, 0, 2], "/"), ArithmeticOptions(ops="/", terms=3))
    assert (row["expression"], row["answer"]) == ("3 / 6 / 2", "1/4")  # zero divisors redrawn


@settings(max_examples=80, deadline=None)
@given(
    seed=st.integers(0, 2**32),
    ops=st.sets(st.sampled_from("+-*/"), min_size=1).map("".join),
    low=st.integers(-20, 20),
    width=st.integers(0, 50),
    terms=st.integers(2, 5),
)
def test_arithmetic_answers_are_correct(
    seed: int, ops: str, low: int, width: int, terms: int
) -> None:
    if "/" in ops and low == 0 and width == 0:
        width = 1
    options = {"ops": ops, "min_value": low, "max_value": low + width, "terms": terms}
    source = make_prompt_source(DataSpec(source="arithmetic", options=options), seed)
    for row in source.next_rows(5):
        expression = row["expression"]
        assert row["prompt"] == f"What is {expression}? Put the final answer in \\boxed{{}}."
        assert _exact(expression) == _answer(row["answer"])
        numbers = [int(n) for n in re.findall(r"-?\d+", expression)]
        assert len(numbers) == terms
        assert all(low <= n <= low + width for n in numbers)
        assert set(re.findall(r" ([-+*/]) ", expression)) <= set(ops)


def test_arithmetic_answers_pass_math_verify() -> None:
    from ppokit.registry import get_registry

    reward = get_registry().create("reward", "math_verify")
    rows = ArithmeticSource(0, {"ops": "+-*/", "min_value": -9, "max_value": 30}).next_rows(12)
    responses = [f"\\boxed{{{r['answer']}}}" for r in rows]
    prompts = [r["prompt"] for r in rows]
    answers = [r["answer"] for r in rows]
    assert reward(prompts, responses, answer=answers).tolist() == [1.0] * 12
    wrong = [f"\\boxed{{{_answer(a) + 1}}}" for a in answers]
    assert reward(prompts, wrong, answer=answers).tolist() == [0.0] * 12


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"ops": "+^"}, "data.options.ops"),
        ({"ops": ""}, "data.options.ops"),
        ({"min_value": 5, "max_value": 1}, "must not exceed"),
        ({"terms": 1}, "data.options.terms"),
        ({"ops": "/", "min_value": 0, "max_value": 0}, "division"),
        ({"digits": 3}, "data.options.digits: Extra inputs are not permitted"),
        ({"terms": 2.5}, "data.options.terms"),
    ],
)
def test_arithmetic_bad_options(options: dict, message: str) -> None:
    with pytest.raises(UserError, match=message):
        make_prompt_source(DataSpec(source="arithmetic", options=options), 0)
    with pytest.raises(SpecError, match=message):  # and the spec says so before any work
        validate_spec({"data": {"source": "arithmetic", "options": options}, "advantage": "grpo"})


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"source": "demo", "options": {"symbols": ""}}, "data.options.symbols"),
        ({"source": "demo", "options": {"size": 3}}, "data.options.size"),
        ({"source": "prompts.jsonl", "options": {"ops": "+"}}, "a data file takes no options"),
    ],
)
def test_source_options_are_checked_by_validate(data: dict, message: str) -> None:
    with pytest.raises(SpecError, match=message):
        validate_spec({"data": data, "advantage": "grpo"})


def test_example_file_loads_and_its_answers_are_right() -> None:
    source = make_prompt_source(DataSpec(source=str(EXAMPLE), shuffle=False), 0)
    assert isinstance(source, JsonlSource) and isinstance(source, PromptSource)
    for row in source.next_rows(len(source.rows)):
        expression = re.fullmatch(
            r"What is (.*)\? Put the final answer in \\boxed\{\}\.", row["prompt"]
        )
        assert expression is not None
        assert _exact(expression.group(1)) == _answer(row["answer"])
