"""What every producer shares: :class:`Produced`, the scored batch a round trains on, and
:class:`Producer`, the interface of a schedule that makes it (docs/design.md, "Producers")."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from torch import Tensor

from ppokit.trainer.checks import NonFinite
from ppokit.trainer.groups import Filled

__all__ = ["Draw", "Produced", "Producer", "PutBack"]

#: The next batch of prompts: this process's data rows and their formatted prompts.
Draw = Callable[[], tuple[list[dict[str, Any]], list[str]]]

#: The last batch :data:`Draw` gave, not used: its prompts back into the data stream.
PutBack = Callable[[], None]


@dataclass
class Produced:
    """A round's scored batch: its kept groups and what was generated to find them
    (``filled``), the rewards of one greedy response per kept prompt repeated over its
    ``rollout.n`` rows (``baseline``, when a component requires ``baseline_rewards``), the
    seconds it took (``timings``: ``time_generate``, ``time_score``, ...), metrics of its
    own (``metrics``, e.g. the rows' staleness) and the non-finite counter its rewards were
    counted into (``checks``: the round goes on counting into it)."""

    filled: Filled
    checks: NonFinite
    baseline: Tensor | None = None
    timings: dict[str, float] = field(default_factory=dict)
    metrics: dict[str, Tensor] = field(default_factory=dict)


class Producer(Protocol):
    """The next round's scored batch, on one schedule: :meth:`next` makes (or takes) round
    ``round_no``'s; :meth:`trained` hears that the trainer's weights were updated by it
    (the engine follows, or not, as the schedule says); :meth:`before_evaluation` makes
    the engine hold the trainer's weights after ``round_no`` rounds;
    :meth:`state_dict` / :meth:`load_state_dict` are what a checkpoint keeps of it
    (``batches``: batches generated for later rounds, saved in ``checkpoint/ahead/``; any
    other key JSON, in ``state.json``); :meth:`close` ends it."""

    def next(self, round_no: int) -> Produced: ...

    def trained(self, round_no: int) -> dict[str, float]: ...

    def before_evaluation(self, round_no: int) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def close(self) -> None: ...
