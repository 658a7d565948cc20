"""Environments (``rollout.environment``): what answers the model between its turns in a
multi-turn rollout. The contract, :class:`~ppokit.environments.Environment` and
:class:`~ppokit.environments.Step`, lives in :mod:`ppokit.environments`; an environment is
registered like any other component.

``none`` (the default) is today's single-turn rollout: one model turn, no environment text.

Optional member: ``single_turn`` (default False), True for an environment that never adds
text and ends every episode after one turn (``none``): the trainer then samples the plain
way and never calls it.

This module is the torch-free catalogue; the implementations are
:mod:`ppokit.components.environment.impl`.
"""

from __future__ import annotations

from pydantic import Field, field_validator

from ppokit import papers
from ppokit.catalogue import Component, Contract, NoParams, Params
from ppokit.environments import Environment, Step

__all__ = ["CONTRACT", "ENTRIES", "Environment", "Step"]

CONTRACT = Contract(
    "environment",
    optional={
        "single_turn": "True: one model turn and no environment text (the trainer samples the "
        "plain way and never calls it)",
        "state_dict": "state_dict() -> what it keeps across episodes (JSON-like: dicts, lists, "
        "numbers, text, tensors), saved in every checkpoint",
        "load_state_dict": "load_state_dict(state): takes a checkpoint's state back on resume",
    },
)
MODULE = "ppokit.components.environment.impl"


class CalculatorParams(Params):
    open: str = Field(
        "<calc>", min_length=1, max_length=32, description="the text that opens a call"
    )
    close: str = Field(
        "</calc>", min_length=1, max_length=32, description="the text that closes a call"
    )
    max_length: int = Field(
        200, ge=1, le=10_000, description="the longest expression evaluated, in characters"
    )
    open_first: bool = Field(
        False,
        description="the first turn starts inside a call: reset writes the opening text after "
        "the prompt, so the model's first turn begins with an expression (for a model that "
        "does not call the tool on its own yet)",
    )


class EchoParams(Params):
    field: str = Field(
        "symbols",
        min_length=1,
        description="the data row's field with one symbol per turn (the demo source writes "
        "it with data.options.turns)",
    )

    @field_validator("field")
    @classmethod
    def _identifier(cls, value: str) -> str:
        if not value.isidentifier():
            raise ValueError(f"must be a column name, got {value!r}")
        return value


NONE = Component(
    "environment",
    "none",
    MODULE,
    params=NoParams,
    summary="No environment: one model turn per prompt (the single-turn rollout)",
    formula="episode = prompt → response",
    source=str(papers.PPO),
)

CALCULATOR = Component(
    "environment",
    "calculator",
    MODULE,
    params=CalculatorParams,
    summary="A calculator tool: a turn that writes <calc>EXPR</calc> gets the value of its last "
    "call back; a turn without a call ends the episode",
    formula=(
        "observation = 'Result: ' + value(EXPR) (exact rational arithmetic: + - * / // % ** "
        "and parentheses, no names), turn reward 0, done ⇔ no call; the spec's rewards score "
        "the transcript; open_first: reset returns the opening text, and turn 0 is read as "
        "opening + response"
    ),
    source=papers.cite(
        ("calculator calls inside the text", papers.TOOLFORMER),
        ("tool output masked out of the loss", papers.SEARCH_R1),
    ),
)

ECHO = Component(
    "environment",
    "echo",
    MODULE,
    params=EchoParams,
    summary="The demo's echo task over several turns: after each turn the environment shows "
    "the next symbol ('echo c'), and each turn is scored on the symbol it answers",
    formula=(
        "turn k of K = len(row[field]): reward_k = echo_score(response_k, s_k) / K, "
        "observation '\\necho s_{k+1}', done ⇔ k = K − 1; an episode's return is in [0, 1], "
        "and ignoring the observations scores at most 1/|symbols| on turns after the first"
    ),
    source=str(papers.SEARCH_R1),
)

#: Every built-in environment, registered by the default plugin.
ENTRIES: tuple[Component, ...] = (NONE, CALCULATOR, ECHO)
