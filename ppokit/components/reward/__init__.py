"""Reward components: ``reward(prompts, responses, **fields) -> scores [B]``.

A reward returns one float32 score per response (a tensor or a list of floats).
``responses`` are the model's own text (with an environment: the model's turns, without the
environment's text). ``fields`` hold one list entry per response: every column of the
prompt's data row (e.g. ``answer``) plus ``lengths`` (the model's tokens), ``truncated`` and
``transcripts`` (with an environment the whole episode, the environment's text included;
else the response). A data column cannot take the name of what the trainer passes
(:data:`RESERVED_FIELDS`). A reward ignores the fields it does not use and raises a
:class:`~ppokit.errors.UserError` naming a field it needs but did not get. Each reward gets
its own copies of its inputs.

This module is the torch-free catalogue; the tensor code is
:mod:`ppokit.components.reward.impl`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from pydantic import Field, field_validator, model_validator

from ppokit import papers
from ppokit.catalogue import Component, Contract, NoParams, Params
from ppokit.papers import cite

if TYPE_CHECKING:
    from torch import Tensor


class Reward(Protocol):
    """``reward(prompts, responses, **fields) -> [B]`` scores."""

    def __call__(
        self, prompts: list[str], responses: list[str], **fields: Any
    ) -> Tensor | Sequence[float]: ...


CONTRACT = Contract("scores")

#: What the trainer passes to every reward beside the data columns (``completions``:
#: TRL's name for the responses; ``self``: a reward object's own parameter). A data column of
#: one of these names is refused: it would shadow them.
RESERVED_FIELDS: tuple[str, ...] = (
    "prompts",
    "responses",
    "completions",
    "lengths",
    "truncated",
    "transcripts",
    "self",
)
MODULE = "ppokit.components.reward.impl"

__all__ = [
    "RESERVED_FIELDS",
    "DemoParams",
    "ExactMatchParams",
    "HFClassifierParams",
    "LengthPenaltyParams",
    "MathVerifyParams",
    "PythonParams",
    "RegexParams",
    "register_components",
    "split_function",
]


class MathVerifyParams(Params):
    field: str = Field("answer", description="data column holding the gold answer")
    correct: float = Field(1.0, description="reward when the answers agree")
    incorrect: float = Field(0.0, description="reward otherwise (including unparsable text)")


class ExactMatchParams(Params):
    field: str = Field("answer", description="data column holding the expected response")
    strip: bool = Field(True, description="ignore leading and trailing whitespace")
    case_sensitive: bool = Field(False, description="compare case-sensitively")


class RegexParams(Params):
    pattern: str = Field(
        description="a regular expression (the 'regex' package's syntax, a superset of Python's re)"
    )
    field: str | None = Field(
        None, description="data column the first capture group must equal (None: any match)"
    )
    mode: Literal["search", "fullmatch"] = Field(
        "search", description="'search' anywhere in the response or 'fullmatch' all of it"
    )
    timeout: float = Field(
        1.0,
        gt=0,
        le=3600,
        description="seconds one response's match may take; one that runs over (a pattern "
        "that backtracks exponentially) scores 0",
    )

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, value: str) -> str:
        import regex

        try:
            regex.compile(value)
        except regex.error as exc:
            raise ValueError(f"invalid regular expression {value!r}: {exc}") from None
        return value

    @model_validator(mode="after")
    def _group_for_field(self) -> RegexParams:
        import regex

        if self.field is not None and regex.compile(self.pattern).groups < 1:
            raise ValueError(
                f"pattern {self.pattern!r} needs a capture group when 'field' is set "
                f"(the first group is compared with {self.field!r})"
            )
        return self


class LengthPenaltyParams(Params):
    target: int = Field(0, ge=0, description="tokens allowed without penalty")
    scale: float = Field(0.01, ge=0, description="penalty per token beyond target")
    max_length: int | None = Field(
        None, ge=1, description="lengths beyond this count as max_length (caps the penalty)"
    )

    @model_validator(mode="after")
    def _max_above_target(self) -> LengthPenaltyParams:
        if self.max_length is not None and self.max_length <= self.target:
            raise ValueError(
                f"max_length ({self.max_length}) must be greater than target ({self.target})"
            )
        return self


class HFClassifierParams(Params):
    path: str = Field(description="local directory of a sequence-classification model")
    label: int | str | None = Field(
        None,
        description="index or name of the positive label (probability of it); "
        "None: the raw logit of a single-logit head",
    )
    batch_size: int = Field(16, ge=1, description="responses per forward pass")
    max_length: int = Field(512, ge=1, description="tokens of prompt + response kept")
    device: str = Field(
        "auto",
        pattern=r"^(auto|cpu|mps|cuda(:[0-9]+)?)$",
        description="'auto', 'cpu', 'cuda', 'cuda:N'",
    )

    @field_validator("path")
    @classmethod
    def _a_model_directory(cls, value: str) -> str:
        folder = Path(value).expanduser()
        if not folder.is_dir():
            raise ValueError(f"model directory not found: {value}")
        if not (folder / "config.json").is_file():
            raise ValueError(f"{value} has no config.json: not a Hugging Face model directory")
        return value


_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def split_function(value: str) -> tuple[str, str, bool]:
    """``(where, name, is_file)`` of ``"path/to/file.py:fn"`` (a file: it ends in ``.py``
    or names a folder) or ``"package.module:fn"``; ValueError naming the expected form."""
    where, sep, name = value.strip().rpartition(":")
    form = "expected 'path/to/file.py:function' or 'package.module:function'"
    if not sep or not where or not _IDENTIFIER.fullmatch(name):
        raise ValueError(f"{value!r}: {form}")
    is_file = where.endswith(".py") or "/" in where or "\\" in where
    if not is_file and not all(_IDENTIFIER.fullmatch(part) for part in where.split(".")):
        raise ValueError(f"{value!r}: {where!r} is neither a .py file nor a module name; {form}")
    return where, name, is_file


class PythonParams(Params):
    function: str = Field(
        description="'path/to/file.py:fn' (relative to the working directory) or "
        "'package.module:fn' (importable): fn(prompts, responses, **fields) returns one "
        "number per response; ppokit imports and runs this code"
    )

    @field_validator("function")
    @classmethod
    def _a_function_reference(cls, value: str) -> str:
        split_function(value)  # the form only: validating a spec runs no code
        return value


MATH_VERIFY = Component(
    "reward",
    "math_verify",
    MODULE,
    params=MathVerifyParams,
    summary="1 when the response's final answer is mathematically equal to the gold answer",
    formula="r = correct if verify(parse(answer), parse(response)) else incorrect",
    source=str(papers.TULU3),
)


EXACT_MATCH = Component(
    "reward",
    "exact_match",
    MODULE,
    params=ExactMatchParams,
    summary="1 when the response equals the expected text (after normalisation)",
    formula="r = 1[norm(response) == norm(answer)], norm = strip and casefold by default",
    source=str(papers.TULU3),
)


REGEX = Component(
    "reward",
    "regex",
    MODULE,
    params=RegexParams,
    summary="1 when a regular expression matches (optionally capturing the answer)",
    formula="r = 1[pattern matches response within timeout] (and group(1) == field when field "
    "is set)",
    source=str(papers.R1),
)


LENGTH_PENALTY = Component(
    "reward",
    "length_penalty",
    MODULE,
    params=LengthPenaltyParams,
    summary="linear penalty on response tokens beyond a target length",
    formula="r = -scale * max(0, min(L, max_length) - target)",
    source=str(papers.DAPO),
)


HF_CLASSIFIER = Component(
    "reward",
    "hf_classifier",
    MODULE,
    params=HFClassifierParams,
    summary="a local Hugging Face sequence classifier scoring (prompt, response) pairs",
    formula="r = p(label | prompt, response), or the logit of a single-logit head",
    source=str(papers.INSTRUCTGPT),
)


PYTHON = Component(
    "reward",
    "python",
    MODULE,
    params=PythonParams,
    summary="your own Python function fn(prompts, responses, **fields), from a file or module",
    formula="r = fn(prompts, responses, **fields), or fn(prompts=, completions=, **fields) for a "
    "TRL reward function; fields it has no parameter for are not passed",
    source=cite(
        ("verifiable rewards as code", papers.TULU3),
        "as TRL's reward_funcs and verl's custom_reward_function",
    ),
)


DEMO = Component(
    "reward",
    "demo",
    "ppokit.tasks.demo",
    params=NoParams,
    summary="Reward of the built-in demo task",
    formula="r = |{i < 4 : response[i] = s}| / 4 for the symbol s the prompt shows",
    source="ppokit's built-in demo task (echo the prompt's symbol)",
)

#: Every built-in reward component, registered by the default plugin.
ENTRIES: tuple[Component, ...] = (
    MATH_VERIFY,
    EXACT_MATCH,
    REGEX,
    LENGTH_PENALTY,
    HF_CLASSIFIER,
    PYTHON,
    DEMO,
)
