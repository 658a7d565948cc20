"""What a run tells its user while it works: the :class:`Reporter` protocol that the model
loading, the rounds and the outer loop speak to, and :class:`Silent`, the reporter of
nobody listening (a process other than the first, a test, the API without a display).
:class:`~ppokit.trainer.display.Display` is the live one."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

__all__ = ["Reporter", "Silent"]


class Reporter(Protocol):
    """The events of a run, in the order they come: steps before the rounds (``step`` and
    their own ``status``), each round (``start_round``, its ``phase`` changes and the
    engine's decoding ``generation`` steps, then ``round`` with its record), lines
    (``message``), and at the end ``summary`` and ``close``."""

    def message(self, text: str) -> None: ...

    def step(self, name: str, passes: int | None = None) -> None: ...

    def status(self, text: str) -> None: ...

    def start_round(self, round_no: int) -> None: ...

    def phase(self, name: str) -> None: ...

    def generation(self, step: int, steps: int, rows: int) -> None: ...

    def resumed(self, start: int) -> None: ...

    def round(self, record: dict[str, Any], total: int) -> None: ...

    def summary(self, history: Sequence[dict[str, Any]], out: str) -> None: ...

    def close(self) -> None: ...


class Silent:
    """A :class:`Reporter` that shows nothing."""

    def message(self, text: str) -> None:
        """A line of the run."""

    def step(self, name: str, passes: int | None = None) -> None:
        """A step before the rounds begins (``loading the actor ...``)."""

    def status(self, text: str) -> None:
        """The step's own progress (``tensor 12/272``)."""

    def start_round(self, round_no: int) -> None:
        """Round ``round_no`` (1-based) begins."""

    def phase(self, name: str) -> None:
        """A phase of the round begins (:data:`~ppokit.trainer.round.PHASES`)."""

    def generation(self, step: int, steps: int, rows: int) -> None:
        """The engine decoded ``step`` of at most ``steps`` tokens for ``rows`` responses."""

    def resumed(self, start: int) -> None:
        """The run continues after round ``start``."""

    def round(self, record: dict[str, Any], total: int) -> None:
        """A round ended, with its record."""

    def summary(self, history: Sequence[dict[str, Any]], out: str) -> None:
        """The run ended: its summary."""

    def close(self) -> None:
        """Nothing more is shown."""
