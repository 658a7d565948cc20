"""A run's records (:class:`Records`): each round's :class:`RoundRecord` (its metrics, its
evaluation when due, the signs of docs/health.md that fire on it) written to metrics.jsonl,
the samples and the trackers, and kept in the history the display's summary and the curves
read."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ppokit import distributed
from ppokit.errors import UserError
from ppokit.metrics_table import EVAL_PREFIX, REWARD, ROUND, ROUND_TIME, THROUGHPUT
from ppokit.spec import Spec, spec_warnings
from ppokit.trainer.flops import utilisation
from ppokit.trainer.health import check, warning
from ppokit.trainer.lifecycle.opening import Place
from ppokit.trainer.lifecycle.resume import Resumed
from ppokit.trainer.lifecycle.smoke import TEMPORARY
from ppokit.trainer.metrics import read_once
from ppokit.trainer.round import RoundResult
from ppokit.trainer.setup import Setup
from ppokit.trainer.trackers import Trackers

__all__ = ["Records", "RoundRecord", "eval_line", "evaluates", "tracking"]


@dataclass
class RoundRecord:
    """A round's ``values`` (its line of metrics.jsonl) and the ``warnings`` it gives: its
    skipped steps and the signs of docs/health.md that start firing on it."""

    values: dict[str, Any]
    warnings: list[str] = field(default_factory=list)


def evaluates(spec: Spec, round_no: int) -> bool:
    """Whether round ``round_no`` ends with an evaluation: every ``eval.every`` rounds, and
    the last round (the policy ``ppokit eval RUN`` reads is always evaluated)."""
    if spec.eval is None:
        return False
    return round_no % spec.eval.every == 0 or round_no == spec.train.rounds


def tracking(place: Place, start: int) -> Trackers:
    """The run's trackers (``output.report_to``; the first process's only), resumed after
    round ``start``."""
    spec = place.spec
    tracked = spec
    if not distributed.world().main:
        tracked = spec.model_copy(
            update={"output": spec.output.model_copy(update={"report_to": []})}
        )
    if spec.output.report_to:
        place.display.step(f"starting the trackers ({', '.join(spec.output.report_to)})")
    return Trackers(tracked, place.out, start_round=start)


class Records:
    """The records of the run at ``place`` from where ``at`` starts it, on ``trackers``."""

    def __init__(self, place: Place, setup: Setup, at: Resumed, trackers: Trackers) -> None:
        self.place, self.setup, self.at, self.trackers = place, setup, at, trackers
        self.log, self.history, self.evaluator = at.log, at.history, at.evaluator

    def begin(self) -> None:
        """The lines that start the rounds, and the evaluation before training
        (``eval.at_start``, a new run): round 0's record."""
        place, display, spec, at = self.place, self.place.display, self.place.spec, self.at
        world = distributed.world()
        total, start = spec.train.rounds, at.start
        processes = f", {world.size} processes" if world.distributed else ""
        display.message(
            f"ppokit: {max(0, total - start)} round(s) on {self.setup.device}{processes}, "
            f"{at.threads}, output {TEMPORARY if place.temporary else place.out}"
            + (f" (resumed at round {start})" if place.resume else "")
        )
        if at.redo:
            display.message(
                f"metrics.jsonl had {len(at.redo)} round(s) after the checkpoint (round "
                f"{start}): they are run again"
            )
        if place.changes:
            display.message(
                f"spec changed on resume ({', '.join(k for k, _, _ in place.changes)}): "
                f"recorded in {place.out / 'spec_changes.jsonl'}"
            )
        for line in spec_warnings(spec):
            display.message(f"warning: {line}")
        evaluator = self.evaluator
        if evaluator is not None and spec.eval is not None and spec.eval.at_start and start == 0:
            prompts, size = len(evaluator.rows), spec.eval.batch_size
            share = math.ceil(prompts / world.size)  # this process's prompts
            batches = math.ceil(share / size)
            display.step(
                f"evaluating {prompts} held-out prompts",
                passes=2 * batches,  # a greedy and a sampled pass over each batch
            )
            record = {ROUND: 0, **evaluator.run(), "time_eval": evaluator.seconds}
            self.log.append(record)
            self.trackers.log_metrics(0, record)
            self.history.append(record)
            display.message(eval_line(record))

    def of_round(self, round_no: int, result: RoundResult, began: float) -> RoundRecord:
        """Round ``round_no``'s record from its result (the round's one host read of its
        metrics), begun at ``began`` (``time.perf_counter()``)."""
        values = read_once(result.metrics)
        tokens = values.pop("tokens", None) or 0.0
        record: dict[str, Any] = {ROUND: round_no, **values, **result.timings}
        gen = result.timings.get("time_generate", 0.0)
        record[THROUGHPUT] = tokens / gen if gen > 0 else None
        record[ROUND_TIME] = time.perf_counter() - began
        record.update(utilisation(record, self.setup.peaks, distributed.world().size))
        return RoundRecord(record, list(result.skipped))

    def observed(self, record: RoundRecord) -> None:
        """The prompt source's optional ``observe(round_no, reward_mean)`` hears the round's
        ``reward_mean`` (the whole round's, the same on every process); the metrics it
        returns (a mapping of names to numbers: a curriculum's levels) go into the record."""
        observe = getattr(self.at.source, "observe", None)
        reward = record.values.get(REWARD)
        if observe is None or not isinstance(reward, (int, float)):
            return
        given = observe(record.values[ROUND], float(reward))
        if given is None:
            return
        if not isinstance(given, Mapping) or not all(
            isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool)
            for k, v in given.items()
        ):
            raise UserError(
                f"prompt source {type(self.at.source).__name__}: observe returned "
                f"{given!r:.80}, not a mapping of metric names to numbers"
            )
        record.values.update({k: float(v) for k, v in given.items()})

    def evaluate(self, record: RoundRecord) -> None:
        """The held-out evaluation after the round's update, into its record."""
        assert self.evaluator is not None  # evaluates(): the spec has an eval section
        self.setup.reporter.phase("evaluating")
        record.values.update(self.evaluator.run())
        record.values["time_eval"] = self.evaluator.seconds

    def write(self, record: RoundRecord, result: RoundResult) -> None:
        """The round's record with the signs that fire on it given the history before it
        (evaluated once, on the first process: the metrics are the whole round's), written
        to metrics.jsonl and the trackers, with the round's samples when due; its warnings
        shown; kept in the history."""
        spec, values = self.place.spec, record.values
        round_no = values[ROUND]
        health = []
        if distributed.world().main:
            for fired in check(values, self.history, spec.health, spec.train.rounds):
                values[fired.sign.key] = 1.0
                if fired.started:
                    health.append(warning(fired, spec.health))
        self.log.append(values)
        self.trackers.log_metrics(round_no, values)
        if round_no % spec.output.sample_every == 0 and result.scores is not None:
            scores = result.scores.tolist()
            self.log.samples(round_no, result.prompts, result.responses, scores)
            self.trackers.log_samples(round_no, result.prompts, result.responses, scores)
        record.warnings += health
        for problem in record.warnings:
            self.place.display.message(f"warning: {problem}")
        self.history.append(values)


def eval_line(record: dict[str, Any]) -> str:
    """``round 0 (before training): accuracy 0.41 ±0.068  pass@4 0.62  reward_mean 0.4
    response_length_mean 21.5  prompts 200`` (the ``eval/`` metrics, the interval's
    half-width beside the accuracy): under 100 characters for the built-in metrics."""
    values = {
        k.removeprefix(EVAL_PREFIX): v
        for k, v in record.items()
        if k.startswith(EVAL_PREFIX) and v is not None
    }
    ci = values.pop("accuracy_ci95", None)
    parts = []
    for key, value in values.items():
        text = f"{key} {value:.4g}" if isinstance(value, float) else f"{key} {value}"
        if key == "accuracy" and isinstance(ci, (int, float)):
            text += f" \u00b1{ci:.2g}"
        parts.append(text)
    return f"round {record['round']} (before training): " + "  ".join(parts)
