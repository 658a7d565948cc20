"""The packaged demo (``ppokit train`` with no spec) over several seeds: the figures that the
demo spec, the README and docs/results.md state about it come from this command.

Each seed is one ``ppokit train`` process, one after the other (the spec's own threads), so
each run is what a user's is. Printed: a Markdown table of the wall time, the reward of round
1, and the mean and the lowest reward of the last 10 rounds per seed; then the criterion the
packaged demo is held to (every seed's last 10 rounds average at least ``MEAN_AT_LEAST`` and
none is below ``EACH_AT_LEAST``). ``--json PATH`` also writes the rows, for
``tests/test_demo_figures.py`` to check the stated figures against.

    python benchmarks/demo.py [--seeds 0-9] [--set KEY=VALUE ...] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

#: What every seed's last 10 rounds must average, and what none of them may fall below.
MEAN_AT_LEAST = 0.97
EACH_AT_LEAST = 0.9
LAST = 10


def seeds(text: str) -> list[int]:
    """``0-9`` or ``0,3,5``."""
    if "-" in text:
        lo, hi = text.split("-")
        return list(range(int(lo), int(hi) + 1))
    return [int(s) for s in text.split(",")]


def run_seed(seed: int, overrides: list[str], root: Path) -> dict[str, Any]:
    """One ``ppokit train`` run of the packaged demo at ``seed``: its figures."""
    out = root / f"seed{seed}"
    args = ["--seed", str(seed), "--set", "output.progress=false", "--out", str(out)]
    for o in overrides:
        args += ["--set", o]
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "ppokit", "train", *args, "--overwrite", "--json"],
        capture_output=True,
        text=True,
    )
    if done.returncode:
        sys.exit(f"seed {seed}: ppokit train failed: {done.stderr.strip().splitlines()[-1:]}")
    wall = time.perf_counter() - start
    rewards = [
        json.loads(line)["reward_mean"]
        for line in (out / "metrics.jsonl").read_text().splitlines()
        if line.strip() and "reward_mean" in json.loads(line)
    ]
    last = rewards[-LAST:]
    return {
        "seed": seed,
        "wall_s": round(wall, 1),
        "reward_first": round(rewards[0], 3),
        "last10_mean": round(sum(last) / len(last), 3),
        "last10_min": round(min(last), 3),
        "rounds": len(rewards),
    }


def holds(rows: list[dict[str, Any]]) -> bool:
    """The criterion the packaged demo is held to, on every seed."""
    return all(r["last10_mean"] >= MEAN_AT_LEAST and r["last10_min"] >= EACH_AT_LEAST for r in rows)


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| seed | wall s | reward, round 1 | mean of last 10 | lowest of last 10 |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['seed']} | {r['wall_s']} | {r['reward_first']:.3f} | {r['last10_mean']:.3f} "
        f"| {r['last10_min']:.3f} |"
        for r in rows
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0-9", type=seeds)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")
    a = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ppokit-demo-") as root:
        rows = []
        for s in a.seeds:
            rows.append(run_seed(s, a.overrides, Path(root)))
            print(rows[-1], flush=True)
    print(table(rows))
    means = [r["last10_mean"] for r in rows]
    print(
        f"over {len(rows)} seeds: mean of the last {LAST} rounds {sum(means) / len(means):.3f}, "
        f"lowest seed {min(means):.3f}, lowest round {min(r['last10_min'] for r in rows):.3f}; "
        f"criterion (every seed >= {MEAN_AT_LEAST}, no round < {EACH_AT_LEAST}): "
        f"{'holds' if holds(rows) else 'FAILS'}"
    )
    if a.json is not None:
        a.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
