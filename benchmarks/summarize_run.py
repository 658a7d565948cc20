"""Summary of a run directory's ``metrics.jsonl``.

Prints the number of rounds, the reward of the first round and the mean of the last five
(named accuracy when every recorded sample reward in ``samples.jsonl`` is 0 or 1), the
median tokens/s, the median seconds per round of each phase, the peak memory when the
metrics record ``peak_memory_gb`` (the trainer records the CUDA allocator's peak of allocated
memory on CUDA runs), and the signs of an unhealthy run that fired (``health/<sign>`` keys,
docs/health.md), if any.

    python benchmarks/summarize_run.py RUN_DIR
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

PHASES = ("time_generate", "time_score", "time_logprob", "time_update", "time_round")
LAST = 5


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def values(history: list[dict[str, Any]], key: str) -> list[float]:
    return [float(h[key]) for h in history if h.get(key) is not None]


def is_binary_reward(samples: list[dict[str, Any]]) -> bool:
    """Whether the run's sampled rewards are all 0 or 1 (the reward mean is an accuracy)."""
    rewards = [s.get("reward") for s in samples]
    return bool(rewards) and all(r in (0, 1, 0.0, 1.0) for r in rewards)


def summarize(run: Path) -> list[str]:
    history = read_jsonl(run / "metrics.jsonl")
    if not history:
        raise SystemExit(f"{run / 'metrics.jsonl'} is missing or empty")
    name = "accuracy" if is_binary_reward(read_jsonl(run / "samples.jsonl")) else "reward"
    lines = [f"run {run}: {len(history)} rounds"]
    rewards = values(history, "reward_mean")
    if rewards:
        tail = rewards[-LAST:]
        lines.append(
            f"{name}: first round {rewards[0]:.4f}, mean of the last {len(tail)} "
            f"{statistics.fmean(tail):.4f}"
        )
    speed = values(history, "tokens_per_s")
    if speed:
        lines.append(f"tokens/s (generation, median): {statistics.median(speed):.1f}")
    phases = [
        f"{key.removeprefix('time_')} {statistics.median(values(history, key)):.3f}"
        for key in PHASES
        if values(history, key)
    ]
    if phases:
        lines.append("seconds per round (median): " + ", ".join(phases))
    peak = values(history, "peak_memory_gb")
    lines.append(
        f"peak memory (max over rounds): {max(peak):.2f} GiB"
        if peak
        else "peak memory: not recorded (the trainer records it on CUDA)"
    )
    fired: dict[str, list[int]] = {}
    for h in history:
        for key, value in h.items():
            if key.startswith("health/") and value == 1:
                fired.setdefault(key.removeprefix("health/"), []).append(int(h["round"]))
    if fired:
        signs = [
            f"{name} from round {r[0]} ({len(r)} round{'s' if len(r) != 1 else ''})"
            for name, r in fired.items()
        ]
        lines.append("health signs that fired (docs/health.md): " + ", ".join(signs))
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="a run's output directory")
    args = parser.parse_args(argv)
    print("\n".join(summarize(args.run_dir)))


if __name__ == "__main__":
    main(sys.argv[1:])
