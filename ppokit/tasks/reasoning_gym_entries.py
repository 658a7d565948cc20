"""The catalogue of reasoning-gym's prompt source and reward (their code:
:mod:`ppokit.tasks.reasoning_gym`): parameters and entries, without reasoning-gym or torch."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from ppokit import papers
from ppokit.catalogue import Component, Params
from ppokit.papers import cite

__all__ = [
    "INSTALL",
    "INSTRUCTION",
    "REWARD",
    "SET_BY_SOURCE",
    "SOURCE",
    "CurriculumParams",
    "ReasoningGymParams",
    "ReasoningGymRewardParams",
    "curriculum_fields",
]

#: The install line of the packages of the ``tasks`` extra.
INSTALL = "pip install 'ppokit[tasks]'"
#: The answer's form, after each question (reasoning-gym's convention: its checkers score
#: the text between the last <answer> tags).
INSTRUCTION = "Put the final answer between <answer> and </answer>."
#: The configuration keys the source sets itself.
SET_BY_SOURCE = ("seed", "size")


def curriculum_fields(curriculum: Any) -> dict[str, str]:
    """The configuration fields a reasoning-gym curriculum sets: field -> its attribute
    (a range attribute sets two, its lower and upper field)."""
    fields: dict[str, str] = {}
    for name, attr in curriculum.attributes.items():
        for key in ("lower_field_name", "upper_field_name", "field_name"):
            if isinstance(getattr(attr, key, None), str):
                fields[getattr(attr, key)] = name
    return fields


class CurriculumParams(Params):
    """The ``reasoning_gym`` source's curriculum: when the levels rise."""

    threshold: float = Field(
        0.7,
        allow_inf_nan=False,
        description="the next attribute goes up one level when the mean reward_mean of the "
        "last window rounds at the current levels is at least this",
    )
    window: int = Field(4, ge=1, le=10_000, description="rounds the mean is taken over")


class ReasoningGymParams(Params):
    """The ``reasoning_gym`` source's: the generator, its configuration and the split."""

    dataset: str = Field(
        "basic_arithmetic",
        pattern=r"^[a-z][a-z0-9_]*$",
        description="the reasoning-gym generator (countdown, chain_sum, gsm_symbolic, "
        "puzzle24, ...: reasoning_gym.factory.DATASETS)",
    )
    config: dict[str, Any] = Field(
        default_factory=dict,
        description="the generator's configuration (its config class's fields, e.g. "
        "{min_numbers: 3} for countdown); seed and size are the source's",
    )
    size: int = Field(
        100_000,
        ge=1,
        le=1 << 31,
        description="entries of the generator's dataset the rows are drawn from (a few "
        "generators, acre and list_functions, build them all when created)",
    )
    split: Literal["train", "test"] = Field(
        "train",
        description="train: the questions whose SHA-256 has an even first byte; test: the "
        "others (held out: never in the train split)",
    )
    instruction: str = Field(
        INSTRUCTION, description="text after each question: the answer's form ('' for none)"
    )
    curriculum: CurriculumParams | None = Field(
        None,
        description="reasoning-gym's curriculum of the generator (its coaching levels), "
        "e.g. {threshold: 0.7, window: 4}: the rows start at level 0 of every attribute and "
        "one attribute goes up a level at a time as the reward rises (docs/tasks.md); none: "
        "config alone",
    )

    @field_validator("config")
    @classmethod
    def _config(cls, value: dict[str, Any]) -> dict[str, Any]:
        for key in SET_BY_SOURCE:
            if key in value:
                raise ValueError(f"{key} is set by the source (the run's seed, size), not config")
        try:
            json.dumps(value)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"must be plain JSON values: {exc}") from None
        return value

    @model_validator(mode="after")
    def _curriculum(self) -> ReasoningGymParams:
        if self.curriculum is None:
            return self
        from importlib.util import find_spec

        if find_spec("reasoning_gym") is None:  # refused as a missing package
            return self
        from reasoning_gym.factory import CURRICULA, DATASETS, create_curriculum

        if self.dataset not in DATASETS:  # named by the source, with the close names
            return self
        if self.dataset not in CURRICULA:
            without = ", ".join(sorted(set(DATASETS) - set(CURRICULA)))
            raise ValueError(
                f"reasoning-gym has no curriculum for {self.dataset!r} (none for: {without}): "
                "set curriculum: null"
            )
        fields = curriculum_fields(create_curriculum(self.dataset))
        if taken := sorted(set(self.config) & set(fields)):
            raise ValueError(
                f"config sets {', '.join(taken)}, which the curriculum sets (attributes "
                f"{', '.join(sorted({fields[k] for k in taken}))}): drop them from config"
            )
        return self


class ReasoningGymRewardParams(Params):
    field: str = Field("entry", description="data column holding the encoded entry")
    tag: str = Field(
        "answer",
        pattern=r"^\w*$",
        description="the answer is the text of the response's last <tag>...</tag> (none: "
        "scored as no answer); '' scores the whole response",
    )


SOURCE = Component(
    "prompt_source",
    "reasoning_gym",
    "ppokit.tasks.reasoning_gym",
    params=ReasoningGymParams,
    summary="Questions of a reasoning-gym generator with their answers and metadata, "
    "split by a hash of the question into train and held-out test",
    formula="row i = the first D[hash(seed, i, t) mod size], t = 0, 1, ..., whose question "
    "is in the split (sha256(question)[0] odd: test, even: train); D = "
    "reasoning_gym.create_dataset(dataset, seed=hash(seed), size=size, **config); with "
    "curriculum, config completed by the curriculum at the current levels",
    source=cite(("reasoning-gym", papers.REASONING_GYM)),
    packages=(("reasoning_gym", INSTALL),),
)

REWARD = Component(
    "reward",
    "reasoning_gym",
    "ppokit.tasks.reasoning_gym",
    params=ReasoningGymRewardParams,
    summary="reasoning-gym's own checker: the generator's score_answer on the response's "
    "last <answer>...</answer>",
    formula="r = D.score_answer(extract_answer(response, tag), entry) in [0, 1] (partial "
    "credit where the checker gives it; 0 without an answer or where the checker fails)",
    source=cite(("reasoning-gym", papers.REASONING_GYM)),
    packages=(("reasoning_gym", INSTALL),),
)
