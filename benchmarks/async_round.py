"""Benchmark of asynchronous rollouts: the same round synchronous (``rollout.max_staleness:
0``) and one step off the policy (``max_staleness: 1``, generation in a thread of its own
beside the update), two learners in one process, interleaved round by round.

Each of ``--rounds`` rounds (after one warm-up round each) runs the synchronous learner's
round, then the asynchronous learner's round followed by the wait for the batch its engine
is generating for the next round (``drain``): that sum is what a round costs in a run where
the two overlap, measured under the same load as the synchronous round beside it. Printed
per round and as medians: the synchronous round and its generation, the rest of it
(round − generation), the asynchronous round + drain, the ratio sync / async, and the ratio
of the asynchronous round to max(generation, rest) of the synchronous one (1.0: a perfect
overlap; the goal is at most 1.15).

The synchronous round uses ``--sync-threads`` torch threads (default: every core), the
asynchronous one the run's split (half the cores for the update, half for generation).

    python benchmarks/async_round.py [--engine hf|vllm-bf16] [--rounds N] [--long]
                                     [--spec PATH] [--set KEY=VALUE ...]

``--long`` is docs/results.md's long-response round (SmolLM2-135M-Instruct, every weight
trained, 4 prompts x 4 samples of up to 256 tokens, a prompt that asks for the steps).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.round import make_learner
from benchmarks.trl_grpo import LONG
from ppokit.data import make_prompt_source
from ppokit.spec import load_spec
from ppokit.trainer.metrics import read_once
from ppokit.trainer.producers import Asynchronous, Inline, starting_with
from ppokit.trainer.prompts import format_prompts
from ppokit.trainer.round import run_round
from ppokit.trainer.setup import Setup
from ppokit.trainer.threads import cpu_cores

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "examples" / "specs" / "smollm2_arithmetic_cpu.yaml"
ENGINES = {
    "hf": "rollout.engine=hf",
    "vllm-bf16": "rollout.engine={name: vllm, dtype: bfloat16}",
}
#: torch's thread setting before vLLM makes it a no-op (each learner's rounds set theirs).
SET_THREADS = torch.set_num_threads


def _load() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def _draw(setup: Setup) -> Any:
    spec = setup.spec
    source = make_prompt_source(spec.data, spec.seed)

    def draw() -> tuple[list[dict[str, Any]], list[str]]:
        rows = source.next_rows(spec.rollout.prompts_per_round)
        return rows, format_prompts(rows, setup.models.tokenizer, spec.data)

    return draw


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", type=Path, default=SPEC)
    parser.add_argument("--engine", choices=sorted(ENGINES), default="hf")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--long", action="store_true", help="the long-response round")
    parser.add_argument("--sync-threads", type=int, default=cpu_cores())
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    cores = cpu_cores()
    split = max(1, cores // 2)
    base = [
        "eval=null",
        "output.progress=false",
        f"train.rounds={args.rounds + 2}",  # the last round measured generates the next
        ENGINES[args.engine],
        *(LONG if args.long else []),
        *args.set,
    ]
    SET_THREADS(args.sync_threads)  # vLLM computes with the threads it finds as it starts
    sync = make_learner(load_spec(args.spec, [*base, "rollout.max_staleness=0"]))
    SET_THREADS(split)
    stale = make_learner(
        load_spec(args.spec, [*base, "rollout.max_staleness=1", f"rollout.engine_threads={split}"])
    )
    draw = _draw(sync[0])
    rollouts = Asynchronous(stale[0], _draw(stale[0]), start=0, threads=split)
    spec = sync[0].spec
    r = spec.rollout
    print(
        f"torch {torch.__version__}; {cores} cores: synchronous {args.sync_threads} threads, "
        f"asynchronous {split} + {split}; engine {args.engine}; actor {spec.model.actor}, "
        f"lora {spec.model.lora is not None}, {r.prompts_per_round} prompts x {r.n} samples "
        f"of up to {r.max_new_tokens} tokens; {args.rounds} interleaved rounds after a warm-up "
        f"each; load before: {_load()}",
        flush=True,
    )
    rows: list[dict[str, float]] = []
    try:
        for i in range(args.rounds + 1):
            SET_THREADS(args.sync_threads)
            begin = time.perf_counter()
            batch, formatted = draw()
            producer = Inline(sync[0], starting_with(batch, formatted), refills=False)
            result = run_round(sync[0], sync[1], producer.next(i + 1), round_no=i + 1)
            result.timings.update(producer.trained(i + 1))
            values = read_once(result.metrics)
            sync_s = time.perf_counter() - begin
            sync_gen = result.timings["time_generate"]

            SET_THREADS(split)
            begin = time.perf_counter()
            made = rollouts.next(i + 1)
            stale_result = run_round(stale[0], stale[1], made, round_no=i + 1)
            stale_result.timings.update(rollouts.trained(i + 1))
            stale_values = read_once(stale_result.metrics)
            middle = time.perf_counter()
            rollouts.schedule.pending()  # the next round's batch, generated beside this one
            end = time.perf_counter()
            row = {
                "sync s": sync_s,
                "sync generate s": sync_gen,
                "sync rest s": sync_s - sync_gen,
                "async s": end - begin,
                "async round s": middle - begin,
                "drain s": end - middle,
                "async generate s": stale_result.timings["time_generate"],
                "wait engine s": stale_result.timings.get("time_wait_engine", 0.0),
                "sync tokens": values["tokens"],
                "async tokens": stale_values["tokens"],
            }
            row["sync/async"] = row["sync s"] / row["async s"]
            row["async/max"] = row["async s"] / max(sync_gen, sync_s - sync_gen)
            label = "warm-up" if i == 0 else f"round {i}"
            print(f"  {label}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()), flush=True)
            if i > 0:
                rows.append(row)
    finally:
        rollouts.close()
        for setup, _ in (sync, stale):
            setup.close()
    print(f"load after: {_load()}")
    print("| " + " | ".join(["median", *rows[0]]) + " |")
    print("|" + "---|" * (len(rows[0]) + 1))
    med = {k: statistics.median(x[k] for x in rows) for k in rows[0]}
    print("| " + " | ".join([args.engine, *(f"{v:.2f}" for v in med.values())]) + " |")


if __name__ == "__main__":
    main()
