"""The asynchronous schedule (``rollout.max_staleness`` S > 0, docs/async.md): round k's
batch is generated from the weights of version v(k) = max(floor, k − 1 − S) in a thread of
its own while the rounds before k update (version v: the weights after v updates; floor:
the trainer's version when the schedule starts, 0 for a new run).

Staleness is bounded by admission: a batch is submitted only when the engine holds exactly
the version it needs, and the engine's weights are pushed (the trainer's current ones, the
only version the trainer has) only once every batch that needs an older version has been
generated. So no generation runs during a push, no batch mixes two versions, and no batch
is dropped. The schedule is a function of S, the rounds and the data stream alone: the
version of every batch, its rows and the order the rounds consume them in do not depend on
how long generating or updating takes.

With S = 1 the engine generates round k + 1's batch from the weights before round k's
update while round k updates (one step off the policy); the first round trains on the
initial weights' samples. Model-free: the jobs, the push and the data are callables.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

__all__ = ["THREAD", "Job", "Ready", "Schedule", "version_of"]

T = TypeVar("T")


def version_of(round_no: int, max_staleness: int, floor: int = 0) -> int:
    """The version of the weights that generate round ``round_no``'s batch (1-based)."""
    return max(floor, round_no - 1 - max_staleness)


@dataclass(frozen=True)
class Job:
    """One batch to generate: the round that trains on it (1-based), the version of the
    weights that generate it, and its data rows and formatted prompts."""

    round: int
    version: int
    rows: list[dict[str, Any]]
    formatted: list[str]


@dataclass(frozen=True)
class Ready(Generic[T]):
    """A generated batch: its job, what the job made, the seconds it took and when it
    ended (``time.perf_counter``)."""

    job: Job
    out: T
    seconds: float = 0.0
    ended: float = 0.0


#: The name of the schedule's thread (its prefix).
THREAD = "ppokit-generation"
#: The waits and pushes a schedule measures, as round metrics.
WAITS = ("time_wait_engine", "time_wait_trainer", "time_sync")


class Schedule(Generic[T]):
    """Round ``start + 1`` to ``last_round``'s batches, ``max_staleness`` updates off.

    ``draw()`` gives the next batch's rows and formatted prompts (called in order, in the
    caller's thread, as batches are admitted); ``generate(job)`` runs in the schedule's
    thread; ``push()`` gives the engine the trainer's
    current weights (in the caller's thread, while no job runs). ``ready``: batches already
    generated for the rounds after ``start`` (a checkpoint's), in order. The engine holds
    the weights of version ``start`` when the schedule starts.
    """

    def __init__(
        self,
        *,
        max_staleness: int,
        last_round: int,
        start: int,
        draw: Callable[[], tuple[list[dict[str, Any]], list[str]]],
        generate: Callable[[Job], T],
        push: Callable[[], None],
        ready: Sequence[Ready[T]] = (),
    ) -> None:
        self.max_staleness = max_staleness
        self.last_round = last_round
        self.floor = start
        self.draw = draw
        self.generate = generate
        self.push = push
        self.engine_version = start
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=THREAD)
        self._queue: deque[tuple[Job, Future[Ready[T]]]] = deque()
        for r in ready:
            done: Future[Ready[T]] = Future()
            done.set_result(r)
            self._queue.append((r.job, done))
        self._next = start + 1 + len(ready)
        self._last: Future[Ready[T]] | None = None  # the batch submitted last
        self.waits = dict.fromkeys(WAITS, 0.0)

    def version_of(self, round_no: int) -> int:
        """The version of the weights that generate round ``round_no``'s batch."""
        return version_of(round_no, self.max_staleness, self.floor)

    def admit(self, version: int) -> None:
        """Submit every batch that the weights of ``version`` (the trainer's now) or older
        generate: the push of ``version`` first, once the batches that need older weights
        are generated."""
        while self._next <= self.last_round:
            need = self.version_of(self._next)
            if need > version:
                break
            if need != self.engine_version:  # need == version: the weights it has now
                self._current(version)
            rows, formatted = self.draw()
            job = Job(self._next, need, rows, formatted)
            last = self._last
            if last is not None and last.done():  # the engine waited for the trainer
                self.waits["time_wait_trainer"] += max(
                    0.0, time.perf_counter() - last.result().ended
                )
            self._last = self._pool.submit(self._run, job)
            self._queue.append((job, self._last))
            self._next += 1

    def _run(self, job: Job) -> Ready[T]:
        start = time.perf_counter()
        out = self.generate(job)
        end = time.perf_counter()
        return Ready(job, out, end - start, end)

    def _idle(self) -> None:
        """Wait until every submitted batch is generated (an error in one is raised)."""
        start = time.perf_counter()
        try:
            for _, future in self._queue:
                future.result()
            if self._last is not None:
                self._last.result()
        finally:
            self.waits["time_wait_engine"] += time.perf_counter() - start

    def _current(self, version: int) -> None:
        self._idle()
        start = time.perf_counter()
        self.push()
        self.waits["time_sync"] += time.perf_counter() - start
        self.engine_version = version

    def take(self, round_no: int, version: int) -> Ready[T]:
        """Round ``round_no``'s batch, the trainer holding the weights of ``version``
        (waiting for it to be generated)."""
        self.admit(version)
        if not self._queue or self._queue[0][0].round != round_no:
            got = self._queue[0][0].round if self._queue else None
            raise RuntimeError(f"the schedule has round {got}'s batch, not round {round_no}'s")
        _, future = self._queue.popleft()
        start = time.perf_counter()
        try:
            return future.result()
        finally:
            self.waits["time_wait_engine"] += time.perf_counter() - start

    def current(self, version: int) -> None:
        """Give the engine the trainer's weights of ``version`` now (for an evaluation of
        them), once the batches that need older ones are generated."""
        if self.engine_version != version:
            self._current(version)

    def pending(self) -> list[Ready[T]]:
        """The batches admitted and not yet taken, in order, once generated (what a
        checkpoint saves)."""
        self._idle()
        return [future.result() for _, future in self._queue]

    def measured(self) -> dict[str, float]:
        """The seconds waited and pushed since the last call: ``time_wait_engine`` (the
        trainer waited for the engine), ``time_wait_trainer`` (the engine, idle, waited for
        the trainer's next admission) and ``time_sync`` (pushes)."""
        out, self.waits = self.waits, dict.fromkeys(WAITS, 0.0)
        return out

    def close(self) -> None:
        """No more batches: those queued are cancelled (a running one ends on its own)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
