"""Benchmark: the same spec on 1 and on N local processes, side by side.

Each setting runs ``ppokit train SPEC --nproc N`` (torch's launcher; one process needs none)
for ``--rounds`` rounds in a fresh run folder, ``--repeats`` times, alternating the settings
so that load from other processes hits them alike. From each run's ``metrics.jsonl``
(rounds after the first, which pays for warm-up) it takes the median time per round, the
round's generated tokens per second of the whole round (every process's responses over the
round's wall time) and the peak memory of process 0 (max RSS on a CPU, the CUDA allocator's
peak on a GPU), and the largest share of the last checkpoint one process wrote (each
process writes its own shards of the weights and optimizer states); the table gives their
medians over the repeats and the ratio to one process. The final reward shows that the
runs learn alike.

    python benchmarks/scaling.py [--nproc 1,2] [--rounds 8] [--repeats 2]
                                 [--spec PATH] [--set KEY=VALUE ...]

Default spec: the packaged demo (tiny model, 16 prompts x 8 responses a round). On a
machine with GPUs add ``--set model.device=cuda`` and ``--nproc 1,<GPUs>``.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def _checkpoint_share_mb(out: Path) -> float:
    """The most bytes (MB) of the checkpoint's weight and optimizer files one process wrote
    (``shard-0000K-...`` is process K-1's)."""
    per_process: dict[str, int] = {}
    for file in (out / "checkpoint").glob("*/shard-*.safetensors"):
        index = re.match(r"shard-(\d+)-", file.name)
        if index:
            per_process[index.group(1)] = per_process.get(index.group(1), 0) + file.stat().st_size
    return max(per_process.values(), default=0) / 1e6


def _run(nproc: int, rounds: int, spec: str | None, sets: list[str], out: Path) -> dict[str, Any]:
    command = [sys.executable, "-m", "ppokit", "train"] + ([spec] if spec else [])
    command += ["--nproc", str(nproc), "--out", str(out), "--overwrite"]
    for item in [f"train.rounds={rounds}", "output.progress=false", *sets]:
        command += ["--set", item]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    spec_text = (out / "spec.yaml").read_text()
    import yaml

    resolved = yaml.safe_load(spec_text)
    batch = resolved["rollout"]["prompts_per_round"] * resolved["rollout"]["n"]
    rows = [r for r in records if r.get("round", 0) > 1 and r.get("time_round")]
    return {
        "time_round": statistics.median(r["time_round"] for r in rows),
        "tokens_per_s": statistics.median(
            r["response_length_mean"] * batch / r["time_round"] for r in rows
        ),
        "peak_memory_gb": max(r.get("peak_memory_gb") or 0.0 for r in records),
        "reward_last": records[-1].get("reward_mean"),
        "checkpoint_mb": _checkpoint_share_mb(out),
        "wall": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", default="1,2", help="comma-separated process counts")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--spec", default=None, help="spec file (default: the demo)")
    parser.add_argument("--set", dest="sets", action="append", default=[])
    args = parser.parse_args()
    counts = [int(x) for x in args.nproc.split(",")]
    root = Path(tempfile.mkdtemp(prefix="ppokit-scaling-"))
    results: dict[int, list[dict[str, Any]]] = {n: [] for n in counts}
    try:
        for repeat in range(args.repeats):
            order = counts if repeat % 2 == 0 else counts[::-1]
            for n in order:
                result = _run(n, args.rounds, args.spec, args.sets, root / f"n{n}-{repeat}")
                results[n].append(result)
                print(
                    f"  repeat {repeat + 1}, {n} process(es): {result['time_round']:.3f} s/round, "
                    f"wall {result['wall']:.1f} s",
                    file=sys.stderr,
                )
    finally:
        shutil.rmtree(root, ignore_errors=True)

    def med(n: int, key: str) -> float:
        return statistics.median(r[key] for r in results[n])

    base = counts[0]
    print(f"spec: {args.spec or 'the demo'}; {args.rounds} rounds x {args.repeats} repeats")
    print(
        f"{'processes':>9}  {'s/round':>8}  {'x':>5}  {'tokens/s':>9}  {'x':>5}  "
        f"{'peak GB/process':>15}  {'checkpoint MB/process':>21}  {'final reward':>12}"
    )
    for n in counts:
        t, tok = med(n, "time_round"), med(n, "tokens_per_s")
        rewards = [r["reward_last"] for r in results[n] if r["reward_last"] is not None]
        print(
            f"{n:>9}  {t:>8.3f}  {med(base, 'time_round') / t:>5.2f}  {tok:>9.0f}  "
            f"{tok / med(base, 'tokens_per_s'):>5.2f}  {med(n, 'peak_memory_gb'):>15.2f}  "
            f"{med(n, 'checkpoint_mb'):>21.1f}  "
            f"{statistics.mean(rewards) if rewards else float('nan'):>12.3f}"
        )


if __name__ == "__main__":
    main()
