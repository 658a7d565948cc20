"""``train(spec)``: the outer loop of a run (output directory, seeding, rounds, metrics,
checkpoints, display)."""

from __future__ import annotations

import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ppokit.errors import UserError
from ppokit.spec import Spec, validate_spec
from ppokit.trainer.assembly import Assembly
from ppokit.trainer.checkpoint import (
    CHECKPOINT,
    has_checkpoint,
    load_checkpoint,
    save_checkpoint,
    truncate_jsonl,
)
from ppokit.trainer.display import Display
from ppokit.trainer.metrics import MetricsLog, plot_curves, read_metrics, read_once
from ppokit.trainer.models import build_models
from ppokit.trainer.round import Learner

__all__ = ["smoke_spec", "train"]

#: Files a run writes into its output directory (removed by ``overwrite``).
RUN_FILES = ("metrics.jsonl", "samples.jsonl", "curves.png", "spec.yaml", CHECKPOINT)


def smoke_spec(spec: Spec, out: str | None = None) -> Spec:
    """Two rounds of the spec's own components on the tiny model with small batches.

    They write to ``out`` when given, else to a new temporary directory, never to the
    spec's own output directory.
    """
    data = spec.model_dump()
    n = max(2, min(spec.rollout.n, 4))
    data["model"].update(
        actor="tiny",
        tiny={},
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
        data["output"].update(dir=tempfile.mkdtemp(prefix="ppokit-smoke-"), overwrite=True)
    else:
        data["output"].update(dir=out)
    data["output"].update(save_every=1, sample_every=1)
    return validate_spec(data)


def _prepare_output(out: Path, resume: bool, overwrite: bool) -> None:
    if resume:
        if not has_checkpoint(out):
            raise UserError(f"nothing to resume: {out / CHECKPOINT} does not exist")
        return
    if out.exists() and not out.is_dir():
        raise UserError(f"output.dir {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise UserError(
                f"output.dir {out} is not empty: use --overwrite to replace it or --resume "
                "to continue it"
            )
        for name in (*RUN_FILES, f".{CHECKPOINT}.tmp", f".{CHECKPOINT}.old"):
            path = out / name
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
    out.mkdir(parents=True, exist_ok=True)


def _seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def train(
    spec: Spec,
    *,
    resume: bool = False,
    smoke: bool = False,
    overwrite: bool = False,
    smoke_out: str | None = None,
) -> dict[str, Any]:
    """Run the PPO loop the spec describes; returns a JSON-serialisable summary.

    ``resume`` continues from ``output.dir/checkpoint``; ``smoke`` runs two small rounds on
    the tiny model in ``smoke_out`` (default: a temporary directory); ``overwrite`` replaces
    an existing output.
    """
    from transformers.utils import logging as hf_logging

    from ppokit.data import format_prompts, make_prompt_source

    hf_logging.set_verbosity_error()
    if smoke:
        spec = smoke_spec(spec, smoke_out)
        resume = False
    out = Path(spec.output.dir).expanduser()
    _prepare_output(out, resume, overwrite or spec.output.overwrite)
    wall = time.perf_counter()
    _seed_all(spec.seed)
    assembly = Assembly.from_spec(spec)
    models = build_models(spec, assembly.head_size)
    learner = Learner(spec, models, assembly)
    source = make_prompt_source(spec.data, spec.seed)
    log = MetricsLog(out)
    start = 0
    if resume:
        start = load_checkpoint(out, learner, source)
        truncate_jsonl(log.path, start)
        truncate_jsonl(log.samples_path, start)
    spec_yaml = spec.to_yaml()
    (out / "spec.yaml").write_text(spec_yaml)
    history = read_metrics(out)
    total = spec.train.rounds
    display = Display(total, start, spec.output.progress)
    display.message(
        f"ppokit: {total - start} round(s) on {models.runtime.device}, output {out}"
        + (f" (resumed at round {start})" if resume else "")
    )
    try:
        for r in range(start, total):
            record = _run_round(spec, learner, source, format_prompts, r, log)
            history.append(record)
            if (r + 1) % spec.output.save_every == 0 or r + 1 == total:
                save_checkpoint(out, learner, source, r + 1, spec_yaml)
            display.round(record, total)
    finally:
        display.close()
    if history:
        plot_curves(history, out / "curves.png")
    display.summary(history, str(out))
    first = history[0]["reward_mean"] if history else None
    tail = [h["reward_mean"] for h in history[-5:] if h.get("reward_mean") is not None]
    return {
        "output_dir": str(out),
        "rounds": len(history),
        "resumed_from": start if resume else None,
        "smoke": smoke,
        "seconds": round(time.perf_counter() - wall, 3),
        "reward_first": first,
        "reward_last": sum(tail) / len(tail) if tail else None,
        "final": history[-1] if history else None,
    }


def _run_round(
    spec: Spec, learner: Learner, source: Any, format_prompts: Any, r: int, log: MetricsLog
) -> dict[str, Any]:
    begin = time.perf_counter()
    rows = source.next_rows(spec.rollout.prompts_per_round)
    formatted = format_prompts(rows, learner.models.tokenizer, spec.data)
    data, result = learner.collect(rows, formatted)
    train_actor = r >= spec.train.critic_warmup_rounds
    learner.update(data, train_actor, result)
    values = read_once(result.metrics)  # the round's one host read
    tokens = values.pop("tokens", None) or 0.0
    record: dict[str, Any] = {"round": r + 1, **values, **result.timings}
    gen = result.timings.get("time_generate", 0.0)
    record["tokens_per_s"] = tokens / gen if gen > 0 else None
    record["time_round"] = time.perf_counter() - begin
    log.append(record)
    if (r + 1) % spec.output.sample_every == 0 and result.scores is not None:
        log.samples(r + 1, result.prompts, result.responses, result.scores.tolist())
    return record
