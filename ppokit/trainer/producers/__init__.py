"""Producers: where a round's scored batch comes from (docs/design.md, "Producers"). A round
(:func:`~ppokit.trainer.round.run_round`) trains on what a producer made
(:class:`~ppokit.trainer.producers.base.Produced`); how and when it was made is the
producer's, one module per schedule:

- :mod:`.inline`: the synchronous schedule, each round's batches generated and scored when
  the round asks (dynamic sampling's refills: :func:`.filling.fill` over the producer);
- :mod:`.overlapped`: the same with the next batch generated while one is scored
  (``rollout.overlap_scoring``), its lookahead kept in the checkpoint;
- :mod:`.asynchronous`: batches generated ahead in a thread of their own, at most
  ``rollout.max_staleness`` updates off (:mod:`.schedule`);
- :mod:`.given`: a batch made elsewhere (tests, benchmarks, the asynchronous schedule's
  scoring).

:func:`make_producer` picks the run's. The trainer fills nothing itself: it asks
``producer.next(round)``, trains, tells ``producer.trained(round)`` and saves
``producer.state_dict()`` in the checkpoint. Only the trainer's loop and the round import
this package (tests/test_layers.py).
"""

from __future__ import annotations

from ppokit.trainer.producers.asynchronous import Asynchronous
from ppokit.trainer.producers.base import Draw, Produced, Producer, PutBack
from ppokit.trainer.producers.given import Given
from ppokit.trainer.producers.inline import Inline, starting_with
from ppokit.trainer.producers.overlapped import Overlapped
from ppokit.trainer.setup import Setup

__all__ = [
    "Asynchronous",
    "Draw",
    "Given",
    "Inline",
    "Overlapped",
    "Produced",
    "Producer",
    "PutBack",
    "make_producer",
    "starting_with",
]


def make_producer(
    setup: Setup, draw: Draw, put_back: PutBack, *, start: int = 0, threads: int | None = None
) -> Producer:
    """The run's producer on ``setup``: batches from ``draw`` (``put_back``: the last one
    back, unused); asynchronous (``rollout.max_staleness`` > 0) from round ``start`` on,
    generating with ``threads`` torch threads; overlapped (``rollout.overlap_scoring``);
    else inline."""
    rollout = setup.spec.rollout
    if rollout.max_staleness:
        return Asynchronous(setup, draw, start=start, threads=threads)
    if rollout.overlap_scoring:
        return Overlapped(setup, draw, put_back)
    return Inline(setup, draw)
