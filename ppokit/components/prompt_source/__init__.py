"""Prompt sources (``data.source``): where the rows of a run's prompts come from. Created
with its parameters, a prompt source is called once with the run's data seed and gives the
stream of rows: ``source(seed) -> PromptSource``, an endless, deterministic stream of data
rows (each a dict with a string ``prompt`` plus any other columns, e.g. ``answer``, which the
rewards receive as fields) that resumes exactly from its ``state_dict()``.

This module is the torch-free catalogue; the built-ins' code is
:mod:`ppokit.components.prompt_source.impl`, their streams :mod:`ppokit.data`.
"""

from __future__ import annotations

import random
import re
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, Protocol

from pydantic import Field, field_validator, model_validator

from ppokit.catalogue import Component, Params
from ppokit.errors import UserError
from ppokit.tasks.demo import SYMBOLS as DEMO_SYMBOLS

__all__ = [
    "ARITHMETIC",
    "DEMO",
    "ENTRIES",
    "FILE",
    "HF",
    "ArithmeticParams",
    "DemoParams",
    "FileParams",
    "GeneratedSource",
    "HubParams",
    "PromptSource",
    "PromptSourceFactory",
    "RowParams",
    "answer_pattern_problem",
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

    def put_back(self, n: int) -> None:
        """The last ``n`` rows drawn go back: the next :meth:`next_rows` gives them again
        (the stream is the same whatever was drawn and put back)."""
        if not 0 <= n <= self.drawn:
            raise ValueError(f"cannot put back {n} of {self.drawn} rows drawn")
        self.drawn -= n

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

    def __init__(
        self,
        seed: int,
        make_row: Callable[[random.Random], dict[str, Any]],
        kind: str | None = None,
    ) -> None:
        super().__init__(seed)
        self.make_row = make_row
        if kind is not None:  # a generator made without a subclass names itself here
            self.kind = kind

    def row(self, index: int) -> dict[str, Any]:
        rng = random.Random(f"ppokit:{self.kind}:{self.seed}:{index}")
        row = self.make_row(rng)
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise UserError(f"the {self.kind} source made a row without a string 'prompt'")
        return dict(row)


class PromptSourceFactory(Protocol):
    """``source(seed) -> PromptSource``: the stream of rows for the run's data seed.

    The stream is a :class:`PromptSource`: ``row(index)`` (a fresh dict, a
    function of the seed and the index only), ``next_rows(n)``, ``put_back(n)``, and
    ``state_dict()`` (JSON-ready, saved in every checkpoint; it names the source and holds
    the seed) with ``load_state_dict(state)``, which resumes the exact sequence of rows. A
    generator subclasses :class:`GeneratedSource` (rows made by
    ``make_row(rng)``, the rng seeded from the source's name, the seed and the row number),
    a table :class:`ppokit.data.RowSource`. The source is created, and a data file read and
    each of its rows checked, before any model is loaded.

    Optional: a stream with ``observe(round_no, reward_mean) -> dict[str, float] | None``
    hears, after each round, the round's ``reward_mean`` (the whole round's: on several
    processes the reduced one, the same on each), before the round is recorded and its
    checkpoint written; what it returns (metric name -> number) goes into the round's
    metrics. A stream that learns from it (a curriculum: the ``reasoning_gym`` source's
    ``curriculum``) keeps what it learned in its ``state_dict()``, so a resumed run draws
    the rows the uninterrupted run would. Streams without it are not called.
    """

    def __call__(self, seed: int) -> PromptSource: ...


MODULE = "ppokit.components.prompt_source.impl"


class DemoParams(Params):
    """Options of the built-in ``demo`` source."""

    symbols: str = Field(
        DEMO_SYMBOLS, min_length=1, max_length=256, description="the symbols a prompt may show"
    )
    turns: int = Field(
        1,
        ge=1,
        le=64,
        description="more than 1: each row also has 'symbols', one drawn symbol per turn (the "
        "first is the prompt's), for the echo environment",
    )


class ArithmeticParams(Params):
    """Options of the built-in ``arithmetic`` source."""

    ops: str = Field(
        "+-*", pattern=r"^[-+*/]+$", description="operators drawn from, characters of '+-*/'"
    )
    min_value: int = Field(0, ge=-(10**9), le=10**9, description="smallest operand")
    max_value: int = Field(99, ge=-(10**9), le=10**9, description="largest operand")
    terms: int = Field(2, ge=2, le=64, description="operands per problem")

    @model_validator(mode="after")
    def _range(self) -> ArithmeticParams:
        if self.min_value > self.max_value:
            raise ValueError(
                f"min_value ({self.min_value}) must not exceed max_value ({self.max_value})"
            )
        if "/" in self.ops and self.min_value == self.max_value == 0:
            raise ValueError("division needs a non-zero value in [min_value, max_value]")
        return self


def answer_pattern_problem(pattern: str) -> str | None:
    """Why ``pattern`` cannot extract an answer (one line), or None."""
    try:
        groups = re.compile(pattern).groups
    except re.error as exc:
        return f"not a regular expression: {exc}"
    if groups != 1:
        return f"needs exactly one capturing group, the answer (use (?:...) for the others), got {groups}"
    return None


#: A Hub dataset's name: ``owner/name`` (or a bare ``name``).
HUB_DATASET = r"[\w.-]+(/[\w.-]+)?"


class RowParams(Params):
    """How the rows of a table (a data file or a Hub dataset) become ppokit rows: the
    settings every table source takes."""

    split: str = Field(
        "train",
        min_length=1,
        description="the split to read: of a Hub dataset or of a folder with several splits",
    )
    columns: dict[str, str] = Field(
        default_factory=dict,
        description="ppokit field -> the data's column, e.g. {prompt: question, answer: "
        "final}; other columns keep their names",
    )
    answer_pattern: str | None = Field(
        None,
        description="regular expression with one group that extracts the gold answer from "
        "the answer column (GSM8K: '####\\s*(.+)$')",
    )
    shuffle: bool = Field(True, description="shuffle the rows of a data file each epoch")

    @field_validator("columns")
    @classmethod
    def _columns(cls, value: dict[str, str]) -> dict[str, str]:
        if any(not name or not column for name, column in value.items()):
            raise ValueError("field and column names must not be empty")
        return value

    @field_validator("answer_pattern")
    @classmethod
    def _answer_pattern(cls, value: str | None) -> str | None:
        problem = None if value is None else answer_pattern_problem(value)
        if problem is not None:
            raise ValueError(problem)
        return value


class _Path(Params):
    path: str = Field(
        min_length=1,
        description="a local data file or folder (.jsonl, .json, .parquet, .csv, .arrow, a "
        "folder of data files or one written by save_to_disk); all but .jsonl need pip "
        "install 'ppokit[data]'",
    )


class _Dataset(Params):
    dataset: str = Field(
        pattern=f"^{HUB_DATASET}$", description="the Hub dataset, owner/name (as in hf:owner/name)"
    )
    config: str | None = Field(
        None, min_length=1, description="the configuration of a Hub dataset (hf: sources)"
    )


class FileParams(RowParams, _Path):
    """The ``file`` source's: its path, then the table's settings."""


class HubParams(RowParams, _Dataset):
    """The ``hf`` source's: the dataset and its configuration, then the table's settings."""


DEMO = Component(
    "prompt_source",
    "demo",
    MODULE,
    params=DemoParams,
    summary="Rows of the built-in demo task: a prompt shows one symbol, the answer echoes it",
    formula="row i = make_row(Random('ppokit:demo:{seed}:{i}')): {prompt, answer} (ppokit.tasks.demo)",
    source="ppokit's built-in demo task (echo the prompt's symbol)",
)

ARITHMETIC = Component(
    "prompt_source",
    "arithmetic",
    MODULE,
    params=ArithmeticParams,
    summary="Generated arithmetic problems over integers in [min_value, max_value] with "
    "their exact answers",
    formula="row i = make_row(Random('ppokit:arithmetic:{seed}:{i}')): terms operands, "
    "operators from ops; answer exact (a fraction where a division leaves one)",
    source="ppokit's built-in arithmetic task (ppokit.tasks.arithmetic)",
)

FILE = Component(
    "prompt_source",
    "file",
    MODULE,
    params=FileParams,
    summary="The rows of a local data file or folder, cycled: each epoch visits every row "
    "once (in a fresh seeded order when shuffle)",
    formula="row i = map(table[order(i // N)[i % N]]), N rows, order(epoch) a seeded "
    "permutation; map: columns, the last user message of chat messages, answer_pattern",
    source="a JSONL file read by ppokit; other formats by the datasets package (Hugging Face)",
)

HF = Component(
    "prompt_source",
    "hf",
    MODULE,
    params=HubParams,
    summary="The rows of a Hugging Face Hub dataset (from the local cache when offline), "
    "cycled as a data file's",
    formula="as file, over datasets.load_dataset(dataset, config, split=split)",
    source="the Hugging Face Hub, read by the datasets package",
)

#: Every built-in prompt source, registered by the default plugin.
ENTRIES: tuple[Component, ...] = (DEMO, ARITHMETIC, FILE, HF)
