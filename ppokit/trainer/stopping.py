"""A run that stops between checkpoints keeps its last finished round.

At the end of each round :class:`Boundary` keeps what a checkpoint holds besides the weights
and the optimizers' states (RNG states, the prompt source's, the environment's and the
producer's states, β): small copies. A round changes the weights and the optimizers only from
its first optimizer step on, so until then the run can still be saved as it was when the
last round ended: a Ctrl-C, a SIGTERM or an error in that part of a round (generation,
scoring: a reward that raises, a reward server that went away) saves the checkpoint of the
last finished round (:meth:`Boundary.save`) and drops the round in progress. A Ctrl-C (or
SIGTERM) after the first optimizer step is held until the round ends
(:func:`ppokit.bounded.holding_interrupts`), whose checkpoint is then saved; a second one
stops at once, without it.

One process only, and synchronous rollouts only: on several processes the others may be
anywhere in a collective, and an asynchronous producer's batches ahead are being generated
(such a run keeps its last periodic checkpoint, as a killed one does).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import Tensor

from ppokit.bounded import holding_interrupts
from ppokit.errors import UserError, error_lines
from ppokit.runfolder import how_to_continue
from ppokit.trainer.checkpoint import capture_rng, checkpoint_round, restore_rng, save_checkpoint
from ppokit.trainer.models import Models
from ppokit.trainer.report import Reporter
from ppokit.trainer.setup import Setup, State

__all__ = ["Boundary", "Ends", "Stopped"]


class _Kept:
    """A stand-in whose ``state_dict()`` is a state kept earlier."""

    def __init__(self, state: Any) -> None:
        self.state = state

    def state_dict(self) -> Any:
        return self.state


@dataclass
class Boundary:
    """The run as it was when round ``round`` ended (0: before the first), besides its
    weights and optimizers: those are unchanged while ``state.optimizers.taken`` is
    ``steps``."""

    round: int
    steps: int
    rng: dict[str, Any]
    source: Any
    environment: Any
    producer: dict[str, Any]
    kl_coef: Tensor

    @classmethod
    def take(
        cls, round_done: int, state: State, source: Any, environment: Any, producer: Any
    ) -> Boundary:
        """The boundary after round ``round_done``."""
        return cls(
            round=round_done,
            steps=state.optimizers.taken,
            rng=capture_rng(),
            source=copy.deepcopy(source.state_dict()),
            environment=None if environment is None else copy.deepcopy(environment.state_dict()),
            producer=copy.deepcopy(producer.state_dict()),
            kl_coef=state.kl_coef.detach().clone(),
        )

    def intact(self, state: State) -> bool:
        """Whether the weights and optimizers are still this boundary's."""
        return state.optimizers.taken == self.steps

    def save(self, out: Path, models: Models, state: State, spec_yaml: str) -> bool:
        """Save this boundary's checkpoint unless it is the one there or the weights moved
        on (or it is round 0); whether it saved. The process's RNG states are set back to
        the boundary's (the run is ending)."""
        if self.round == 0 or not self.intact(state) or checkpoint_round(out) == self.round:
            return False
        restore_rng(self.rng)
        environment = None if self.environment is None else _Kept(self.environment)
        kept = dataclasses.replace(state, kl_coef=self.kl_coef)
        save_checkpoint(
            out, models, kept, _Kept(self.source), self.round, spec_yaml, self.producer, environment
        )
        return True


class Stopped(UserError):
    """Where a run stopped by an error a user can fix keeps its work, and the command that
    continues it (:meth:`describe`): the trainer attaches it to the error it re-raises, as
    its ``stopped`` attribute."""

    def __init__(self, message: str, out: Path, checkpoint: int | None) -> None:
        super().__init__(message)
        self.out = out
        self.checkpoint = checkpoint

    def describe(self, command: Sequence[str] | None = None) -> list[str]:
        """What the run keeps and the command that continues it; ``command`` is the
        ``ppokit train SPEC [--set ...]`` that started the run."""
        base = list(command) if command else ["ppokit", "train", "SPEC"]
        return list(how_to_continue(self.out, base, self.checkpoint))

    def lines(self, command: Sequence[str] | None = None) -> list[str]:
        """The lines that tell the stop: the error's, the last of them with what the run
        keeps (``error: ...; the last checkpoint is round N (DIR/checkpoint)``, as an
        interrupted run's line says it), then the command that continues it."""
        state, then = self.describe(command)
        *lines, last = error_lines(self)
        return [*lines, f"{last}; {state}", then]


class Ends:
    """The rounds' ends of a run (module docstring): :meth:`round_ended` after each,
    :meth:`holding` around each, :meth:`save` when the run stops."""

    def __init__(self, setup: Setup, state: State, source: Any, producer: Any, start: int):
        self.setup, self.state, self.source, self.producer = setup, state, source, producer
        self.boundary = self._take(start)

    def _take(self, round_done: int) -> Boundary:
        environment = self.setup.assembly.environment
        return Boundary.take(round_done, self.state, self.source, environment, self.producer)

    def round_ended(self, round_done: int) -> None:
        self.boundary = self._take(round_done)

    def holding(self, display: Reporter, round_no: int) -> contextlib.AbstractContextManager[None]:
        """Round ``round_no``: a Ctrl-C after its first optimizer step is held to its end."""

        def told() -> None:
            display.message(
                f"stopping after round {round_no}, whose update has begun: it ends and is "
                "saved (Ctrl-C again to stop now, without it)"
            )

        return holding_interrupts(lambda: not self.boundary.intact(self.state), told)

    def save(self, out: Path, spec_yaml: str, display: Reporter) -> None:
        """The checkpoint of the last finished round, when the weights are still its (a
        failure to save is a warning: the stop's own cause is the one to tell)."""
        try:
            if self.boundary.save(out, self.setup.models, self.state, spec_yaml):
                display.message(f"saved the checkpoint of round {self.boundary.round}")
        except UserError as exc:
            display.message(f"warning: {exc}")
