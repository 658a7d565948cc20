"""Benchmark of bounded calls: the demo's round with its reward in a worker process
(``train.reward_timeout`` set, the default) against the same round with the reward in the
trainer's process (``train.reward_timeout: null``, unbounded: what every round did before
rewards moved to workers); and the multi-turn echo game's round with its environment in a
worker (``rollout.environment_timeout`` set) against in the trainer's process.

Each pair is two learners of the same spec and seed, differing only in the timeout; their
rounds are interleaved (A, B, B, A, ...) after one warm-up round each, so load from other
processes hits both alike. Printed: the median round and scoring (or generation, for the
environment, whose calls happen while generating) times of each, and their ratio. The
worker's first start (the forkserver importing torch) is in the warm-up round.

    python benchmarks/workers.py [--rounds N] [--threads N] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.round import DEMO, Clock, make_learner, ppokit_round
from ppokit.data import make_prompt_source
from ppokit.spec import load_spec
from ppokit.trainer.prompts import format_prompts

#: The echo game: three turns a response, the environment's answers between them.
ECHO = ["data.options.turns=3", "rollout.environment=echo", "reward=[]"]


def pair(
    overrides: list[str], setting: str, phase: str, rounds: int
) -> tuple[float, float, float, float]:
    """(median round s in a worker, here; median ``phase`` s in a worker, here)."""
    specs = [load_spec(DEMO, [*overrides, f"{setting}={v}"]) for v in ("600", "null")]
    learners = [make_learner(spec) for spec in specs]
    source = make_prompt_source(specs[0].data, specs[0].seed)
    clock = Clock(learners[0][0].device)
    times: list[list[dict[str, float]]] = [[], []]
    n = specs[0].rollout.prompts_per_round
    for i in range(rounds + 1):
        rows = source.next_rows(n)
        formatted = format_prompts(rows, learners[0][0].models.tokenizer, specs[0].data)
        for k in (0, 1) if i % 2 == 0 else (1, 0):
            torch.manual_seed(specs[0].seed + i)
            t = ppokit_round(learners[k], rows, formatted, clock)
            if i > 0:  # round 0 is the warm-up
                times[k].append(t)
    for setup, _ in learners:
        setup.close()
    med = [
        (statistics.median(t["round"] for t in ts), statistics.median(t[phase] for t in ts))
        for ts in times
    ]
    return med[0][0], med[1][0], med[0][1], med[1][1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=9, help="timed rounds of each")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--set", action="append", default=[], help="spec override KEY=VALUE")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    base = [*args.set, "output.progress=false"]
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, the demo spec; median "
        f"of {args.rounds} interleaved rounds after one warm-up round each"
    )
    print(f"{'round of':<34}{'worker ms':>11}{'here ms':>10}{'ratio':>8}")
    for label, overrides, setting, phase in (
        ("the demo (reward)", base, "train.reward_timeout", "score"),
        ("the echo game (environment)", [*base, *ECHO], "rollout.environment_timeout", "generate"),
    ):
        worker, here, worker_phase, here_phase = pair(overrides, setting, phase, args.rounds)
        print(
            f"{label + ': round':<34}{1e3 * worker:>11.1f}{1e3 * here:>10.1f}{worker / here:>8.3f}"
        )
        print(
            f"{label + ': ' + phase:<34}{1e3 * worker_phase:>11.1f}{1e3 * here_phase:>10.1f}"
            f"{worker_phase / here_phase:>8.3f}"
        )


if __name__ == "__main__":
    main()
