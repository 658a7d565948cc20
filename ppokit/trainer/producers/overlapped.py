"""The synchronous schedule with scoring overlapped with generation
(``rollout.overlap_scoring``, when a reward waits on something else and episodes have one
turn): while batch k's waiting rewards are called on the scoring threads, the next batch is
drawn and generated ahead, when batch k is expected to leave the round short
(:class:`Lookahead`: at the run's share of passed groups so far, kept in the checkpoint).
When the round needs no further batch, the batch generated ahead goes back: its prompts to
the data stream (``put_back``) and torch's random state (the ``hf`` engine draws from it) to
what it was before it. So the batches that enter the round, their scores and the data
position are those of the same round without the overlap
(:mod:`~ppokit.trainer.producers.inline`)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ppokit.errors import UserError
from ppokit.trainer.producers.base import Draw, PutBack
from ppokit.trainer.producers.filling import Batch
from ppokit.trainer.producers.inline import Inline
from ppokit.trainer.setup import Setup

__all__ = ["Lookahead", "Overlapped"]


@dataclass
class Lookahead:
    """Whether to generate the next batch while one is scored: when the groups that passed
    so far plus those the batch being scored is expected to pass, at the run's share so far
    (``passed / drawn``, whole-round counts, so every process decides alike; 0 before any
    batch), fall short of the round's. Which batches are generated ahead changes no
    result, only how much generation goes back unused."""

    passed: int = 0
    drawn: int = 0

    def worth(self, passed: int, share: int) -> bool:
        """Whether a batch ahead is likely needed: ``passed`` of ``share`` groups passed
        before the batch being scored."""
        rate = self.passed / self.drawn if self.drawn else 0.0
        return passed + rate * share < share

    def add(self, passed: int, drawn: int) -> None:
        """A batch's whole-round counts: groups passed and drawn."""
        self.passed += passed
        self.drawn += drawn


@dataclass
class _Held:
    """A batch generated ahead, the seconds it took and torch's random state before it."""

    batch: Batch
    seconds: float
    random_state: list[Tensor]


class Overlapped(Inline):
    """:class:`~ppokit.trainer.producers.inline.Inline` with the next batch generated while
    one is scored; ``put_back`` returns the last batch ``draw`` gave to the data stream."""

    overlaps = True

    def __init__(self, setup: Setup, draw: Draw, put_back: PutBack) -> None:
        super().__init__(setup, draw)
        self.put_back = put_back
        self.lookahead = Lookahead()
        self._held: _Held | None = None

    def state_dict(self) -> dict[str, Any]:
        """The lookahead's counts (JSON)."""
        return {"lookahead": {"passed": self.lookahead.passed, "drawn": self.lookahead.drawn}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The lookahead's counts from :meth:`state_dict` (none: a checkpoint written before
        they were kept, which starts them again); a one-line error when malformed."""
        counts = state.get("lookahead")
        if counts is None:
            return
        passed = counts.get("passed") if isinstance(counts, dict) else None
        drawn = counts.get("drawn") if isinstance(counts, dict) else None
        if not (type(passed) is int and type(drawn) is int and passed >= 0 and drawn >= 0):
            raise UserError(f"checkpoint: the lookahead's counts are malformed ({counts!r})")
        self.lookahead = Lookahead(passed, drawn)

    # ------------------------------------------------------- fill's source of batches
    def held(self) -> Batch | None:
        held, self._held = self._held, None
        return None if held is None else held.batch

    def worth(self, passed: int, share: int) -> bool:
        return self.lookahead.worth(passed, share)

    def generate_ahead(self, number: int) -> float:
        state = _random_state(self.setup.device)
        start = time.perf_counter()
        batch = self.generate(number)
        seconds = time.perf_counter() - start
        self._held = _Held(batch, seconds, state)
        return seconds

    def counted(self, passed: int, drawn: int) -> None:
        self.lookahead.add(passed, drawn)

    def give_back(self) -> float | None:
        held, self._held = self._held, None
        if held is None:
            return None
        self.put_back()
        _set_random_state(self.setup.device, held.random_state)
        return held.seconds


def _random_state(device: torch.device) -> list[Tensor]:
    """Torch's random state: the CPU generator's, and the device's own."""
    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    elif device.type == "mps":
        states.append(torch.mps.get_rng_state())
    return states


def _set_random_state(device: torch.device, states: list[Tensor]) -> None:
    torch.set_rng_state(states[0])
    if device.type == "cuda":
        torch.cuda.set_rng_state(states[1], device)
    elif device.type == "mps":
        torch.mps.set_rng_state(states[1])
