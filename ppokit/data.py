"""Prompt sources: where the rows of a run's prompts come from.

``data.source`` in the spec selects one:

- ``demo``: rows of the built-in demo task (``ppokit.tasks.demo.make_row``);
- ``arithmetic``: generated arithmetic problems with their exact answers;
- anything else: a path to a JSONL file, one object with a ``"prompt"`` per line, cycled
  through (reshuffled each epoch when ``data.shuffle``).

Each row is a dict with ``"prompt"`` plus every other column (e.g. ``"answer"``), which the
rewards receive as fields. A source is deterministic given its seed, and its
:meth:`~PromptSource.state_dict` (JSON-serialisable) resumes the exact sequence of rows: a
resumed run draws the same rows as an uninterrupted one. Generated rows are a function of
``(seed, row number)`` only, so the state is just the number of rows drawn.
"""

from __future__ import annotations

import hashlib
import json
import random
from abc import ABC, abstractmethod
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from ppokit.errors import UserError
from ppokit.registry import format_validation_error
from ppokit.spec import ArithmeticOptions, DataSpec, DemoOptions

Options = TypeVar("Options", bound=BaseModel)

__all__ = [
    "ArithmeticSource",
    "DemoSource",
    "GeneratedSource",
    "JsonlSource",
    "PromptSource",
    "format_prompts",
    "make_arithmetic_row",
    "make_prompt_source",
]


class PromptSource(ABC):
    """An endless, deterministic stream of data rows."""

    #: Name stored in the state, checked when a state is loaded.
    kind: str = ""

    def __init__(self, seed: int) -> None:
        self.seed = int(seed)
        self.drawn = 0

    @abstractmethod
    def row(self, index: int) -> dict[str, Any]:
        """The ``index``-th row of the stream (0-based), a fresh dict."""

    def next_rows(self, n: int) -> list[dict[str, Any]]:
        """The next ``n`` rows."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        rows = [self.row(self.drawn + i) for i in range(n)]
        self.drawn += n
        return rows

    def state_dict(self) -> dict[str, Any]:
        return {"source": self.kind, "seed": self.seed, "drawn": self.drawn}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("source") != self.kind:
            raise UserError(
                f"the checkpoint's prompt source is {state.get('source')!r}, "
                f"the spec's is {self.kind!r}"
            )
        self.seed = int(state["seed"])
        self.drawn = int(state["drawn"])


class GeneratedSource(PromptSource):
    """Rows made by ``make_row(rng)``, the rng seeded from ``(seed, row number)``."""

    def __init__(self, seed: int, make_row: Callable[[random.Random], dict[str, Any]]) -> None:
        super().__init__(seed)
        self.make_row = make_row

    def row(self, index: int) -> dict[str, Any]:
        rng = random.Random(f"ppokit:{self.kind}:{self.seed}:{index}")
        row = self.make_row(rng)
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise UserError(f"the {self.kind} source made a row without a string 'prompt'")
        return dict(row)


class DemoSource(GeneratedSource):
    """Rows of the built-in demo task."""

    kind = "demo"

    def __init__(self, seed: int, options: dict[str, Any]) -> None:
        from ppokit.tasks.demo import make_row

        settings = _options(DemoOptions, options)
        super().__init__(seed, lambda rng: make_row(rng, settings.symbols))


# ----------------------------------------------------------------- arithmetic
_INSTRUCTION = "Put the final answer in \\boxed{}."


def _options(model: type[Options], options: dict[str, Any]) -> Options:
    """``options`` validated by the source's options model; a UserError naming each problem."""
    try:
        return model.model_validate(options)
    except ValidationError as err:
        lines = format_validation_error(err, prefix="data.options")
        raise UserError("; ".join(lines).replace("Value error, ", "")) from None


def _format_number(value: int) -> str:
    return f"({value})" if value < 0 else str(value)


def _format_answer(value: Fraction) -> str:
    if value.denominator == 1:
        return str(value.numerator)
    return f"{value.numerator}/{value.denominator}"


def _evaluate(numbers: list[int], ops: list[str]) -> Fraction:
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


def make_arithmetic_row(rng: random.Random, **options: Any) -> dict[str, Any]:
    """One problem: ``{"prompt", "answer", "expression"}``; the answer is exact (``a/b``
    when a division leaves a fraction). ``options``: those of ``ArithmeticOptions``."""
    o = _options(ArithmeticOptions, options)
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
        "prompt": f"What is {expression}? {_INSTRUCTION}",
        "answer": _format_answer(_evaluate(numbers, chosen)),
        "expression": expression,
    }


class ArithmeticSource(GeneratedSource):
    """Arithmetic problems over integers in ``[min_value, max_value]`` with ``terms``
    operands and operators drawn from ``ops`` (default ``"+-*"``)."""

    kind = "arithmetic"

    def __init__(self, seed: int, options: dict[str, Any]) -> None:
        settings = _options(ArithmeticOptions, options).model_dump()
        super().__init__(seed, lambda rng: make_arithmetic_row(rng, **settings))


# ----------------------------------------------------------------------- JSONL
def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The rows of a JSONL file (blank lines skipped), each an object with a string prompt."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(
            f"data file not found: {path} (data.source is 'demo', 'arithmetic' or a JSONL path)"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: cannot read: {exc}") from None
    rows = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}:{lineno}: invalid JSON: {exc.msg}") from None
        if not isinstance(row, dict):
            raise UserError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
        if "prompt" not in row:
            raise UserError(f"{path}:{lineno}: the row has no 'prompt' field")
        if not isinstance(row["prompt"], str):
            raise UserError(f"{path}:{lineno}: 'prompt' must be a string")
        rows.append(row)
    if not rows:
        raise UserError(f"{path}: the data file has no rows")
    return rows


class JsonlSource(PromptSource):
    """The rows of a JSONL file, cycled; each epoch in a fresh seeded order when ``shuffle``."""

    kind = "jsonl"

    def __init__(self, seed: int, path: str | Path, shuffle: bool = True) -> None:
        super().__init__(seed)
        self.path = Path(path)
        self.rows = read_jsonl(self.path)
        self.shuffle = shuffle
        self.fingerprint = hashlib.sha256(self.path.read_bytes()).hexdigest()[:16]
        self._order_epoch = -1
        self._order: list[int] = []

    def order(self, epoch: int) -> list[int]:
        """Row indices in the order of ``epoch``."""
        if epoch != self._order_epoch:
            order = list(range(len(self.rows)))
            if self.shuffle:
                random.Random(f"ppokit:jsonl:{self.seed}:{epoch}").shuffle(order)
            self._order, self._order_epoch = order, epoch
        return self._order

    def row(self, index: int) -> dict[str, Any]:
        epoch, offset = divmod(index, len(self.rows))
        return dict(self.rows[self.order(epoch)[offset]])

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "fingerprint": self.fingerprint}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("source") == self.kind and state.get("fingerprint") != self.fingerprint:
            raise UserError(
                f"{self.path}: the data file changed since the checkpoint was written; "
                "the resumed run would not see the same prompts"
            )
        super().load_state_dict(state)
        self._order_epoch = -1


def make_prompt_source(data_spec: DataSpec, seed: int) -> PromptSource:
    """The prompt source ``data_spec.source`` names, seeded with ``seed``."""
    options = dict(data_spec.options)
    if data_spec.source == "demo":
        return DemoSource(seed, options)
    if data_spec.source == "arithmetic":
        return ArithmeticSource(seed, options)
    if options:
        raise UserError(
            f"data.options: a JSONL source takes no options, got {', '.join(sorted(options))}"
        )  # a validated spec never gets here
    return JsonlSource(seed, data_spec.source, shuffle=data_spec.shuffle)


# -------------------------------------------------------------------- formatting
def format_prompts(rows: list[dict[str, Any]], tokenizer: Any, data_spec: DataSpec) -> list[str]:
    """The text the policy sees for each row: its prompt, or the prompt in the tokenizer's
    chat template (with ``data.system_prompt`` as a system message) when
    ``data.chat_template``."""
    prompts = [str(row["prompt"]) for row in rows]
    if not data_spec.chat_template:
        return prompts
    if not getattr(tokenizer, "chat_template", None):
        raise UserError(
            "data.chat_template is true but the tokenizer has no chat template; "
            "set data.chat_template: false"
        )
    system = (
        [{"role": "system", "content": data_spec.system_prompt}]
        if data_spec.system_prompt is not None
        else []
    )
    return [
        tokenizer.apply_chat_template(
            [*system, {"role": "user", "content": prompt}],
            tokenize=False,
            add_generation_prompt=True,
        )
        for prompt in prompts
    ]
