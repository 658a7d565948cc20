"""Benchmark of the rollout engines: the same round with ``hf`` and with ``vllm`` (float32 and
bfloat16), interleaved in one process, and optionally the demo's learning with each.

Round mode (the default): one run (:mod:`ppokit.trainer.setup`) per engine, built from the
same spec and seed; every round draws one batch of prompts and runs it through each learner
in turn (``run_round``: generate, score, forward passes, estimate, update, engine sync), after
one warm-up round each, so load from other processes hits all alike. Printed per engine:
the median round time, generation time, sync (weight push) time and generated tokens/s,
and the ratio of hf's round time to each engine's.

    python benchmarks/engines.py [--spec PATH] [--rounds N] [--engines hf,vllm,vllm-bf16]
                                 [--threads N] [--set KEY=VALUE ...]

Demo mode: ``--demo SEEDS`` trains the demo task (heads of 32 dimensions: vLLM's CPU
attention has none of 16) for ``--demo-rounds`` rounds with each engine and each seed, one
run after the other, and prints the mean reward of the last 10 rounds of each.

    python benchmarks/engines.py --demo 0-4 --demo-rounds 120

The default spec is examples/specs/smollm2_arithmetic_cpu.yaml (SmolLM2-135M-Instruct, GRPO,
LoRA r=16: the push is the adapters) without its evaluation; ``--set model.lora=null``
pushes every weight instead.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.round import make_learner
from ppokit.data import make_prompt_source
from ppokit.spec import load_spec
from ppokit.trainer.metrics import read_once
from ppokit.trainer.producers import Inline, starting_with
from ppokit.trainer.prompts import format_prompts
from ppokit.trainer.round import run_round

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "examples" / "specs" / "smollm2_arithmetic_cpu.yaml"
DEMO = ROOT / "ppokit" / "specs" / "demo.yaml"
#: The engine settings each name stands for.
ENGINES = {
    "hf": "rollout.engine=hf",
    "vllm": "rollout.engine={name: vllm, dtype: float32}",
    "vllm-bf16": "rollout.engine={name: vllm, dtype: bfloat16}",
    "hf-bf16": "rollout.engine={name: hf, dtype: bfloat16}",
    "vllm-sleep": "rollout.engine={name: vllm, dtype: bfloat16, sleep: true}",
}
#: The demo's tiny model with heads vLLM's CPU attention supports.
TINY_32 = [
    "model.tiny.num_attention_heads=2",
    "model.tiny.num_key_value_heads=2",
]


def _load() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def rounds(args: argparse.Namespace) -> None:
    names = args.engines.split(",")
    base = ["eval=null", "output.progress=false", *args.set]
    learners = {}
    for name in names:
        begin = time.perf_counter()
        learners[name] = make_learner(load_spec(args.spec, [*base, ENGINES[name]]))
        print(f"{name}: started in {time.perf_counter() - begin:.1f} s", flush=True)
    spec = next(iter(learners.values()))[0].spec
    r = spec.rollout
    source = make_prompt_source(spec.data, spec.seed)
    tokenizer = next(iter(learners.values()))[0].models.tokenizer
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; spec {args.spec.name}, "
        f"actor {spec.model.actor}, lora {spec.model.lora is not None}, {r.prompts_per_round} "
        f"prompts x {r.n} samples, max_new_tokens {r.max_new_tokens}; median of {args.rounds} "
        f"interleaved rounds after one warm-up round each; load before: {_load()}",
        flush=True,
    )
    times: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for i in range(args.rounds + 1):
        rows = source.next_rows(r.prompts_per_round)
        formatted = format_prompts(rows, tokenizer, spec.data)
        for name, (setup, state) in learners.items():
            begin = time.perf_counter()
            producer = Inline(setup, starting_with(rows, formatted), refills=False)
            result = run_round(setup, state, producer.next(i + 1), round_no=i + 1)
            result.timings.update(producer.trained(i + 1))
            metrics = read_once(result.metrics)
            total = time.perf_counter() - begin
            t = result.timings
            row = {
                "round": total,
                "generate": t["time_generate"],
                "sync": t.get("time_sync", 0.0),
                "tokens": metrics["tokens"],
                "reward": metrics["reward_mean"],
                "mismatch_k3": metrics.get("rollout/mismatch_k3", 0.0),  # μ against π_old
            }
            row["tokens_per_s"] = row["tokens"] / row["generate"]
            print(
                f"  round {i} {name:10s} " + " ".join(f"{k} {v:.3f}" for k, v in row.items()),
                flush=True,
            )
            if i > 0:
                times[name].append(row)
    print(f"load after: {_load()}")
    med = {n: {k: statistics.median(x[k] for x in times[n]) for k in times[n][0]} for n in names}
    print(
        f"{'engine':10s} {'round s':>8s} {'generate s':>10s} {'sync s':>7s} {'tokens/s':>9s}"
        f" {'hf/engine':>9s}"
    )
    hf = med.get("hf", {}).get("round")
    for n in names:
        m = med[n]
        ratio = f"{hf / m['round']:.2f}" if hf else "-"
        print(
            f"{n:10s} {m['round']:8.2f} {m['generate']:10.2f} {m['sync']:7.3f} "
            f"{m['tokens_per_s']:9.1f} {ratio:>9s}"
        )
    for setup, _ in learners.values():
        setup.close()


def _seeds(text: str) -> list[int]:
    if "-" in text:
        lo, hi = text.split("-")
        return list(range(int(lo), int(hi) + 1))
    return [int(s) for s in text.split(",")]


def demo(args: argparse.Namespace) -> None:
    from ppokit.trainer import train
    from ppokit.trainer.metrics import read_metrics

    print(f"the demo, heads of 32 dimensions, {args.demo_rounds} rounds; load: {_load()}")
    finals: dict[str, list[float]] = {}
    for name in args.engines.split(","):
        for seed in _seeds(args.demo):
            out = tempfile.mkdtemp(prefix="ppokit-engines-")
            spec = load_spec(
                DEMO,
                [
                    *TINY_32,
                    ENGINES[name],
                    f"seed={seed}",
                    f"train.rounds={args.demo_rounds}",
                    "output.progress=false",
                    "output.save_every=100000",
                    "output.sample_every=100000",
                    f"output.dir={out}",
                    *args.set,
                ],
            )
            begin = time.perf_counter()
            train(spec)
            wall = time.perf_counter() - begin
            records = read_metrics(out)
            last = statistics.mean(x["reward_mean"] for x in records[-10:])
            finals.setdefault(name, []).append(last)
            print(f"  {name:10s} seed {seed}: last-10 reward {last:.3f}, {wall:.0f} s", flush=True)
    for name, values in finals.items():
        spread = statistics.stdev(values) if len(values) > 1 else 0.0
        print(
            f"{name:10s} mean {statistics.mean(values):.3f} sd {spread:.3f} "
            f"min {min(values):.3f} max {max(values):.3f} over {len(values)} seeds"
        )
    print(f"load after: {_load()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", type=Path, default=SPEC)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--engines", default="hf,vllm,vllm-bf16")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--demo", metavar="SEEDS", help="train the demo with each engine")
    parser.add_argument("--demo-rounds", type=int, default=120)
    args = parser.parse_args()
    if args.threads is not None:  # before vLLM starts: it binds the threads it finds
        torch.set_num_threads(args.threads)
    if args.demo:
        if args.engines == parser.get_default("engines"):
            args.engines = "hf,vllm"
        demo(args)
    else:
        rounds(args)


if __name__ == "__main__":
    main()
