"""The synchronous schedule: each round's batches are drawn, generated and scored when the
round asks for them (:func:`~ppokit.trainer.producers.filling.fill`, batch after batch while
the filter has passed too few groups), from the weights the round starts with; after the
update the engine follows the policy (its ``sync``)."""

from __future__ import annotations

import time
from typing import Any

from ppokit.trainer.checks import counting
from ppokit.trainer.producers.base import Draw, Produced
from ppokit.trainer.producers.filling import Batch, fill
from ppokit.trainer.setup import Setup

__all__ = ["Inline", "starting_with"]


def starting_with(
    rows: list[dict[str, Any]], formatted: list[str], then: Draw | None = None
) -> Draw:
    """A :data:`~ppokit.trainer.producers.base.Draw` that gives ``rows`` and their
    ``formatted`` prompts first, then what ``then`` gives."""
    first = [(rows, formatted)]

    def draw() -> tuple[list[dict[str, Any]], list[str]]:
        if first:
            return first.pop()
        assert then is not None, "no batch after the first"
        return then()

    return draw


class Inline:
    """Round after round on ``setup``: the batches ``draw`` gives (only its first each round
    when not ``refills``), generated when the round needs them."""

    #: the schedule generates nothing ahead of the scoring
    overlaps = False

    def __init__(self, setup: Setup, draw: Draw, *, refills: bool = True) -> None:
        self.setup = setup
        self.draw = draw
        self.refills = refills
        self.round = 0

    # ------------------------------------------------------------------ the producer
    def next(self, round_no: int) -> Produced:
        """Round ``round_no``'s batches (1-based), generated and scored now; with the
        greedy baseline's rewards when a component requires ``baseline_rewards``."""
        setup = self.setup
        self.round = round_no
        setup.forwards.eval_mode()  # sampling and scoring see no dropout
        timings: dict[str, float] = {}
        parts = setup.assembly
        with counting() as checks:
            filled = fill(
                self, scorer=setup.scorer, group_filter=parts.filter, settings=setup.spec.rollout,
                timings=timings, phase=setup.reporter.phase,
            )  # fmt: skip
            baseline = None
            kept = filled.kept
            if kept is not None and "baseline_rewards" in parts.requires:
                start = time.perf_counter()  # one greedy response per kept prompt
                greedy = setup.sample(round_no, kept.formatted, 1, rows=kept.rows, greedy=True)
                rewards = setup.scorer.rollout(kept.rows, greedy)[0].total
                baseline = rewards.repeat_interleave(setup.spec.rollout.n)
                timings["time_score"] += time.perf_counter() - start
        return Produced(filled, checks, baseline, timings)

    def trained(self, round_no: int) -> dict[str, float]:
        """The engine follows the policy updated by round ``round_no``: ``time_sync``."""
        start = time.perf_counter()
        self.setup.engine.sync()
        return {"time_sync": time.perf_counter() - start}

    def before_evaluation(self, round_no: int) -> None:
        """The engine already holds the trainer's weights."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing to restore."""

    def close(self) -> None:
        """Nothing runs beside the rounds."""

    # ------------------------------------------------------- fill's source of batches
    def held(self) -> Batch | None:
        return None

    def generate(self, number: int) -> Batch:
        rows, formatted = self.draw()
        n = self.setup.spec.rollout.n
        return Batch(rows, formatted, self.setup.sample(self.round, formatted, n, number, rows))

    def worth(self, passed: int, share: int) -> bool:
        return False

    def generate_ahead(self, number: int) -> float:
        raise NotImplementedError("the inline schedule generates nothing ahead")

    def counted(self, passed: int, drawn: int) -> None:
        """Nothing to learn."""

    def give_back(self) -> float | None:
        return None
