"""reasoning-gym's procedural generators as a prompt source and a reward (``pip install
'ppokit[tasks]'``): ``data: {source: {name: reasoning_gym, dataset: countdown}}`` and
``reward: reasoning_gym``.

The source's stream for the run's seed ``s`` reads one generator dataset,
``reasoning_gym.create_dataset(dataset, seed=S, size=size, **config)`` (``S`` drawn from
``s``). Row ``i`` is the first of its entries ``D[j(s, i, 0)], D[j(s, i, 1)], ...`` (``j``:
a hash of the seed, the row and the attempt, modulo ``size``) whose question falls in the
row's split: the questions whose SHA-256 digest has an even first byte are the ``train``
split, the others the ``test`` split. Which split a question belongs to is a function of
its text alone, so a held-out prompt never appears in the training stream, whatever the
seeds. Row ``i`` is a function of ``(s, split, i)``: the stream resumes exactly from
``(seed, drawn)``.

A row: ``prompt`` (the question, then ``instruction``: reasoning-gym's own questions state
the form of the answer, and its convention puts the answer between ``<answer>`` tags),
``question``, ``answer`` (the generator's gold answer), ``metadata`` (the entry's metadata as
plain JSON) and ``entry``: where the entry comes from (the dataset's name, configuration,
seed and size, and the entry's index) as JSON. The reward rebuilds the entry from ``entry``,
exactly as generated (its metadata's tuples and fractions included), and calls the
generator's own ``score_answer`` on the response's last ``<answer>...</answer>`` (partial
credit where the checker gives it).

With ``curriculum`` (``{threshold, window}``), ``config`` is completed by reasoning-gym's
curriculum of the generator (``create_curriculum(dataset).generate_configuration(config)``
at the current levels: the fields the curriculum sets are its own) and ``D`` is that
configuration's dataset, the same seed and size. The levels start at 0 and rise as
:mod:`ppokit.tasks.curriculum` says, on the round's mean reward the trainer hands to
:meth:`ReasoningGymStream.observe`; a row is drawn at the levels current when it is drawn
(``entry`` names its configuration), and the levels and the rewards kept are in the state,
so a resumed run draws the rows the uninterrupted run would. The held-out split is read
without a curriculum: it keeps the configuration it is given.

Nothing here imports torch; reasoning-gym is imported when a source or reward is created.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from functools import lru_cache
from typing import Any, Literal

from ppokit.components.prompt_source import PromptSource
from ppokit.components.reward import Scored
from ppokit.errors import UserError, one_line
from ppokit.metrics_table import CURRICULUM
from ppokit.tasks.curriculum import Levels
from ppokit.tasks.reasoning_gym_entries import (
    REWARD,
    SOURCE,
    CurriculumParams,
    ReasoningGymParams,
    curriculum_fields,
)

__all__ = ["MAX_TRIES", "ReasoningGym", "ReasoningGymReward", "ReasoningGymStream", "held_out"]

#: Entries tried for one row before the generator is refused: a question is in a split with
#: probability 1/2, so a generator with many distinct questions never needs this many.
MAX_TRIES = 64


def held_out(question: str) -> bool:
    """Whether ``question`` belongs to the ``test`` split (else to ``train``): the first
    byte of its SHA-256 digest is odd."""
    return bool(hashlib.sha256(question.encode("utf-8")).digest()[0] & 1)


def _draw(*parts: Any) -> int:
    digest = hashlib.sha256(":".join(map(str, ("ppokit:reasoning_gym", *parts))).encode())
    return int.from_bytes(digest.digest()[:8], "big")


def _plain(value: Any) -> Any:
    """``value`` as plain JSON (tuples as lists, keys as text); anything else as its repr."""
    return json.loads(json.dumps(value, default=repr))


def _known(name: str) -> None:
    """A UserError naming the close generators when reasoning-gym has none called ``name``."""
    from reasoning_gym.factory import DATASETS

    if name not in DATASETS:
        from ppokit.registry import suggest

        raise UserError(
            f"reasoning_gym: no generator {name!r}{suggest(name, sorted(DATASETS))} "
            f"({len(DATASETS)} of them: python -c 'import reasoning_gym.factory as f; "
            "print(sorted(f.DATASETS))')"
        )


@lru_cache(maxsize=64)
def _dataset(name: str, config: str, seed: int, size: int) -> Any:
    """The generator's dataset (``config``: its JSON), a UserError naming what is wrong."""
    import reasoning_gym

    _known(name)
    try:
        return reasoning_gym.create_dataset(name, seed=seed, size=size, **json.loads(config))
    except Exception as exc:  # the generator's own check of its configuration
        raise UserError(f"reasoning_gym {name!r}: bad config {config}: {one_line(exc)}") from None


def _curriculum(name: str, params: CurriculumParams) -> tuple[Any, Levels]:
    """reasoning-gym's curriculum of generator ``name`` and its levels, all at 0."""
    from reasoning_gym.factory import CURRICULA, create_curriculum

    _known(name)
    if name not in CURRICULA:
        raise UserError(f"reasoning_gym: reasoning-gym has no curriculum for {name!r}")
    curriculum = create_curriculum(name)
    sizes = {a: len(attr.levels) for a, attr in curriculum.attributes.items()}
    return curriculum, Levels(sizes, params.threshold, params.window)


def _leveled(params: ReasoningGymParams, curriculum: Any, levels: Levels) -> dict[str, Any]:
    """``params.config`` with the fields the curriculum sets at ``levels``, plain JSON."""
    for attribute, level in levels.levels.items():
        curriculum.set_attr_level(attribute, level)
    try:
        made = curriculum.generate_configuration(dict(params.config))
    except Exception as exc:  # the configuration class's own check
        raise UserError(
            f"reasoning_gym {params.dataset!r}: the curriculum at levels {levels.levels} "
            f"with config {params.config}: {one_line(exc)}"
        ) from None
    fields = curriculum_fields(curriculum)
    return {**params.config, **{f: _plain(getattr(made, f)) for f in fields}}


class ReasoningGymStream(PromptSource):
    """The stream of rows of one split (the module docstring)."""

    kind = "reasoning_gym"

    def __init__(self, seed: int, params: ReasoningGymParams) -> None:
        super().__init__(seed)
        self.params = params
        self.curriculum: Any = None  # reasoning-gym's, with the levels
        self.levels: Levels | None = None
        if params.curriculum is not None:
            self.curriculum, self.levels = _curriculum(params.dataset, params.curriculum)
        self._configure()

    def _configure(self) -> None:
        """The dataset of the configuration: ``config``, at the curriculum's levels."""
        p = self.params
        self.entry_config = p.config
        if self.levels is not None:
            self.entry_config = _leveled(p, self.curriculum, self.levels)
        self.config = json.dumps(self.entry_config, sort_keys=True)
        self.dataset_seed = _draw(self.seed) % (1 << 31)
        self.data = _dataset(p.dataset, self.config, self.dataset_seed, p.size)

    def observe(self, round_no: int, reward_mean: float) -> dict[str, float]:
        """The round's mean reward (the whole round's): the curriculum's levels may rise;
        the levels after it, as metrics (``curriculum/<attribute>``). Without a curriculum,
        nothing."""
        if self.levels is None:
            return {}
        if self.levels.observe(reward_mean) is not None:
            self._configure()
        return {f"{CURRICULUM}{a}": float(v) for a, v in self.levels.levels.items()}

    def row(self, index: int) -> dict[str, Any]:
        p = self.params
        want = p.split == "test"
        for attempt in range(MAX_TRIES):
            j = _draw(self.seed, index, attempt) % p.size
            entry = self.data[j]
            if held_out(entry["question"]) == want:
                return self._row(entry, j)
        raise UserError(
            f"reasoning_gym {p.dataset!r}: {MAX_TRIES} entries in a row fell outside the "
            f"{p.split!r} split: the configuration gives too few distinct questions to hold "
            "some out"
        )

    def _row(self, entry: dict[str, Any], index: int) -> dict[str, Any]:
        p = self.params
        question, answer = entry["question"], entry["answer"]
        where = {"dataset": p.dataset, "config": self.entry_config, "seed": self.dataset_seed}
        return {
            "prompt": f"{question.rstrip()}\n\n{p.instruction}" if p.instruction else question,
            "question": question,
            "answer": answer if isinstance(answer, str) else _plain(answer),
            "metadata": _plain(entry.get("metadata", {})),
            "entry": json.dumps({**where, "size": p.size, "index": index}),
        }

    def state_dict(self) -> dict[str, Any]:
        state = {**super().state_dict(), "dataset": self.params.dataset, "split": self.params.split}
        if self.levels is not None:
            state["curriculum"] = self.levels.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        p = self.params
        if state.get("source") == self.kind and (state.get("dataset"), state.get("split")) != (
            p.dataset,
            p.split,
        ):
            raise UserError(
                f"the checkpoint's prompts are reasoning_gym {state.get('dataset')!r} "
                f"({state.get('split')}), the spec's {p.dataset!r} ({p.split})"
            )
        super().load_state_dict(state)
        if self.levels is not None and "curriculum" in state:  # else: from level 0
            self.levels.load_state_dict(state["curriculum"])
        self._configure()


@SOURCE.implementation
class ReasoningGym:
    def __init__(
        self,
        *,
        dataset: str,
        config: dict[str, Any],
        size: int,
        split: Literal["train", "test"],
        instruction: str,
        curriculum: CurriculumParams | dict[str, Any] | None,
    ) -> None:
        self.params = ReasoningGymParams.model_validate(
            {
                "dataset": dataset,
                "config": config,
                "size": size,
                "split": split,
                "instruction": instruction,
                "curriculum": curriculum,
            }
        )

    def __call__(self, seed: int) -> PromptSource:
        return ReasoningGymStream(seed, self.params)


def _answer(response: str, tag: str) -> str | None:
    """The text of the last ``<tag>...</tag>`` (reasoning_gym.utils.extract_answer's rule)."""
    if not tag:
        return response.strip()
    found = list(re.finditer(f"<{tag}>\\s?(.*?)\\s?</{tag}>", response, flags=re.DOTALL))
    return found[-1].group(1).strip() if found else None


def _where(value: Any) -> tuple[str, str, int, int, int]:
    """(dataset, config JSON, seed, size, index) of a row's ``entry``."""
    try:
        w = json.loads(value) if isinstance(value, str) else value
        name, config = w["dataset"], json.dumps(w["config"], sort_keys=True)
        seed, size, index = (int(w[k]) for k in ("seed", "size", "index"))
        if not isinstance(name, str) or not 0 <= index < size:
            raise ValueError("out of range")
    except (ValueError, TypeError, KeyError) as exc:
        raise UserError(f"the reasoning_gym reward: a bad entry {value!r:.80}: {exc}") from None
    return name, config, seed, size, index


@REWARD.implementation
class ReasoningGymReward:
    """Flags ``unparsed`` (reward/reasoning_gym/unparsed_frac): responses without an answer
    between the tags."""

    def __init__(self, *, field: str, tag: str) -> None:
        self.field, self.tag = field, tag

    def __call__(self, prompts: Sequence[str], responses: Sequence[str], **fields: Any) -> Scored:
        values = fields.get(self.field)
        if values is None or len(values) != len(responses):
            given = ", ".join(sorted(fields)) or "none"
            raise UserError(
                f"the reasoning_gym reward needs the field {self.field!r}, one per response "
                f"(the reasoning_gym source's rows have it); fields given: {given}"
            )
        scores, unparsed = [], []
        entries: dict[Any, dict[str, Any]] = {}  # a group's responses share their entry
        for response, value in zip(responses, values, strict=True):
            where = _where(value)
            data = _dataset(*where[:4])
            if where not in entries:
                entries = {where: data[where[4]]}
            answer = _answer(response, self.tag)
            unparsed.append(answer is None)
            try:
                score = float(data.score_answer(answer, entries[where]))
            except Exception:  # the checker failed on this answer: no credit
                score = 0.0
            scores.append(score if score == score else 0.0)
        return Scored(scores, {"unparsed": unparsed})
