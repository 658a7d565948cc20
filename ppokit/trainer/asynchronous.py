"""A run's asynchronous rollouts (``rollout.max_staleness`` > 0, docs/async.md): the
:class:`~ppokit.trainer.schedule.Schedule` with jobs that generate on the run's engine in a
thread of their own, with a tokenizer of their own and, on a CPU, torch threads of their
own; the weight push is the engine's ``sync``; each round's record gains the rows'
staleness and the time each side waited for the other.

The round itself is :func:`~ppokit.trainer.round.run_round` on the batch generated ahead
(``rollout=``, the greedy baseline ``greedy=``): it scores it, recomputes log π_old at the
weights the update starts from (the decoupled objective: the ratio and its clip against
π_old, the rollout correction weighting π_old/μ) and updates; the engine is not synced
after it.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ppokit.trainer.checkpoint.ahead import Ahead
from ppokit.trainer.episodes import Sampler
from ppokit.trainer.groups import Draw
from ppokit.trainer.report import Reporter
from ppokit.trainer.rollout import PromptEncoder, Rollout
from ppokit.trainer.round import RoundResult, run_round
from ppokit.trainer.schedule import THREAD, Job, Ready, Schedule
from ppokit.trainer.setup import Setup, State

__all__ = ["AsyncRollouts", "Cancelled", "Generated"]

#: torch's own thread setting, kept before vLLM replaces it with a no-op once it binds its
#: threads: the generation thread sets its threads with it.
_SET_THREADS = torch.set_num_threads


class Cancelled(Exception):
    """The run ended while a batch was being generated: the generation stops."""


@dataclass(frozen=True)
class Generated:
    """What a job makes: the batch's responses and, when a component requires
    ``baseline_rewards`` (ReMax), one greedy response per prompt from the same weights."""

    rollout: Rollout
    greedy: Rollout | None = None


class _Background:
    """The run's reporter, except the engine's decoding steps in the generation thread: they
    are not shown (the trainer's phases are), and after :meth:`AsyncRollouts.close` they
    stop the generation (:class:`Cancelled`)."""

    def __init__(self, reporter: Reporter) -> None:
        self.reporter = reporter
        self.closed = False

    def message(self, text: str) -> None:
        self.reporter.message(text)

    def step(self, name: str, passes: int | None = None) -> None:
        self.reporter.step(name, passes)

    def status(self, text: str) -> None:
        self.reporter.status(text)

    def start_round(self, round_no: int) -> None:
        self.reporter.start_round(round_no)

    def phase(self, name: str) -> None:
        self.reporter.phase(name)

    def generation(self, step: int, steps: int, rows: int) -> None:
        if not threading.current_thread().name.startswith(THREAD):
            self.reporter.generation(step, steps, rows)
        elif self.closed:
            raise Cancelled("the run ended")

    def resumed(self, start: int) -> None:
        self.reporter.resumed(start)

    def round(self, record: dict[str, Any], total: int) -> None:
        self.reporter.round(record, total)

    def summary(self, history: Sequence[dict[str, Any]], out: str) -> None:
        self.reporter.summary(history, out)

    def close(self) -> None:
        self.reporter.close()


class AsyncRollouts:
    """The asynchronous rounds of a run on ``setup`` from round ``start`` (its rounds done)
    on: batches drawn by ``draw``, generated with ``threads`` torch threads (None: as
    they are; the rounds keep the threads set when this is made), ``ahead`` those a
    checkpoint saved. :meth:`close` ends it."""

    def __init__(
        self,
        setup: Setup,
        draw: Draw,
        *,
        start: int,
        threads: int | None = None,
        ahead: Sequence[Ahead] = (),
    ) -> None:
        spec = setup.spec
        self.setup = setup
        tokenizer = copy.deepcopy(setup.models.tokenizer)  # a fast tokenizer is not shared
        encode = PromptEncoder(tokenizer, setup.models.actor, setup.device)
        self.sampler = Sampler(
            setup.engine, setup.assembly.environment, encode, tokenizer, spec.rollout
        )
        self.baseline = "baseline_rewards" in setup.assembly.requires
        self.reporter = _Background(setup.reporter)
        self.outer = setup.reporter
        setup.reporter = self.reporter

        self.threads = threads
        self.stream: Any = None  # the generation's CUDA stream, on a GPU
        self.trainer_threads = torch.get_num_threads()  # the run's, set before
        ready = [
            Ready(Job(a.round, a.version, a.rows, a.formatted), Generated(a.rollout, a.greedy))
            for a in ahead
        ]
        self.schedule: Schedule[Generated] = Schedule(
            max_staleness=spec.rollout.max_staleness,
            last_round=spec.train.rounds,
            start=start,
            draw=draw,
            generate=self.generate,
            push=self.push,
            ready=ready,
        )

    def push(self) -> None:
        """The trainer's weights into the engine (no generation runs); on a GPU they are
        written before the next generation reads them on its own stream."""
        self.setup.engine.sync()
        if self.setup.device.type == "cuda":
            torch.cuda.synchronize(self.setup.device)

    def generate(self, job: Job) -> Generated:
        """The job's batch (and greedy baseline), in the schedule's thread: with its own
        torch threads on a CPU (set again for each job: OpenMP's setting may be shared between
        threads once both have computed), on a CUDA stream of its own on a GPU (so its
        kernels run beside the update's, not queued behind them)."""
        if self.threads is not None:
            _SET_THREADS(self.threads)
        device = self.setup.device
        if device.type != "cuda":
            return self._generate(job)
        if self.stream is None:
            self.stream = torch.cuda.Stream(device)
        with torch.cuda.stream(self.stream):
            out = self._generate(job)
        self.stream.synchronize()
        main = torch.cuda.default_stream(device)  # where the trainer uses (and frees) them
        for ro in (out.rollout, out.greedy):
            for value in vars(ro).values() if ro is not None else ():
                if isinstance(value, torch.Tensor) and value.is_cuda:
                    value.record_stream(main)
        return out

    def _generate(self, job: Job) -> Generated:
        sample, n = self.setup.sample, self.setup.spec.rollout.n
        common: dict[str, Any] = dict(rows=job.rows, version=job.version, sampler=self.sampler)
        ro = sample(job.round, job.formatted, n, **common)
        if not self.baseline:  # nothing reads a greedy baseline: none is generated
            return Generated(ro)
        return Generated(ro, sample(job.round, job.formatted, 1, greedy=True, **common))

    def round(self, state: State, round_no: int, train_actor: bool) -> RoundResult:
        """Round ``round_no`` (1-based) on its batch generated ahead, the trainer holding
        the weights of version ``round_no - 1``; its timings gain the generation's seconds
        (``time_generate``), the waits and pushes, and its metrics the rows' staleness."""
        version = round_no - 1
        if self.threads is not None:
            _SET_THREADS(self.trainer_threads)
        ready = self.schedule.take(round_no, version)
        job, out = ready.job, ready.out
        result = run_round(
            self.setup, state, job.rows, job.formatted, round_no=round_no,
            train_actor=train_actor, rollout=out.rollout, greedy=out.greedy, sync=False,
        )  # fmt: skip
        result.timings["time_generate"] = ready.seconds
        result.timings.update(self.schedule.measured())
        staleness = torch.full((), float(version - job.version), device=self.setup.device)
        result.metrics["rollout/staleness_mean"] = staleness
        result.metrics["rollout/staleness_max"] = staleness.clone()
        return result

    def current(self, version: int) -> None:
        """The engine holds the trainer's weights of ``version`` (before an evaluation)."""
        self.schedule.current(version)

    def ahead(self) -> list[Ahead]:
        """The batches generated for the rounds to come (a checkpoint's), once generated."""
        return [
            Ahead(
                r.job.round, r.job.version, r.job.rows, r.job.formatted, r.out.rollout, r.out.greedy
            )
            for r in self.schedule.pending()
        ]

    def close(self) -> None:
        """No more generation; the run's reporter back in place."""
        self.reporter.closed = True
        self.schedule.close()
        self.setup.reporter = self.outer
