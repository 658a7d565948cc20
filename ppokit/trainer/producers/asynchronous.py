"""The asynchronous schedule (``rollout.max_staleness`` > 0, docs/async.md): the
:class:`~ppokit.trainer.producers.schedule.Schedule` with jobs that generate on the run's
engine in a thread of their own, with a tokenizer of their own and, on a CPU, torch threads
of their own; the weight push is the engine's ``sync``; each round's batch gains the rows'
staleness and the time each side waited for the other.

:meth:`Asynchronous.next` scores round k's batch, generated ahead (a round's only batch:
dynamic sampling does not refill it), and the greedy baseline's when a component requires
``baseline_rewards`` (generated beside it, from the same weights; else none is generated);
the round recomputes log π_old at the weights the update starts from (the decoupled
objective: the ratio and its clip against π_old, the rollout correction weighting π_old/μ).
The engine is not synced after the update: the schedule pushes the weights when it admits
the next batch. Its state in a checkpoint is the batches generated for the rounds after it
(``batches``: :class:`~ppokit.trainer.checkpoint.ahead.Ahead`).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from typing import Any

import torch

from ppokit.trainer.checkpoint.ahead import Ahead
from ppokit.trainer.checks import counting
from ppokit.trainer.episodes import Sampler
from ppokit.trainer.producers.base import Draw, Produced
from ppokit.trainer.producers.given import Given
from ppokit.trainer.producers.schedule import Job, Ready, Schedule
from ppokit.trainer.rollout import PromptEncoder
from ppokit.trainer.setup import Setup, generation_progress

__all__ = ["Asynchronous", "Cancelled"]

#: torch's own thread setting, kept before vLLM replaces it with a no-op once it binds its
#: threads: the generation thread sets its threads with it.
_SET_THREADS = torch.set_num_threads


class Cancelled(Exception):
    """The run ended while a batch was being generated: the generation stops."""


class Asynchronous:
    """The asynchronous rounds of a run on ``setup`` from round ``start`` (its rounds done)
    on: batches drawn by ``draw``, generated with ``threads`` torch threads (None: as they
    are; the rounds keep the threads set when this is made); :meth:`load_state_dict`: the
    batches a checkpoint saved. :meth:`close` ends it."""

    def __init__(self, setup: Setup, draw: Draw, *, start: int, threads: int | None = None) -> None:
        spec = setup.spec
        self.setup = setup
        self.draw = draw
        self.start = start
        tokenizer = copy.deepcopy(setup.models.tokenizer)  # a fast tokenizer is not shared
        encode = PromptEncoder(tokenizer, setup.models.actor, setup.device)
        self.sampler = Sampler(
            setup.engine, setup.assembly.environment, encode, tokenizer, spec.rollout
        )
        self.baseline = "baseline_rewards" in setup.assembly.requires
        self.closed = False
        self.threads = threads
        self.stream: Any = None  # the generation's CUDA stream, on a GPU
        self.trainer_threads = torch.get_num_threads()  # the run's, set before
        self.scoring = Given(setup)  # each round's batch, scored as its only one
        self.loaded: Sequence[Ahead] = ()
        self._schedule: Schedule[Ahead] | None = None

    @property
    def schedule(self) -> Schedule[Ahead]:
        """The schedule, started on first use (after :meth:`load_state_dict`)."""
        if self._schedule is None:
            ready = [Ready(Job(a.round, a.version, a.rows, a.formatted), a) for a in self.loaded]
            self._schedule = Schedule(
                max_staleness=self.setup.spec.rollout.max_staleness,
                last_round=self.setup.spec.train.rounds,
                start=self.start,
                draw=self.draw,
                generate=self.generate,
                push=self.push,
                ready=ready,
            )
        return self._schedule

    def push(self) -> None:
        """The trainer's weights into the engine (no generation runs); on a GPU they are
        written before the next generation reads them on its own stream."""
        self.setup.engine.sync()
        if self.setup.device.type == "cuda":
            torch.cuda.synchronize(self.setup.device)

    def generate(self, job: Job) -> Ahead:
        """The job's batch (and greedy baseline), in the schedule's thread: with its own
        torch threads on a CPU (set again for each job: OpenMP's setting may be shared between
        threads once both have computed), on a CUDA stream of its own on a GPU (so its
        kernels run beside the update's, not queued behind them). The engine's decoding
        steps there are not shown (the trainer's phases are); after :meth:`close` they stop
        the generation (:class:`Cancelled`)."""
        if self.threads is not None:
            _SET_THREADS(self.threads)
        device = self.setup.device
        with generation_progress(self._progress):
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

    def _progress(self, step: int, steps: int, rows: int) -> None:
        if self.closed:
            raise Cancelled("the run ended")

    def _generate(self, job: Job) -> Ahead:
        sample, n = self.setup.sample, self.setup.spec.rollout.n
        common: dict[str, Any] = dict(rows=job.rows, version=job.version, sampler=self.sampler)
        ro = sample(job.round, job.formatted, n, **common)
        greedy = None
        if self.baseline:  # nothing else reads a greedy baseline: none is generated
            greedy = sample(job.round, job.formatted, 1, greedy=True, **common)
        return Ahead(job.round, job.version, job.rows, job.formatted, ro, greedy)

    def next(self, round_no: int) -> Produced:
        """Round ``round_no``'s batch (1-based), generated ahead, scored, the trainer holding
        the weights of version ``round_no - 1``; ``time_generate`` its generation's seconds,
        its metrics the rows' staleness."""
        version = round_no - 1
        if self.threads is not None:
            _SET_THREADS(self.trainer_threads)
        ready = self.schedule.take(round_no, version)
        made = ready.out
        self.scoring.give(made.rows, made.formatted, made.rollout)
        produced = self.scoring.next(round_no)
        kept = produced.filled.kept
        if made.greedy is not None and kept is not None:  # the batch's prompts, all kept
            start = time.perf_counter()
            setup = self.setup
            with counting(produced.checks):
                rewards = setup.scorer.rollout(made.rows, made.greedy)[0].total
            produced.baseline = rewards.repeat_interleave(setup.spec.rollout.n)
            produced.timings["time_score"] += time.perf_counter() - start
        produced.timings["time_generate"] = ready.seconds
        staleness = torch.full((), float(version - made.version), device=self.setup.device)
        produced.metrics["rollout/staleness_mean"] = staleness
        produced.metrics["rollout/staleness_max"] = staleness.clone()
        return produced

    def trained(self, round_no: int) -> dict[str, float]:
        """The engine is not synced (the schedule pushes when it admits a batch): the
        seconds waited and pushed since the last round."""
        return self.schedule.measured()

    def before_evaluation(self, round_no: int) -> None:
        """The engine holds the trainer's weights after ``round_no`` rounds."""
        self.schedule.current(round_no)

    def state_dict(self) -> dict[str, Any]:
        """The batches generated for the rounds to come, once generated."""
        return {"batches": [r.out for r in self.schedule.pending()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The batches a checkpoint saved for the rounds after ``start`` (before the first
        round)."""
        assert self._schedule is None, "the schedule has started"
        self.loaded = list(state.get("batches", ()))

    def close(self) -> None:
        """No more generation."""
        self.closed = True
        if self._schedule is not None:
            self._schedule.close()
