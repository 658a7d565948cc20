"""Regenerate the example data files of examples/data, deterministically (nothing downloaded).

    python examples/data/make_examples.py [OUT_DIR]     # default: this script's folder

- ``gsm8k_style.parquet`` (400 rows) and ``gsm8k_style_test.parquet`` (200 held-out rows):
  arithmetic word problems in GSM8K's own format, a ``question`` column and an ``answer``
  column holding the worked solution, with calculator annotations ``<<a*b=c>>``, and the
  final answer after ``####``; read them with ``answer_pattern: "####\\s*(.+)$"``.
- ``math_style.parquet`` (64 rows) and ``math_style_test.parquet`` (200 held-out rows):
  MATH-like problems in the messages layout, a ``messages`` column (the user's problem, then
  the assistant's solution ending in ``\\boxed{}``), an ``answer`` column with the LaTeX final
  answer and a ``type`` column.

The rows are a function of the seeds below only (Python's ``random``), and every answer is
computed exactly (``fractions.Fraction``). The held-out rows share no question with the
training rows. Needs ``pyarrow`` (installed with ``pip install 'ppokit[data]'``).
"""

from __future__ import annotations

import math
import random
import sys
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
GSM8K_SEED, GSM8K_TRAIN, GSM8K_TEST = 8, 400, 200
MATH_SEED, MATH_TRAIN, MATH_TEST = 12, 64, 200

NAMES = (
    "Natalia", "Weng", "Betty", "Julie", "James", "Albert", "Ken", "Alexis", "Tina", "Carla",
    "Mark", "Priya", "Omar", "Lena", "Diego", "Mei", "Tobias", "Amara", "Jonas", "Sofia",
)  # fmt: skip
ITEMS = ("clips", "stickers", "marbles", "cookies", "pencils", "cupcakes", "stamps", "shells")


# --------------------------------------------------------------- GSM8K style
def _calc(expression: str, value: int) -> str:
    """``expression = <<expression=value>>value``, GSM8K's calculator annotation."""
    compact = expression.replace(" ", "")
    return f"{expression} = <<{compact}={value}>>{value}"


def _sold(rng: random.Random) -> tuple[str, list[str], int]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    april, k = rng.randint(12, 60), rng.randint(2, 4)
    may = april * k
    total = april + may
    question = (
        f"{name} sold {april} {item} to her friends in April, and then she sold {k} times as "
        f"many {item} in May. How many {item} did {name} sell altogether in April and May?"
    )
    steps = [
        f"{name} sold {_calc(f'{april}*{k}', may)} {item} in May.",
        f"{name} sold {_calc(f'{april}+{may}', total)} {item} altogether in April and May.",
    ]
    return question, steps, total


def _earned(rng: random.Random) -> tuple[str, list[str], int]:
    name = rng.choice(NAMES)
    rate, hours = rng.randint(8, 25), rng.randint(2, 9)
    earned = rate * hours
    spent = rng.randint(3, earned - 1)
    question = (
        f"{name} earns ${rate} an hour for babysitting. Yesterday, {name} babysat for {hours} "
        f"hours and then spent ${spent} on lunch. How many dollars does {name} have left from "
        "what was earned?"
    )
    steps = [
        f"{name} earned {_calc(f'{rate}*{hours}', earned)} dollars.",
        f"After lunch {name} has {_calc(f'{earned}-{spent}', earned - spent)} dollars left.",
    ]
    return question, steps, earned - spent


def _shared(rng: random.Random) -> tuple[str, list[str], int]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    friends, each = rng.randint(3, 8), rng.randint(6, 20)
    total, given = friends * each, rng.randint(1, 5)
    question = (
        f"{name} has {total} {item} and shares them equally among {friends} friends. Then "
        f"each friend gives {given} of their {item} to a sibling. How many {item} does each "
        "friend have now?"
    )
    steps = [
        f"Each friend gets {_calc(f'{total}/{friends}', each)} {item}.",
        f"After giving some away, each friend has {_calc(f'{each}-{given}', each - given)} {item}.",
    ]
    return question, steps, each - given


def _pages(rng: random.Random) -> tuple[str, list[str], int]:
    name = rng.choice(NAMES)
    per_day, days = rng.randint(8, 30), rng.randint(3, 12)
    read = per_day * days
    pages = read + rng.randint(10, 200)
    question = (
        f"A book has {pages} pages. {name} reads {per_day} pages a day for {days} days. How "
        "many pages are left to read?"
    )
    steps = [
        f"{name} reads {_calc(f'{per_day}*{days}', read)} pages in {days} days.",
        f"There are {_calc(f'{pages}-{read}', pages - read)} pages left to read.",
    ]
    return question, steps, pages - read


def _change(rng: random.Random) -> tuple[str, list[str], int]:
    name = rng.choice(NAMES)
    books, book_price = rng.randint(2, 6), rng.randint(2, 9)
    pens, pen_price = rng.randint(2, 8), rng.randint(1, 4)
    on_books, on_pens = books * book_price, pens * pen_price
    total = on_books + on_pens
    bill = next(b for b in (20, 50, 100) if b > total)
    question = (
        f"{name} buys {books} notebooks at ${book_price} each and {pens} pens at ${pen_price} "
        f"each, and pays with a ${bill} bill. How many dollars of change does {name} get?"
    )
    steps = [
        f"The notebooks cost {_calc(f'{books}*{book_price}', on_books)} dollars.",
        f"The pens cost {_calc(f'{pens}*{pen_price}', on_pens)} dollars.",
        f"Together they cost {_calc(f'{on_books}+{on_pens}', total)} dollars.",
        f"The change is {_calc(f'{bill}-{total}', bill - total)} dollars.",
    ]
    return question, steps, bill - total


def _garden(rng: random.Random) -> tuple[str, list[str], int]:
    rows, per_row, fruit = rng.randint(3, 12), rng.randint(4, 15), rng.randint(2, 9)
    plants = rows * per_row
    question = (
        f"A garden has {rows} rows of tomato plants with {per_row} plants in each row. Each "
        f"plant gives {fruit} tomatoes. How many tomatoes does the garden give?"
    )
    steps = [
        f"The garden has {_calc(f'{rows}*{per_row}', plants)} plants.",
        f"They give {_calc(f'{plants}*{fruit}', plants * fruit)} tomatoes.",
    ]
    return question, steps, plants * fruit


def _walk(rng: random.Random) -> tuple[str, list[str], int]:
    percent = rng.choice((10, 20, 25, 40, 50, 60, 75))
    students = 20 * rng.randint(3, 40)
    walk = students * percent // 100
    question = (
        f"A school has {students} students, and {percent}% of them walk to school. How many "
        "students do not walk to school?"
    )
    steps = [
        f"{_calc(f'{students}*{percent}/100', walk)} students walk to school.",
        f"So {_calc(f'{students}-{walk}', students - walk)} students do not walk.",
    ]
    return question, steps, students - walk


def _trip(rng: random.Random) -> tuple[str, list[str], int]:
    v, t, u, s = rng.randint(30, 70), rng.randint(2, 5), rng.randint(20, 60), rng.randint(1, 4)
    first, second = v * t, u * s
    question = (
        f"A train travels at {v} miles per hour for {t} hours, then at {u} miles per hour for "
        f"{s} hours. How many miles does the train travel in total?"
    )
    steps = [
        f"First it travels {_calc(f'{v}*{t}', first)} miles.",
        f"Then it travels {_calc(f'{u}*{s}', second)} miles.",
        f"In total it travels {_calc(f'{first}+{second}', first + second)} miles.",
    ]
    return question, steps, first + second


GSM8K_TEMPLATES: tuple[Callable[[random.Random], tuple[str, list[str], int]], ...] = (
    _sold, _earned, _shared, _pages, _change, _garden, _walk, _trip,
)  # fmt: skip


def gsm8k_style_rows(seed: int = GSM8K_SEED, n: int = GSM8K_TRAIN + GSM8K_TEST) -> list[dict]:
    """``n`` distinct rows ``{"question", "answer"}`` in GSM8K's format."""
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    while len(rows) < n:
        question, steps, final = rng.choice(GSM8K_TEMPLATES)(rng)
        if question in seen:
            continue
        seen.add(question)
        rows.append({"question": question, "answer": "\n".join([*steps, f"#### {final}"])})
    return rows


# ---------------------------------------------------------------- MATH style
def latex(value: Fraction) -> str:
    """A number as MATH writes a final answer: ``7``, ``\\frac{3}{4}``, ``-\\frac{3}{4}``."""
    if value.denominator == 1:
        return str(value.numerator)
    sign = "-" if value < 0 else ""
    return f"{sign}\\frac{{{abs(value.numerator)}}}{{{value.denominator}}}"


def _frac(value: Fraction) -> str:
    return f"\\frac{{{value.numerator}}}{{{value.denominator}}}"


def _proper(rng: random.Random) -> Fraction:
    """A fraction between 0 and 1 that is not an integer."""
    while True:
        value = Fraction(rng.randint(1, 8), rng.randint(2, 9))
        if value.denominator != 1 and value < 1:
            return value


def _fractions(rng: random.Random) -> tuple[str, str, str, str]:
    a, c = _proper(rng), _proper(rng)
    total = a + c
    common = a.denominator * c.denominator // math.gcd(a.denominator, c.denominator)
    problem = f"Compute ${_frac(a)} + {_frac(c)}$. Express your answer as a common fraction."
    solution = (
        f"The least common denominator is ${common}$, so "
        f"${_frac(a)} + {_frac(c)} = \\frac{{{a.numerator * common // a.denominator}}}{{{common}}}"
        f" + \\frac{{{c.numerator * common // c.denominator}}}{{{common}}} = {latex(total)}$."
    )
    return "Prealgebra", problem, solution, latex(total)


def _linear(rng: random.Random) -> tuple[str, str, str, str]:
    a = rng.choice([k for k in range(-9, 10) if k not in (0, 1)])
    b, c = rng.randint(-20, 20), rng.randint(-20, 20)
    x = Fraction(c - b, a)
    sign = "+" if b >= 0 else "-"
    problem = f"Solve for $x$: ${a}x {sign} {abs(b)} = {c}$."
    solution = (
        f"Moving the constant to the right-hand side gives ${a}x = {c - b}$, so "
        f"$x = \\frac{{{c - b}}}{{{a}}} = {latex(x)}$."
    )
    return "Algebra", problem, solution, latex(x)


def _sqrt(rng: random.Random) -> tuple[str, str, str, str]:
    k, m = rng.randint(2, 9), rng.choice((2, 3, 5, 6, 7, 10, 11))
    n = k * k * m
    problem = f"Simplify $\\sqrt{{{n}}}$."
    solution = f"$\\sqrt{{{n}}} = \\sqrt{{{k * k}}} \\cdot \\sqrt{{{m}}} = {k}\\sqrt{{{m}}}$."
    return "Algebra", problem, solution, f"{k}\\sqrt{{{m}}}"


def _squares(rng: random.Random) -> tuple[str, str, str, str]:
    a = rng.randint(5, 40)
    b = rng.randint(1, a - 1)
    value = a * a - b * b
    problem = f"What is the value of $a^2 - b^2$ when $a = {a}$ and $b = {b}$?"
    solution = f"$a^2 - b^2 = (a - b)(a + b) = ({a - b})({a + b}) = {value}$."
    return "Algebra", problem, solution, str(value)


def _lcm(rng: random.Random) -> tuple[str, str, str, str]:
    a, b = rng.randint(4, 60), rng.randint(4, 60)
    g = math.gcd(a, b)
    value = a * b // g
    problem = f"What is the least common multiple of ${a}$ and ${b}$?"
    solution = (
        f"The greatest common divisor of ${a}$ and ${b}$ is ${g}$, so their least common "
        f"multiple is $\\frac{{{a} \\cdot {b}}}{{{g}}} = {value}$."
    )
    return "Number Theory", problem, solution, str(value)


def _series(rng: random.Random) -> tuple[str, str, str, str]:
    low = rng.randint(1, 30)
    high = low + rng.randint(5, 60)
    count = high - low + 1
    value = (low + high) * count // 2
    problem = f"What is the sum of all the integers from ${low}$ to ${high}$, inclusive?"
    solution = (
        f"There are ${count}$ integers, whose average is $\\frac{{{low} + {high}}}{{2}}$, so "
        f"the sum is ${count} \\cdot \\frac{{{low + high}}}{{2}} = {value}$."
    )
    return "Algebra", problem, solution, str(value)


def _slope(rng: random.Random) -> tuple[str, str, str, str]:
    x1, y1 = rng.randint(-9, 9), rng.randint(-9, 9)
    x2, y2 = x1 + rng.choice([k for k in range(-8, 9) if k]), rng.randint(-9, 9)
    value = Fraction(y2 - y1, x2 - x1)
    problem = (
        f"What is the slope of the line through the points $({x1}, {y1})$ and $({x2}, {y2})$? "
        "Express your answer as a common fraction if needed."
    )
    solution = (
        f"The slope is $\\frac{{{y2} - ({y1})}}{{{x2} - ({x1})}} = "
        f"\\frac{{{y2 - y1}}}{{{x2 - x1}}} = {latex(value)}$."
    )
    return "Algebra", problem, solution, latex(value)


MATH_TEMPLATES: tuple[Callable[[random.Random], tuple[str, str, str, str]], ...] = (
    _fractions, _linear, _sqrt, _squares, _lcm, _series, _slope,
)  # fmt: skip


def math_style_rows(seed: int = MATH_SEED, n: int = MATH_TRAIN + MATH_TEST) -> list[dict]:
    """``n`` distinct rows ``{"messages", "answer", "type"}`` in the messages layout."""
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    while len(rows) < n:
        kind, problem, solution, answer = rng.choice(MATH_TEMPLATES)(rng)
        if problem in seen:
            continue
        seen.add(problem)
        messages = [
            {"role": "user", "content": problem},
            {"role": "assistant", "content": f"{solution} The answer is $\\boxed{{{answer}}}$."},
        ]
        rows.append({"messages": messages, "answer": answer, "type": kind})
    return rows


# ------------------------------------------------------------------- files
def tables() -> dict[str, Any]:
    """File name -> pyarrow Table of every example file."""
    import pyarrow as pa

    gsm8k_schema = pa.schema([("question", pa.string()), ("answer", pa.string())])
    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    math_schema = pa.schema(
        [("messages", pa.list_(message)), ("answer", pa.string()), ("type", pa.string())]
    )
    gsm8k, maths = gsm8k_style_rows(), math_style_rows()
    return {
        "gsm8k_style.parquet": pa.Table.from_pylist(gsm8k[:GSM8K_TRAIN], schema=gsm8k_schema),
        "gsm8k_style_test.parquet": pa.Table.from_pylist(gsm8k[GSM8K_TRAIN:], schema=gsm8k_schema),
        "math_style.parquet": pa.Table.from_pylist(maths[:MATH_TRAIN], schema=math_schema),
        "math_style_test.parquet": pa.Table.from_pylist(maths[MATH_TRAIN:], schema=math_schema),
    }


def write_examples(out: Path = HERE) -> list[Path]:
    """Write every example file into ``out``; returns their paths."""
    import pyarrow.parquet as pq

    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, table in tables().items():
        path = out / name
        pq.write_table(table, path, compression="zstd", compression_level=19)
        paths.append(path)
    return paths


if __name__ == "__main__":
    for written in write_examples(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE):
        print(f"{written} ({written.stat().st_size} bytes)")
