"""Generation beside the update in a thread or in a process of its own: how much of the two
overlaps on this machine.

SmolLM2-135M-Instruct (every weight trained): ``generate`` samples 4 prompts x 4 responses
of ``--tokens`` new tokens (``model.generate`` with the KV cache, as the ``hf`` engine does)
and ``update`` runs one AdamW step over 16 sequences of ``--length`` tokens (forward and
backward of the whole model). Each is timed alone with ``--threads`` torch threads (every
core by default), then both at once with half the cores each: in two threads of one process
(what ``rollout.max_staleness`` does), and in two processes (the generation in a process of
its own, with a copy of the model, started and loaded before the clock starts). Printed:
each time, and each overlap's wall time over max(generate, update) measured with the halves
(1.0: a perfect overlap) and over the sequential sum with every core.

    python benchmarks/overlap.py [--tokens 64] [--length 256] [--repeats 3]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "examples" / "specs" / "smollm2_arithmetic_cpu.yaml"


def _load() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def _model() -> tuple[Any, Any]:
    from ppokit.spec import load_spec
    from ppokit.trainer.models import build_models

    spec = load_spec(SPEC, ["model.lora=null", "kl=null", "eval=null"])
    models = build_models(spec, 1)
    return models.actor, models.tokenizer


def _inputs(tokenizer: Any, length: int) -> tuple[Any, torch.Tensor]:
    pairs = ((3, 4), (12, 9), (7, 15), (2, 18))
    prompts = [f"What is {a} + {b}? Think step by step." for a, b in pairs]
    enc = tokenizer(prompts, padding=True, return_tensors="pt")
    batch = torch.randint(3, 1000, (16, length), generator=torch.Generator().manual_seed(0))
    return enc, batch


def generate(model: Any, enc: Any, tokens: int, threads: int) -> float:
    torch.set_num_threads(threads)
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(
            **enc,
            do_sample=True,
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            num_return_sequences=4,
            top_k=0,
        )
    return time.perf_counter() - start


def update(model: Any, opt: Any, batch: Any, threads: int) -> float:
    torch.set_num_threads(threads)
    start = time.perf_counter()
    out = model(input_ids=batch, labels=batch)
    out.loss.backward()
    opt.step()
    opt.zero_grad()
    return time.perf_counter() - start


def _child(go: Any, done: Any, ready: Any, tokens: int, threads: int, repeats: int) -> None:
    """The generation in a process of its own: loads its model, then generates on each go."""
    model, tokenizer = _model()
    model.eval()
    enc, _ = _inputs(tokenizer, 8)
    generate(model, enc, 4, threads)  # warm-up
    ready.set()
    for _ in range(repeats):
        go.wait()
        go.clear()
        done.put(generate(model, enc, tokens, threads))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    a = parser.parse_args()
    half = max(1, a.threads // 2)
    model, tokenizer = _model()
    enc, batch = _inputs(tokenizer, a.length)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-7)
    sampler = type(model)(model.config)  # the frozen copy's cost: a second set of weights
    sampler.load_state_dict(model.state_dict())
    sampler.eval()
    generate(sampler, enc, 4, a.threads)  # warm-up
    update(model, opt, batch, a.threads)

    ctx = mp.get_context("spawn")
    go, ready, done = ctx.Event(), ctx.Event(), ctx.Queue()
    child = ctx.Process(target=_child, args=(go, done, ready, a.tokens, half, a.repeats))
    child.start()
    ready.wait()
    print(
        f"torch {torch.__version__}; {a.threads} threads alone, {half} + {half} together; "
        f"generate 16 x {a.tokens} tokens, update 16 x {a.length} tokens; load before: {_load()}",
        flush=True,
    )
    rows = []
    for i in range(a.repeats):
        row = {
            "generate": generate(sampler, enc, a.tokens, a.threads),
            "update": update(model, opt, batch, a.threads),
            "generate half": generate(sampler, enc, a.tokens, half),
            "update half": update(model, opt, batch, half),
        }
        # two threads of one process
        thread = threading.Thread(target=generate, args=(sampler, enc, a.tokens, half))
        start = time.perf_counter()
        thread.start()
        update(model, opt, batch, half)
        thread.join()
        row["threads wall"] = time.perf_counter() - start
        # two processes
        start = time.perf_counter()
        go.set()
        update(model, opt, batch, half)
        done.get()
        row["processes wall"] = time.perf_counter() - start
        best = max(row["generate half"], row["update half"])
        row["threads / max"] = row["threads wall"] / best
        row["processes / max"] = row["processes wall"] / best
        row["sum / threads"] = (row["generate"] + row["update"]) / row["threads wall"]
        row["sum / processes"] = (row["generate"] + row["update"]) / row["processes wall"]
        print(f"  {i}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()), flush=True)
        rows.append(row)
    child.join(timeout=60)
    print(f"load after: {_load()}")
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    print("| " + " | ".join(med) + " |")
    print("|" + "---|" * len(med))
    print("| " + " | ".join(f"{v:.2f}" for v in med.values()) + " |")


if __name__ == "__main__":
    main()
