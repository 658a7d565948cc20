"""Where a run's rounds start (:func:`restore`): a new run at round 0, or a resumed one at
its checkpoint's round, with the prompt source, the records so far, the evaluator and the
producer as the checkpoint left them."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ppokit import distributed
from ppokit.errors import UserError
from ppokit.runfolder import (
    CHECKPOINT,
    SPEC,
    check_metrics,
    io_errors,
    read_metrics,
    truncate_jsonl,
    write_atomic,
)
from ppokit.spec import Spec
from ppokit.spec_changes import record_spec_changes
from ppokit.trainer.checkpoint import load_checkpoint, read_state
from ppokit.trainer.checkpoint.ahead import read_ahead
from ppokit.trainer.evaluation import Evaluator
from ppokit.trainer.lifecycle.opening import Place
from ppokit.trainer.metrics import MetricsLog
from ppokit.trainer.producers import Draw, Producer, make_producer
from ppokit.trainer.run import Run
from ppokit.trainer.setup import Setup
from ppokit.trainer.threads import engine_threads

__all__ = ["Resumed", "restore"]


@dataclass
class Resumed:
    """Where the rounds start: after round ``start`` (0: a new run), drawing prompts from
    ``source``, appending to ``log`` after the records of ``history``; ``redo``: the rounds
    metrics.jsonl held after the checkpoint (run again); ``threads``: the CPU threads of
    the trainer (and of the generation beside it), as the display says them."""

    start: int
    source: Any
    log: MetricsLog
    history: list[dict[str, Any]]
    evaluator: Evaluator | None
    producer: Producer
    threads: str
    redo: list[int] = field(default_factory=list)


def restore(place: Place, run: Run) -> Resumed:
    """The start of the place's rounds: with ``place.resume``, the checkpoint's weights,
    state, prompt source, environment and producer state (the records after it are
    dropped, the spec's changes recorded); the spec written to the folder."""
    from ppokit.data import make_prompt_source

    spec, out, display, setup = place.spec, place.out, place.display, run.setup
    world = distributed.world()
    display.step(f"reading the prompts ({spec.data.label})")
    source = make_prompt_source(spec.data, spec.seed)
    log = MetricsLog(out, write=world.main)
    start = 0
    redo: list[int] = []
    saved: dict[str, Any] = {}  # the producer's state in the checkpoint
    if place.resume:
        display.step("restoring the checkpoint")
        with io_errors(out / "checkpoint", "cannot restore the checkpoint"):
            start = load_checkpoint(
                out, setup.models, run.state, source, setup.assembly.environment
            )
            saved = producer_state(out, spec, setup, start)
        setup.engine.sync()  # an engine with weights of its own: the restored ones
        distributed.barrier()  # every process has read it before it is changed
        if world.main:
            redo = check_metrics(log.path, start)
            for path in (log.path, log.samples_path):
                with io_errors(path):
                    truncate_jsonl(path, start)
            if place.changes:
                record_spec_changes(out, start, place.changes)
        display.resumed(start)
    if world.main:
        write_atomic(out / SPEC, spec.to_yaml())
    history = read_metrics(out)
    evaluator = Evaluator.of(spec, setup) if spec.eval is not None else None

    threads, generation_threads = run.threads, None
    if spec.rollout.max_staleness:
        generation_threads, generation = engine_threads(spec, setup.models)
        threads += f"; generation beside the update, {generation}"

    def put_back() -> None:  # the last batch drawn, generated ahead and not needed
        source.put_back(spec.rollout.prompts_per_round)

    draw = drawer(setup, source)
    producer = make_producer(setup, draw, put_back, start=start, threads=generation_threads)
    producer.load_state_dict(saved)
    return Resumed(start, source, log, history, evaluator, producer, threads, redo)


def drawer(setup: Setup, source: Any) -> Draw:
    """The next batch of prompts from ``source``: this process's data rows and their
    formatted prompts."""
    from ppokit.trainer.prompts import format_prompts

    spec = setup.spec

    def draw() -> tuple[list[dict[str, Any]], list[str]]:
        rows = source.next_rows(spec.rollout.prompts_per_round)
        rows = rows[distributed.world().share(len(rows))]
        return rows, format_prompts(rows, setup.models.tokenizer, spec.data)

    return draw


def producer_state(out: Path, spec: Spec, setup: Setup, start: int) -> dict[str, Any]:
    """The producer's state in the checkpoint of round ``start``: what ``state.json`` keeps
    of it (none in a checkpoint written before it kept any) and the batches it holds for
    the rounds after it (``batches``); a one-line error when the spec's
    ``rollout.max_staleness`` cannot take them."""
    world = distributed.world()
    embeddings: Any = setup.models.actor.get_input_embeddings()  # type: ignore[operator]
    vocab = int(embeddings.weight.shape[0])
    path = out / CHECKPOINT
    ahead = read_ahead(path, world.rank, world.size, start, spec.rollout.n, vocab, setup.device)
    if len(ahead) > spec.rollout.max_staleness:
        raise UserError(
            f"checkpoint {path} holds {len(ahead)} batch(es) generated ahead of round {start} "
            f"(asynchronous rollouts) but rollout.max_staleness is "
            f"{spec.rollout.max_staleness}: resume with the run's rollout.max_staleness"
        )
    kept = read_state(out).get("producer") or {}
    if not isinstance(kept, dict):
        raise UserError(f"checkpoint {path}: state.json's producer is not an object")
    return {**kept, "batches": ahead}
