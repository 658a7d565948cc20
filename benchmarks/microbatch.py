"""Benchmark of the trainer's passes by micro-batching: micro-batches of a number of rows
(``train.micro_batch_size``, each padded to the round's longest row) against token budgets
(``train.micro_batch_tokens``, rows sorted by length, each micro-batch cut to its own longest
row) with and without packing (``train.pack_sequences``), on one learner, interleaved.

A round of fixed responses is injected (random tokens, lengths drawn like a 256-token round's:
uniform over [min, max]), so generation does not count: each round is ``run_round``'s
no-grad passes (``time_logprob``: log π_old, log π_ref) and update (``time_update``), with
the spec's settings and each configuration's micro-batches; the configurations take turns,
round after round, after one warm-up round each. Printed: the median seconds of both
phases, the tokens the passes ran (padding included) per real token, and the ratio of the
first configuration's time to each one's.

    python benchmarks/microbatch.py [--long] [--rounds 3] [--threads 1]
        [--configs rows=4,rows=16,tokens=1024,tokens=2048,packed=1024]
        [--lengths 60-320] [--spec PATH] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from ppokit.spec import load_spec
from ppokit.trainer.metrics import read_once
from ppokit.trainer.microbatches import MicroBatches
from ppokit.trainer.producers.given import Given
from ppokit.trainer.prompts import format_prompts
from ppokit.trainer.rollout import Rollout
from ppokit.trainer.round import run_round
from ppokit.trainer.run import build

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "examples" / "specs" / "smollm2_arithmetic_cpu.yaml"
LONG = ["model.lora=null", "rollout.max_new_tokens=256", "rollout.prompts_per_round=4"]


def _load() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def _train(spec: object, config: str) -> object:
    kind, value = config.split("=")
    update = {"micro_batch_size": None, "micro_batch_tokens": None, "pack_sequences": False}
    if kind == "rows":
        update["micro_batch_size"] = int(value)
    else:
        update["micro_batch_tokens"] = int(value)
        update["pack_sequences"] = kind == "packed"
    return spec.train.model_copy(update=update)  # type: ignore[attr-defined]


def _padded_tokens(ro: Rollout, micro: MicroBatches, train: object) -> int:
    """Tokens the update's forward passes run over a round, padding included."""
    b = ro.response_ids.shape[0]
    mb = micro.minibatches(torch.arange(b), b, torch.device("cpu"))[0][1]
    total = 0
    for m in mb:
        part = m.rollout(ro)
        if micro.pack:
            total += int(part.inputs()[1].sum())
        else:
            total += part.prompt_ids.shape[0] * (part.prompt_len + part.response_ids.shape[1])
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", type=Path, default=SPEC)
    parser.add_argument("--long", action="store_true", help="the 256-token full-FT round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--configs", default="rows=4,rows=16,tokens=1024,tokens=2048,packed=1024")
    parser.add_argument("--lengths", default="60-320", help="response lengths, min-max")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    overrides = ["eval=null", "output.progress=false", *(LONG if args.long else []), *args.set]
    spec = load_spec(args.spec, overrides)
    run = build(spec, threads=False)  # args.threads
    setup, state, models = run.setup, run.state, run.setup.models
    r = spec.rollout
    from ppokit.data import make_prompt_source

    rows = make_prompt_source(spec.data, spec.seed).next_rows(r.prompts_per_round)
    formatted = format_prompts(rows, models.tokenizer, spec.data)
    ids, attn = setup.encode(formatted, spec.data, r.max_new_tokens)
    ids, attn = ids.repeat_interleave(r.n, 0), attn.repeat_interleave(r.n, 0)
    low, high = (int(x) for x in args.lengths.split("-"))
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
    configs = args.configs.split(",")
    real = int(attn.sum() + mask.sum())
    print(
        f"torch {torch.__version__}, {args.threads} thread(s); spec {args.spec.name}"
        f"{' --long' if args.long else ''}, dtype {spec.model.dtype}, {ids.shape[0]} rows, "
        f"prompts of {int(attn.sum(1).min())}-{int(attn.sum(1).max())} tokens, responses of "
        f"{low}-{high} ({real} real tokens); median of {args.rounds} interleaved rounds "
        f"after a warm-up; load {_load()}",
        flush=True,
    )
    times: dict[str, list[dict[str, float]]] = {c: [] for c in configs}
    padded = {}
    for i in range(args.rounds + 1):
        for config in configs:
            train = _train(spec, config)
            setup.spec = spec.model_copy(update={"train": train})
            setup.forwards.tokens = train.micro_batch_tokens is not None  # type: ignore[attr-defined]
            setup.forwards.pack = train.pack_sequences  # type: ignore[attr-defined]
            padded[config] = _padded_tokens(ro, MicroBatches.of(train, ro), train)  # type: ignore[arg-type]
            begin = time.perf_counter()
            produced = Given.of(setup, rows, formatted, ro, scores).next(i + 1)
            result = run_round(setup, state, produced, round_no=i + 1)
            read_once(result.metrics)
            total = time.perf_counter() - begin
            t = result.timings
            row = {"logprob": t["time_logprob"], "update": t["time_update"], "round": total}
            print(
                f"  round {i} {config:12s} logprob {row['logprob']:6.1f} s update "
                f"{row['update']:6.1f} s; load {_load()}",
                flush=True,
            )
            if i > 0:
                times[config].append(row)
    print(f"load after: {_load()}")
    med = {c: {k: statistics.median(x[k] for x in v) for k in v[0]} for c, v in times.items()}
    first = med[configs[0]]["round"]
    print(f"{'config':12s} {'logprob s':>9s} {'update s':>9s} {'passes s':>9s} "
          f"{'tokens run / real':>17s} {'speed-up':>8s}")  # fmt: skip
    for c, m in med.items():
        print(
            f"{c:12s} {m['logprob']:9.1f} {m['update']:9.1f} {m['round']:9.1f} "
            f"{padded[c] / real:17.2f} {first / m['round']:8.2f}"
        )
    setup.close()


if __name__ == "__main__":
    main()
