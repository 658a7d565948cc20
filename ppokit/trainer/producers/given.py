"""A batch generated (and perhaps scored) elsewhere, as a round's only batch: what a test,
a benchmark or the asynchronous schedule hands a round
(:mod:`~ppokit.trainer.producers.asynchronous`)."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from ppokit.trainer.producers.filling import Batch
from ppokit.trainer.producers.inline import Inline
from ppokit.trainer.rollout import Rollout
from ppokit.trainer.scoring import Scores
from ppokit.trainer.setup import Setup

__all__ = ["Given"]


class Given(Inline):
    """Round after round on ``setup``, each round's only batch the one :meth:`give` was
    last handed: ``rows``, their ``formatted`` prompts, the responses (``rollout.n`` per
    prompt) and, when scored already, their rewards R (or
    :class:`~ppokit.trainer.scoring.Scores` with each reward's)."""

    def __init__(self, setup: Setup) -> None:
        super().__init__(setup, self._no_draw, refills=False)
        self._batch: Batch | None = None

    @classmethod
    def of(
        cls,
        setup: Setup,
        rows: list[dict[str, Any]],
        formatted: list[str],
        rollout: Rollout,
        scores: Tensor | Scores | None = None,
    ) -> Given:
        """A producer handed that batch."""
        given = cls(setup)
        given.give(rows, formatted, rollout, scores)
        return given

    def give(
        self,
        rows: list[dict[str, Any]],
        formatted: list[str],
        rollout: Rollout,
        scores: Tensor | Scores | None = None,
    ) -> None:
        """The next round's batch."""
        self._batch = Batch(rows, formatted, rollout, scores)

    def held(self) -> Batch | None:
        batch, self._batch = self._batch, None
        return batch

    def _no_draw(self) -> tuple[list[dict[str, Any]], list[str]]:
        raise RuntimeError("a given batch is a round's only one")
