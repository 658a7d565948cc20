"""Benchmark of the update's speed on SmolLM2-135M: one fixed round (16 rows, every weight
trained, bfloat16) under several configurations, each its own run built in this process,
taking turns round after round (A, B, A, B ...) after one warm-up round each, so a shared
machine's load meets them alike.

A configuration is ``NAME:KEY=VALUE;KEY=VALUE`` (spec overrides on top of the base ones,
``--set``), or ``NAME:`` for the base spec; the first is the baseline. A key
``@module.NAME`` sets a module's constant (a Python literal) while the configuration builds
and runs, e.g. ``@ppokit.trainer.optim.ADAMW_FUSED=None`` (torch's per-parameter AdamW) or
``@ppokit.trainer.logprobs.TILE_ELEMENTS=16777216`` (64 MiB tiles of logits). The round's responses
are injected (random tokens, lengths uniform over ``--lengths``) as in
``benchmarks/microbatch.py``, so generation does not count; each round runs ``run_round``'s
no-grad passes and update. Printed per configuration: the median ``time_update``, its
``mfu_update`` (the update's model FLOPs over its seconds over the device's measured peak,
:mod:`ppokit.trainer.flops`) and the baseline's time over its own, side by side; then the
median ``time_logprob`` likewise. ``--profile NAME`` runs one more update of that
configuration under ``torch.profiler`` and prints its top operators by self CPU time.

    python benchmarks/update_speed.py [--rounds 3] [--threads 1] [--lengths 100-200]
        [--configs "autocast:,master:model.master_weights=true"] [--profile NAME]
        [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import gc
import importlib
import os
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ppokit.data import make_prompt_source
from ppokit.spec import load_spec
from ppokit.trainer.flops import phase_peaks
from ppokit.trainer.metrics import read_once
from ppokit.trainer.producers.given import Given
from ppokit.trainer.prompts import format_prompts
from ppokit.trainer.rollout import Rollout
from ppokit.trainer.round import run_round
from ppokit.trainer.run import build

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "examples" / "specs" / "smollm2_arithmetic_cpu.yaml"
#: Every weight trained, bfloat16, 4 prompts x 4 samples, log π_old recomputed (the no-grad
#: pass), no reference (it does not change
#: the update's work and would hold a second copy of the weights per configuration).
BASE = [
    "model.lora=null", "model.dtype=bfloat16", "rollout.prompts_per_round=4",
    "rollout.n=4", "rollout.max_new_tokens=256", "rollout.logp_old=forward", "kl=null", "eval=null",
    "output.progress=false", "train.micro_batch_tokens=4096",
]  # fmt: skip
CONFIGS = "autocast:"


def _load() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def _round(spec: Any, run: Any, lengths_arg: str) -> tuple[Any, ...]:
    """The fixed round (rows, prompts, rollout, scores) of ``spec``, the same for every
    configuration (seeded)."""
    setup, models = run.setup, run.setup.models
    r = spec.rollout
    rows = make_prompt_source(spec.data, spec.seed).next_rows(r.prompts_per_round)
    formatted = format_prompts(rows, models.tokenizer, spec.data)
    ids, attn = setup.encode(formatted, spec.data, r.max_new_tokens)
    ids, attn = ids.repeat_interleave(r.n, 0), attn.repeat_interleave(r.n, 0)
    low, high = (int(x) for x in lengths_arg.split("-"))
    g = torch.Generator().manual_seed(spec.seed)
    lengths = torch.randint(low, high + 1, (ids.shape[0],), generator=g)
    width = int(lengths.max())
    response = torch.randint(
        10, models.tokenizer.vocab_size - 10, (ids.shape[0], width), generator=g
    )
    mask = torch.arange(width)[None, :] < lengths[:, None]
    ro = Rollout(ids, attn, response.masked_fill(~mask, 0), mask, lengths == width, None)
    with torch.no_grad():
        logp = setup.forwards.policy_logprobs(ro)
    ro.logp_rollout = logp * mask
    scores = (torch.rand(ids.shape[0], generator=g) > 0.5).float()
    return rows, formatted, ro, scores


@contextlib.contextmanager
def _constants(overrides: list[str]) -> Iterator[None]:
    """The ``@module.NAME=value`` of a configuration set, restored on exit."""
    saved = []
    for item in overrides:
        key, value = item[1:].split("=", 1)
        module, name = key.rsplit(".", 1)
        mod = importlib.import_module(module)
        saved.append((mod, name, getattr(mod, name)))
        setattr(mod, name, ast.literal_eval(value))
    try:
        yield
    finally:
        for mod, name, old in reversed(saved):
            setattr(mod, name, old)


def _one(run: Any, fixed: tuple[Any, ...], round_no: int) -> dict[str, float]:
    rows, formatted, ro, scores = fixed
    producer = Given.of(run.setup, rows, formatted, ro, scores)
    result = run_round(run.setup, run.state, producer.next(round_no), round_no=round_no)
    metrics = read_once(result.metrics)
    t = result.timings
    return {
        "update": t["time_update"],
        "logprob": t["time_logprob"],
        "flops_update": float(metrics["flops_update"]),
        "flops_logprob": float(metrics["flops_logprob"]),
    }


def _profile(run: Any, fixed: tuple[Any, ...], top: int = 25) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _one(run, fixed, 99)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", type=Path, default=SPEC)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--configs", default=CONFIGS)
    parser.add_argument("--lengths", default="100-200", help="response lengths, min-max")
    parser.add_argument("--profile", default=None, metavar="NAME")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    configs: dict[str, list[str]] = {}
    for item in args.configs.split(","):
        name, _, rest = item.partition(":")
        configs[name] = [x for x in rest.split(";") if x]
    consts = {c: [x for x in v if x.startswith("@")] for c, v in configs.items()}
    runs, fixed, peaks = {}, None, {}
    for name, overrides in configs.items():
        spec = load_spec(args.spec, [*BASE, *args.set, *(x for x in overrides if x[0] != "@")])
        with _constants(consts[name]):
            runs[name] = build(spec, threads=False)
        peaks[name] = phase_peaks(spec, runs[name].setup.models)
        if fixed is None:  # one round for all (the same tokenizer and prompts)
            fixed = _round(spec, runs[name], args.lengths)
    assert fixed is not None
    ro = fixed[2]
    real = int(ro.prompt_mask.sum() + ro.response_mask.sum())
    print(
        f"torch {torch.__version__}, {args.threads} thread(s); {ro.prompt_ids.shape[0]} rows, "
        f"responses of {args.lengths} tokens ({real} real tokens); median of {args.rounds} "
        f"interleaved rounds after a warm-up; load {_load()}",
        flush=True,
    )
    times: dict[str, list[dict[str, float]]] = {c: [] for c in configs}
    for i in range(args.rounds + 1):
        for name, run in runs.items():
            gc.collect()
            with _constants(consts[name]):
                row = _one(run, fixed, i + 1)
            print(
                f"  round {i} {name:14s} logprob {row['logprob']:6.2f} s update "
                f"{row['update']:6.2f} s; load {_load()}",
                flush=True,
            )
            if i > 0:
                times[name].append(row)
    print(f"load after: {_load()}")
    med = {c: {k: statistics.median(x[k] for x in v) for k in v[0]} for c, v in times.items()}
    base = next(iter(med.values()))
    print(f"{'config':14s} {'update s':>9s} {'mfu_update':>10s} {'speed-up':>8s}   "
          f"{'logprob s':>9s} {'mfu_logprob':>11s} {'speed-up':>8s}")  # fmt: skip
    for c, m in med.items():
        mfu_u = m["flops_update"] / (m["update"] * peaks[c]["update"])
        mfu_l = m["flops_logprob"] / (max(m["logprob"], 1e-9) * peaks[c]["logprob"])
        print(
            f"{c:14s} {m['update']:9.2f} {mfu_u:10.1%} {base['update'] / m['update']:8.2f}   "
            f"{m['logprob']:9.2f} {mfu_l:11.1%} {base['logprob'] / max(m['logprob'], 1e-9):8.2f}"
        )
    if args.profile is not None:
        with _constants(consts[args.profile]):
            _profile(runs[args.profile], fixed)
    for run in runs.values():
        run.setup.close()


if __name__ == "__main__":
    main()
