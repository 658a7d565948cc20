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

``vllm-server`` and ``vllm-server-bf16`` are the ``vllm_server`` engine: for each, ``ppokit
serve-rollouts`` is started for the spec (with ``--set``) on a free port on loopback, with
``--enforce-eager`` as the in-process engine runs and each ``--server-arg`` (on a GPU the
trainer and an in-process engine share it: ``--server-arg=--gpu-memory-utilization=0.25``),
and stopped at the end; the round's sync is then the push through a file and
``/collective_rpc``. It pushes full weights: with the default spec add
``--set model.lora=null``.

    python benchmarks/engines.py --engines vllm-bf16,vllm-server-bf16 --set model.lora=null
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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
#: The engines through a server of their own: the arguments for vLLM's server of each.
SERVERS = {
    "vllm-server": ["--enforce-eager"],
    "vllm-server-bf16": ["--enforce-eager", "--dtype", "bfloat16"],
}
#: Seconds a server may take to start (SmolLM2 on a busy CPU: about two minutes).
SERVER_START = 900
#: The demo's tiny model with heads vLLM's CPU attention supports.
TINY_32 = [
    "model.tiny.num_attention_heads=2",
    "model.tiny.num_key_value_heads=2",
]


def _load() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


@contextlib.contextmanager
def served(spec: Path, sets: list[str], extra: list[str]) -> Iterator[str]:
    """``ppokit serve-rollouts SPEC`` (with ``sets`` and ``extra`` for vLLM) on a free port
    on loopback, its output in a temporary file: its URL once it answers, until the block
    ends."""
    import httpx

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "ppokit.cli", "serve-rollouts", str(spec), "--port", str(port)]
    command += [a for item in sets for a in ("--set", item)]
    command += [f"--vllm-arg={a}" for a in extra]
    with tempfile.NamedTemporaryFile("w+", prefix="ppokit-serve-rollouts-") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        begin = time.perf_counter()
        try:
            while True:
                if proc.poll() is not None:
                    log.seek(0)
                    raise SystemExit(f"the server ended: {log.read()[-3000:]}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                        break
                if time.perf_counter() - begin > SERVER_START:
                    raise SystemExit(f"the server did not start within {SERVER_START} s")
                time.sleep(1)
            print(f"server {url}: started in {time.perf_counter() - begin:.1f} s", flush=True)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def rounds(args: argparse.Namespace) -> None:
    names = args.engines.split(",")
    base = ["eval=null", "output.progress=false", *args.set]
    learners = {}
    with contextlib.ExitStack() as servers:
        for name in names:
            engine = ENGINES.get(name)
            if name in SERVERS:
                url = servers.enter_context(
                    served(args.spec, args.set, [*SERVERS[name], *args.server_arg])
                )
                engine = f"rollout.engine={{name: vllm_server, urls: ['{url}']}}"
            begin = time.perf_counter()
            learners[name] = make_learner(load_spec(args.spec, [*base, str(engine)]))
            print(f"{name}: started in {time.perf_counter() - begin:.1f} s", flush=True)
        interleaved(args, names, learners)


def interleaved(args: argparse.Namespace, names: list[str], learners: dict[str, Any]) -> None:
    """The rounds of every learner in turn, and the medians."""
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
                f"  round {i} {name:16s} " + " ".join(f"{k} {v:.3f}" for k, v in row.items()),
                flush=True,
            )
            if i > 0:
                times[name].append(row)
    print(f"load after: {_load()}")
    med = {n: {k: statistics.median(x[k] for x in times[n]) for k in times[n][0]} for n in names}
    print(
        f"{'engine':16s} {'round s':>8s} {'generate s':>10s} {'sync s':>7s} {'tokens/s':>9s}"
        f" {'hf/engine':>9s}"
    )
    hf = med.get("hf", {}).get("round")
    for n in names:
        m = med[n]
        ratio = f"{hf / m['round']:.2f}" if hf else "-"
        print(
            f"{n:16s} {m['round']:8.2f} {m['generate']:10.2f} {m['sync']:7.3f} "
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
    parser.add_argument(
        "--server-arg", action="append", default=[], metavar="ARG", help="for vLLM's server"
    )
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
