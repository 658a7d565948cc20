"""Benchmark of scoring overlapped with generation (``rollout.overlap_scoring``): the demo's
rounds with dynamic sampling and a slow ``http`` reward, with and without the overlap.

The reward is served on loopback by ``ppokit reward-server`` in a process of its own (the
``python`` reward, on the server's threads): half the demo's prompts (the symbols a and b)
score 0.5 whatever the response, never informative, the others the fraction of the
response's characters in a-m; every request sleeps ``--latency`` seconds a
response, a stand-in for a model or verifier service. The ``http`` reward sends one
response a request, ``--concurrency`` at a time. The demo spec's rounds
(``ppokit/specs/demo.yaml``: 16 prompts x 8 responses of 4 tokens, GAE-PPO with a critic) get
``rollout.filter: informative``, so a round draws several generation batches.

Runs alternate (overlap on, off, on, off, ...), ``--runs`` of each, ``--rounds`` rounds a run;
every figure is the median over the runs' rounds after each run's first. Printed: seconds a
round, ``time_generate``, ``time_score`` (the scoring generation did not hide),
``time_discarded`` (generation ahead the round did not need), generation batches a round,
and the ratio of round times; and whether the two settings logged the same metrics, timings
aside (they must).

    flock /tmp/ppokit-heavy.lock python benchmarks/reward_overlap.py [--latency 0.2]
        [--concurrency 16] [--rounds 4] [--runs 2] [--threads 1] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from ppokit.spec import load_spec
from ppokit.trainer import train
from ppokit.trainer.metrics import TIMING, read_metrics

DEMO = Path(__file__).resolve().parents[1] / "ppokit" / "specs" / "demo.yaml"


def slow_half_constant(latency: float) -> Any:
    def reward(
        prompts: list[str], responses: list[str], answer: list[str], **_: Any
    ) -> list[float]:
        time.sleep(latency * len(responses))
        return [
            0.5 if s in "ab" else sum("a" <= ch <= "m" for ch in r) / max(1, len(r))
            for r, s in zip(responses, answer, strict=True)
        ]

    return reward


def served_reward(prompts: list[str], responses: list[str], **fields: Any) -> list[float]:
    """What ``ppokit reward-server python`` serves: :func:`slow_half_constant` at the
    latency in ``$REWARD_OVERLAP_LATENCY``."""
    latency = float(os.environ["REWARD_OVERLAP_LATENCY"])
    return slow_half_constant(latency)(prompts, responses, **fields)  # type: ignore[no-any-return]


@contextmanager
def served(latency: float, concurrency: int) -> Iterator[str]:
    """``ppokit reward-server`` serving :func:`served_reward` in a process of its own, its
    calls on its own threads (``train.reward_timeout: null``), ``concurrency`` at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [
        sys.executable, "-m", "ppokit.cli", "reward-server", "python",
        "-p", f"function={Path(__file__).resolve()}:served_reward",
        "--set", "train.reward_timeout=null", "--port", str(port),
        "--concurrency", str(concurrency), "--max-pending", "1024",
    ]  # fmt: skip
    env = {**os.environ, "REWARD_OVERLAP_LATENCY": str(latency)}
    server = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            if server.poll() is not None:
                raise SystemExit("ppokit reward-server ended before it answered")
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        yield f"{url}/score"
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(30)


KEYS = (
    "time_round",
    "time_generate",
    "time_score",
    "time_discarded",
    "time_logprob",
    "time_update",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--latency", type=float, default=0.2)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--set", action="append", default=[], help="a spec override, KEY=VALUE")
    args = parser.parse_args()
    figures: dict[bool, dict[str, list[float]]] = {on: {} for on in (True, False)}
    logged: dict[bool, list[list[dict[str, Any]]]] = {True: [], False: []}
    with served(args.latency, args.concurrency) as url, tempfile.TemporaryDirectory() as tmp:
        for run in range(args.runs):
            for on in (True, False):
                out = Path(tmp) / f"{'on' if on else 'off'}-{run}"
                reward = (
                    f"reward={{name: http, url: '{url}', chunk_size: 1, "
                    f"concurrency: {args.concurrency}}}"
                )
                spec = load_spec(
                    DEMO,
                    [
                        reward,
                        f"output.dir={out}",
                        f"train.rounds={args.rounds}",
                        "rollout.filter=informative",
                        "rollout.max_generation_batches=4",
                        f"rollout.overlap_scoring={str(on).lower()}",
                        f"model.threads={args.threads}",
                        "output.save_every=1000",
                        "eval=null",
                        *args.set,
                    ],
                )
                train(spec)
                records = read_metrics(out)
                logged[on].append(
                    [
                        {k: v for k, v in r.items() if k not in TIMING and k != "time_discarded"}
                        for r in records
                    ]
                )
                for r in records[1:]:
                    for key in (*KEYS, "rollout/generation_batches"):
                        figures[on].setdefault(key, []).append(float(r.get(key) or 0.0))
    print(
        f"demo rounds, rollout.filter informative, http reward at {args.latency:g} s a "
        f"response, {args.concurrency} requests at once; {args.runs} runs of {args.rounds} "
        f"rounds each setting, interleaved; medians of rounds 2-{args.rounds}"
        + (f"; {' '.join(args.set)}" if args.set else "")
    )
    print(
        "| overlap_scoring | s / round | time_generate | time_score | time_discarded | "
        "time_logprob + time_update | batches |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    median = {on: {k: statistics.median(v) for k, v in figures[on].items()} for on in figures}
    for on in (False, True):
        m = median[on]
        print(
            f"| {str(on).lower()} | {m['time_round']:.2f} | {m['time_generate']:.2f} | "
            f"{m['time_score']:.2f} | {m['time_discarded']:.2f} | "
            f"{m['time_logprob'] + m['time_update']:.2f} | {m['rollout/generation_batches']:g} |"
        )
    ratio = median[False]["time_round"] / median[True]["time_round"]
    print(f"\nround time without / with the overlap: {ratio:.2f}x")
    same = logged[True] == logged[False]
    print(f"the same metrics (timings aside) with and without: {same}")


if __name__ == "__main__":
    main()
