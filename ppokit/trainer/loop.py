"""``train(spec)``: the outer loop of a run (output directory, seeding, rounds, metrics,
checkpoints, display)."""

from __future__ import annotations

import contextlib
import math
import os
import random
import shlex
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ppokit import distributed
from ppokit.bounded import counting_interrupts, terminating_as_interrupt
from ppokit.errors import UserError
from ppokit.metrics_table import EVAL_PREFIX, REWARD, ROUND, ROUND_TIME, THROUGHPUT
from ppokit.runfolder import (
    CHECKPOINT,
    CURVES_PNG,
    LIBRARY_LOG,
    METRICS,
    RUN_FILES,
    SAMPLES,
    SPEC,
    RunFolder,
    check_metrics,
    how_to_continue,
    io_errors,
    read_metrics,
    truncate_jsonl,
    write_atomic,
)
from ppokit.spec import Spec, spec_warnings, validate_spec
from ppokit.spec_changes import record_spec_changes, resume_spec_changes
from ppokit.trainer.assembly import Assembly
from ppokit.trainer.checkpoint import (
    checkpoint_round,
    load_checkpoint,
    read_state,
    save_checkpoint,
)
from ppokit.trainer.checkpoint.ahead import read_ahead
from ppokit.trainer.display import Display, folded_logs
from ppokit.trainer.evaluation import Evaluator
from ppokit.trainer.health import check, fired_signs, warning
from ppokit.trainer.metrics import MetricsLog, curves_title, plot_curves, read_once
from ppokit.trainer.models import Models, build_models, quiet_progress_bars, resolve_device
from ppokit.trainer.producers import Producer, make_producer
from ppokit.trainer.report import Reporter, Silent
from ppokit.trainer.round import run_round
from ppokit.trainer.setup import Setup, State
from ppokit.trainer.stopping import Ends as _Ends
from ppokit.trainer.stopping import Stopped
from ppokit.trainer.trackers import Trackers

__all__ = [
    "RUN_FILES",
    "Interrupted",
    "choose_threads",
    "cpu_cores",
    "engine_threads",
    "set_threads",
    "smoke_spec",
    "train",
]

#: Below this many actor parameters a CPU run uses one thread (more only contend).
SMALL_MODEL = 10_000_000
#: The tiny model of a smoke run, unless the spec configures its own: the demo's heads of 32
#: dimensions (vLLM's CPU attention has no head size of 16).
SMOKE_TINY = {"num_attention_heads": 2, "num_key_value_heads": 2}
#: The prefix of a smoke run's temporary folder (removed when the run ends).
SMOKE_PREFIX = "ppokit-smoke-"


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during the rounds: which round, the last checkpoint, and how to continue."""

    def __init__(
        self,
        out: Path,
        round_no: int,
        total: int,
        checkpoint: int | None,
        save_every: int,
        smoke: bool,
    ) -> None:
        self.out = out
        self.round = round_no
        self.total = total
        self.checkpoint = checkpoint
        self.save_every = save_every
        self.smoke = smoke
        super().__init__(" ".join(self.describe()))

    def describe(self, command: Sequence[str] | None = None) -> list[str]:
        """The lines to show; ``command`` is the ``ppokit train SPEC [--set ...]`` that
        started the run (``--out DIR --resume`` is added)."""
        where = f"interrupted during round {self.round}/{self.total}"
        if self.smoke:
            return [f"{where} of the smoke run"]
        base = list(command) if command else ["ppokit", "train", "SPEC"]
        state, then = how_to_continue(self.out, base, self.checkpoint)
        if not self.checkpoint:
            state += f" (output.save_every={self.save_every})"
        return [f"{where}; {state}", then]


def smoke_spec(spec: Spec, out: str | None = None) -> Spec:
    """Two rounds of the spec's own components on the tiny model with small batches.

    The tiny model is SMOKE_TINY under what the spec's ``model.tiny`` sets. They
    write to ``out`` when given, else to a new temporary directory (which :func:`train`
    removes at the end of the run), never to the spec's own output directory.
    """
    data = spec.model_dump()
    n = max(2, min(spec.rollout.n, 4))
    own = spec.model.tiny.model_dump(include=spec.model.tiny.model_fields_set)
    tiny = {**data["model"]["tiny"], **SMOKE_TINY, **own}
    data["model"].update(
        actor="tiny",
        tiny=tiny,
        critic_init=None,
        device="auto",
        dtype="auto",
        gradient_checkpointing=False,
    )
    data["rollout"].update(prompts_per_round=4, n=n, max_new_tokens=8)
    t = data["train"]
    batch = 4 * n
    minibatch = None if t["minibatch_size"] is None else batch // 2
    micro = None if t["micro_batch_size"] is None else max(1, (minibatch or batch) // 2)
    t.update(
        rounds=2,
        critic_warmup_rounds=min(t["critic_warmup_rounds"], 1),
        warmup_steps=min(t["warmup_steps"], 1),
        minibatch_size=minibatch,
        micro_batch_size=micro,
    )
    if out is None:
        data["output"].update(dir=tempfile.mkdtemp(prefix=SMOKE_PREFIX), overwrite=True)
    else:
        data["output"].update(dir=out)
    data["output"].update(save_every=1, sample_every=1, report_to=[])
    if data.get("eval") is not None:  # a small evaluation, at the start and at the end
        e = data["eval"]
        ks = e["k"] if isinstance(e["k"], list) else [e["k"]]
        e.update(prompts=min(e["prompts"], 8), k=sorted({min(k, 2) for k in ks}), n=None)
        e.update(max_new_tokens=None)
        e.update(batch_size=min(e["batch_size"], 8))
    return validate_spec(data)


#: What a finished run leaves in its folder, and what each is for.
RESULTS = (
    (CURVES_PNG, "the curves"),
    (METRICS, "every round's metrics"),
    (SAMPLES, "sampled responses"),
    (f"{CHECKPOINT}/", "for --resume, eval and export"),
)


def where_results(out: Path) -> list[str]:
    """The lines that end a run: where its results are (those that exist) and what each way
    of looking at them shows, the folder named once per line (a 60-character path keeps
    each line under 160 columns)."""
    files = [f"{name} ({what})" for name, what in RESULTS if (out / name.rstrip("/")).exists()]
    if not files:
        return []
    lines = [f"results in {out}:", "  " + ", ".join(files)]
    if (out / CURVES_PNG).exists():
        lines.append(f"the curves: {shlex.quote(str(out / CURVES_PNG))}")
    lines.append(f"held-out accuracy: ppokit eval {shlex.quote(str(out))}")
    if (out / "tensorboard").is_dir():
        lines.append(f"every metric: tensorboard --logdir {shlex.quote(str(out / 'tensorboard'))}")
    return lines


def _seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def cpu_cores() -> int:
    """The CPU cores this process may run on."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else os.cpu_count() or 1


def choose_threads(
    setting: int | None,
    device: str,
    parameters: int,
    sides: int = 1,
    setting_name: str = "model.threads",
) -> tuple[int | None, str]:
    """(threads for torch's intra-op pool, why): the ``setting`` when set; one thread for a
    model under SMALL_MODEL parameters on the CPU, where more threads only contend; on the
    CPU with ``sides`` > 1 (generation beside the update) the cores divided between the
    sides; else None (torch's default)."""
    if setting is not None:
        return setting, setting_name
    if device == "cpu" and parameters < SMALL_MODEL:
        return 1, f"automatic: a {parameters / 1e6:.2g}M-parameter model on the CPU"
    if device == "cpu" and sides > 1:
        cores = cpu_cores()
        return max(1, cores // sides), f"automatic: {cores} cores shared by {sides} sides"
    return None, "torch's default"


def _threads_text(n: int, why: str) -> str:
    return f"{n} CPU thread{'s' if n != 1 else ''} ({why})"


def set_threads(spec: Spec, models: Models) -> str:
    """Apply ``ppokit train``'s thread rule (:func:`choose_threads`) to torch's intra-op pool
    for a run of ``spec`` on ``models`` (what ``build_models`` returned; the pool is left so
    for the rest of the process); returns what it chose, e.g. ``1 CPU thread (automatic: a
    0.095M-parameter model on the CPU)``. With asynchronous rollouts these are the trainer's
    threads (:func:`engine_threads` the generation's)."""
    parameters = sum(p.numel() for p in models.actor.parameters())
    sides = 2 if spec.rollout.max_staleness else 1
    threads, why = choose_threads(spec.model.threads, models.runtime.device.type, parameters, sides)
    if threads is not None:
        torch.set_num_threads(threads)
    return _threads_text(torch.get_num_threads(), why)


def engine_threads(spec: Spec, models: Models) -> tuple[int | None, str]:
    """(the generation thread's torch threads, what the display says) of an asynchronous
    run: ``rollout.engine_threads``, or :func:`choose_threads`' share of the cores."""
    parameters = sum(p.numel() for p in models.actor.parameters())
    threads, why = choose_threads(
        spec.rollout.engine_threads,
        models.runtime.device.type,
        parameters,
        2,
        "rollout.engine_threads",
    )
    return threads, _threads_text(threads or torch.get_num_threads(), why)


def train(
    spec: Spec,
    *,
    resume: bool = False,
    smoke: bool = False,
    overwrite: bool = False,
    smoke_out: str | None = None,
    allow_spec_change: bool = False,
) -> dict[str, Any]:
    """Run the PPO loop the spec describes; returns a JSON-serialisable summary.

    ``resume`` continues from ``output.dir/checkpoint`` (refused when the spec differs from
    the run's in what it optimises, unless ``allow_spec_change``: the change is recorded in
    ``spec_changes.jsonl``); ``smoke`` runs two small rounds on the tiny model in
    ``smoke_out`` (default: a temporary directory, removed when the run ends, Ctrl-C and
    errors included); ``overwrite`` replaces an existing run
    (only what a run wrote; a folder that is not a run is never emptied). The folder is
    locked for the run's life. Ctrl-C raises :class:`Interrupted` (a KeyboardInterrupt).
    """
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    resume = resume and not smoke
    model = spec.model
    device, dtype = ("auto", "auto") if smoke else (model.device, model.dtype)  # smoke_spec's
    device_type = resolve_device(device, dtype).device.type
    with (
        counting_interrupts(),
        distributed.process_group(device_type, spec.parallel.timeout_s) as world,
    ):
        temporary = smoke and smoke_out is None  # removed when the run ends
        if smoke:
            spec = smoke_spec(spec, _smoke_folder(world.main) if temporary else smoke_out)
        out = Path(spec.output.dir).expanduser()
        ended = False
        try:
            folder: Any = contextlib.nullcontext()
            if world.main:  # one process owns the folder: the lock, the overwrite, the files
                overwrite = overwrite or spec.output.overwrite
                folder = RunFolder(out, resume=resume, overwrite=overwrite)
            with folder:
                distributed.barrier()
                changes = (
                    resume_spec_changes(out, spec.model_dump(), allow_spec_change) if resume else []
                )
                threads = torch.get_num_threads()
                try:
                    result = _train(spec, out, resume, smoke, changes, temporary)
                finally:
                    torch.set_num_threads(threads)
            ended = True
            return result
        finally:
            if temporary:
                if ended:  # every process is done with the folder
                    distributed.barrier()
                if world.main:
                    shutil.rmtree(out, ignore_errors=True)


def _smoke_folder(main: bool) -> str:
    """A new temporary folder for a smoke run, made by the first process and named to all."""
    folder = distributed.first_text(tempfile.mkdtemp(prefix=SMOKE_PREFIX) if main else None)
    assert folder is not None  # the first process always names one
    return folder


def _check_shares(spec: Spec, processes: int) -> None:
    """Equal shares of prompts and minibatch rows for each of ``processes``."""
    r, t = spec.rollout, spec.train
    if r.prompts_per_round % processes:
        raise UserError(
            f"rollout.prompts_per_round ({r.prompts_per_round}) must be divisible by the "
            f"number of processes ({processes})"
        )
    if t.minibatch_size and t.minibatch_size % processes:
        raise UserError(
            f"train.minibatch_size ({t.minibatch_size}) must be divisible by the number of "
            f"processes ({processes})"
        )


def _train(
    spec: Spec,
    out: Path,
    resume: bool,
    smoke: bool,
    changes: list[tuple[str, Any, Any]],
    temporary: bool = False,
) -> dict[str, Any]:

    wall = time.perf_counter()
    world = distributed.world()
    _check_shares(spec, world.size)
    _seed_all(spec.seed)
    # the display first: a model that takes a minute to load says so from the first second
    display: Reporter = (
        Display(spec.train.rounds, 0, spec.output.progress) if world.main else Silent()
    )
    # vLLM's log lines into the run's library.log, its warnings once each through the display
    logs = out / LIBRARY_LOG if world.main else None
    try:
        with folded_logs(display, logs):
            if smoke:
                display.message(SMOKE_NOTE)
            assembly = Assembly.from_spec(spec)
            try:
                with quiet_progress_bars():
                    models = build_models(spec, assembly.head_size, report=display)
                threads = set_threads(spec, models)
                if world.distributed:
                    display.step(f"sharding the models over {world.size} processes")
                    models.shard(spec.parallel)
                display.step(f"starting the rollout engine ({spec.rollout.engine.name})")
                setup = Setup.start(spec, models, assembly, display)
            except BaseException:
                assembly.close()
                raise
            try:
                result = _rounds(
                    spec, out, resume, smoke, changes, setup, threads, wall, display, temporary
                )
            except BaseException:
                with contextlib.suppress(Exception):  # the run's own error is the one to tell
                    setup.close()
                raise
            try:
                setup.close()
            except UserError as exc:  # the run finished and saved: a success all the same
                display.message(f"warning: after the run ended: {exc}")
            return result
    finally:
        display.close()


#: Where a smoke run without an output folder writes, as its lines say it.
TEMPORARY = "a temporary folder, removed at the end"

#: What a smoke run says first: its numbers check the plumbing, not the method.
SMOKE_NOTE = (
    "ppokit: smoke run: 2 rounds of the spec's components on the tiny random model, a check "
    "that the spec runs end to end, not of learning"
)


def _rounds(
    spec: Spec,
    out: Path,
    resume: bool,
    smoke: bool,
    changes: list[tuple[str, Any, Any]],
    setup: Setup,
    threads: str,
    wall: float,
    display: Reporter,
    temporary: bool = False,
) -> dict[str, Any]:
    """The rounds; ``temporary``: the output folder is removed when the run ends, so no
    line names it."""
    from ppokit.data import make_prompt_source
    from ppokit.trainer.prompts import format_prompts

    world = distributed.world()
    models = setup.models
    state = State.create(spec, models)
    display.step(f"reading the prompts ({spec.data.label})")
    source = make_prompt_source(spec.data, spec.seed)
    log = MetricsLog(out, write=world.main)
    start = 0
    redo: list[int] = []
    saved: dict[str, Any] = {}  # the producer's state in the checkpoint
    if resume:
        display.step("restoring the checkpoint")
        with io_errors(out / "checkpoint", "cannot restore the checkpoint"):
            start = load_checkpoint(out, models, state, source, setup.assembly.environment)
            saved = _producer_state(out, spec, setup, start)
        setup.engine.sync()  # an engine with weights of its own: the restored ones
        distributed.barrier()  # every process has read it before it is changed
        if world.main:
            redo = check_metrics(log.path, start)
            for path in (log.path, log.samples_path):
                with io_errors(path):
                    truncate_jsonl(path, start)
            if changes:
                record_spec_changes(out, start, changes)
        display.resumed(start)
    if world.main:
        write_atomic(out / SPEC, spec.to_yaml())
    history = read_metrics(out)
    evaluator = Evaluator.of(spec, setup) if spec.eval is not None else None

    generation_threads = None
    if spec.rollout.max_staleness:
        generation_threads, generation = engine_threads(spec, models)
        threads += f"; generation beside the update, {generation}"
    draw = _drawer(setup, source, format_prompts)

    def put_back() -> None:  # the last batch drawn, generated ahead and not needed
        source.put_back(spec.rollout.prompts_per_round)

    producer = make_producer(setup, draw, put_back, start=start, threads=generation_threads)
    producer.load_state_dict(saved)
    spec_yaml = spec.to_yaml()
    tracked = spec if world.main else spec.model_copy(update={"output": _no_trackers(spec)})
    if spec.output.report_to:
        display.step(f"starting the trackers ({', '.join(spec.output.report_to)})")
    with Trackers(tracked, out, start_round=start) as trackers, _closing(producer):
        total = spec.train.rounds
        processes = f", {world.size} processes" if world.distributed else ""
        display.message(
            f"ppokit: {max(0, total - start)} round(s) on {models.runtime.device}{processes}, "
            f"{threads}, output {TEMPORARY if temporary else out}"
            + (f" (resumed at round {start})" if resume else "")
        )
        if redo:
            display.message(
                f"metrics.jsonl had {len(redo)} round(s) after the checkpoint (round {start}): "
                "they are run again"
            )
        if changes:
            display.message(
                f"spec changed on resume ({', '.join(k for k, _, _ in changes)}): recorded in "
                f"{out / 'spec_changes.jsonl'}"
            )
        for line in spec_warnings(spec):
            display.message(f"warning: {line}")
        if evaluator is not None and spec.eval is not None and spec.eval.at_start and start == 0:
            prompts, size = len(evaluator.rows), spec.eval.batch_size
            share = math.ceil(prompts / world.size)  # this process's prompts
            batches = math.ceil(share / size)
            display.step(
                f"evaluating {prompts} held-out prompts",
                passes=2 * batches,  # a greedy and a sampled pass over each batch
            )
            record: dict[str, Any] = {ROUND: 0, **evaluator.run(), "time_eval": evaluator.seconds}
            log.append(record)
            trackers.log_metrics(0, record)
            history.append(record)
            display.message(eval_line(record))
        r = start
        # one process, synchronous rollouts: a stop keeps the last finished round (stopping.py)
        keeps = not world.distributed and not spec.rollout.max_staleness
        ends = _Ends(setup, state, source, producer, start) if keeps else None
        try:
            with terminating_as_interrupt() if keeps else contextlib.nullcontext():
                for r in range(start, total):
                    if world.distributed:  # random streams from (seed, process, round)
                        _seed_all(distributed.round_seed(spec.seed, world.rank, r + 1))
                    display.start_round(r + 1)
                    with ends.holding(display, r + 1) if ends else contextlib.nullcontext():
                        record = _run_round(
                            setup, state, producer, r, log, evaluator, trackers, history
                        )
                        for problem in [*record.pop("_skipped", ()), *record.pop("_health", ())]:
                            display.message(f"warning: {problem}")
                        history.append(record)
                        if (r + 1) % spec.output.save_every == 0 or r + 1 == total:
                            made = producer.state_dict()
                            environment = setup.assembly.environment  # after the batches ahead
                            save_checkpoint(
                                out, models, state, source, r + 1, spec_yaml, made, environment
                            )
                        display.round(record, total)
                        if ends:
                            ends.round_ended(r + 1)
        except KeyboardInterrupt:
            if ends:
                ends.save(out, spec_yaml, display)
            display.close()
            if history and not temporary:
                display.summary(history, str(out))
            raise Interrupted(
                out, r + 1, total, checkpoint_round(out), spec.output.save_every, smoke
            ) from None
        except Exception as exc:
            if ends is None or smoke:
                raise
            ends.save(out, spec_yaml, display)
            display.close()
            if history:
                display.summary(history, str(out))
            stopped = Stopped(str(exc), out, checkpoint_round(out))
            if isinstance(exc, UserError):  # the error as it is, with how to go on
                exc.stopped = stopped  # type: ignore[attr-defined]
                raise
            for line in stopped.describe():  # a bug's traceback follows
                display.message(line)
            raise
        finally:
            display.close()
        if history and world.main:
            curves = out / CURVES_PNG
            try:
                plot_curves(history, curves, title=curves_title(str(out), spec.seed))
            except UserError as exc:  # an OS error: the run's records are written
                display.message(f"warning: {exc}")
            else:
                trackers.log_image(curves)
        display.summary(history, "the smoke run" if temporary else str(out))
        if world.main and not smoke:
            for line in where_results(out):
                display.message(line)
        if smoke and not any(h.get(REWARD) for h in history):
            display.message(
                "ppokit: every reward of the smoke run was 0, as expected of the tiny random "
                "model on this task, so its advantages, losses and gradients are 0 too"
            )
        rewards = [h[REWARD] for h in history if h.get(REWARD) is not None]
        first = rewards[0] if rewards else None  # round 0 (an evaluation only) has none
        tail = [h[REWARD] for h in history[-5:] if h.get(REWARD) is not None]
        return {
            "output_dir": None if temporary else str(out),
            "rounds": sum(1 for h in history if h[ROUND] > 0),  # not round 0
            "resumed_from": start if resume else None,
            "smoke": smoke,
            "threads": torch.get_num_threads(),
            "seconds": round(time.perf_counter() - wall, 3),
            "reward_first": first,
            "reward_last": sum(tail) / len(tail) if tail else None,
            "final": history[-1] if history else None,
            "health": {
                name: {"first_round": first, "rounds": rounds}
                for name, (first, rounds) in fired_signs(history).items()
            },
            "processes": world.size,
            "main": world.main,
        }


def _producer_state(out: Path, spec: Spec, setup: Setup, start: int) -> dict[str, Any]:
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


@contextlib.contextmanager
def _closing(producer: Producer) -> Iterator[Producer]:
    """The run's producer, closed when the rounds end."""
    try:
        yield producer
    finally:
        producer.close()


def _no_trackers(spec: Spec) -> Any:
    return spec.output.model_copy(update={"report_to": []})


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


def _evaluates(spec: Spec, r: int) -> bool:
    """Whether round ``r`` (0-based) ends with an evaluation: every ``eval.every`` rounds,
    and the last round (the policy ``ppokit eval RUN`` reads is always evaluated)."""
    if spec.eval is None:
        return False
    return (r + 1) % spec.eval.every == 0 or r + 1 == spec.train.rounds


def _drawer(setup: Setup, source: Any, format_prompts: Any) -> Any:
    """The next batch of prompts from ``source``: this process's data rows and their
    formatted prompts."""
    spec = setup.spec

    def draw() -> tuple[list[dict[str, Any]], list[str]]:
        rows = source.next_rows(spec.rollout.prompts_per_round)
        rows = rows[distributed.world().share(len(rows))]
        return rows, format_prompts(rows, setup.models.tokenizer, spec.data)

    return draw


def _run_round(
    setup: Setup,
    state: State,
    producer: Producer,
    r: int,
    log: MetricsLog,
    evaluator: Evaluator | None = None,
    trackers: Trackers | None = None,
    history: Sequence[dict[str, Any]] = (),
) -> dict[str, Any]:
    """Round ``r`` (0-based) on the batch ``producer`` makes for it, with its evaluation
    when due: its record, written to the log and the trackers, with the signs of
    docs/health.md that fire on it given the ``history`` of records before it (evaluated
    once, on the first process; ``_health``: the warnings of those that start firing) and
    the skipped steps' messages (``_skipped``)."""
    begin = time.perf_counter()
    spec = setup.spec
    train_actor = r >= spec.train.critic_warmup_rounds
    produced = producer.next(r + 1)
    result = run_round(setup, state, produced, round_no=r + 1, train_actor=train_actor)
    result.timings.update(producer.trained(r + 1))
    values = read_once(result.metrics)  # the round's one host read
    tokens = values.pop("tokens", None) or 0.0
    record: dict[str, Any] = {ROUND: r + 1, **values, **result.timings}
    gen = result.timings.get("time_generate", 0.0)
    record[THROUGHPUT] = tokens / gen if gen > 0 else None
    record[ROUND_TIME] = time.perf_counter() - begin
    if evaluator is not None and _evaluates(spec, r):  # after the update, into this record
        producer.before_evaluation(r + 1)  # the engine samples from the updated weights
        setup.reporter.phase("evaluating")
        record.update(evaluator.run())
        record["time_eval"] = evaluator.seconds
    warnings = []
    if distributed.world().main:  # the metrics are the whole round's: evaluated once
        for fired in check(record, history, spec.health, spec.train.rounds):
            record[fired.sign.key] = 1.0
            if fired.started:
                warnings.append(warning(fired, spec.health))
    log.append(record)
    if trackers is not None:
        trackers.log_metrics(r + 1, record)
    if (r + 1) % spec.output.sample_every == 0 and result.scores is not None:
        scores = result.scores.tolist()
        log.samples(r + 1, result.prompts, result.responses, scores)
        if trackers is not None:
            trackers.log_samples(r + 1, result.prompts, result.responses, scores)
    return {**record, "_skipped": list(result.skipped), "_health": warnings}
