"""Benchmark of the ``code_tests`` reward: what a sandboxed response costs, side by side
with the same programs run without OS isolation (``unsafe``: resource limits and a process
group only), by ``concurrency``, in one process.

The programs are ``--responses`` small solutions of one function, half right, each with
three assert tests, as a code task's rows are. Each setting scores them ``--repeats`` times;
the median is printed as responses per second, with the sandbox's cost per response over the
unisolated run's.

    flock /tmp/ppokit-heavy.lock python benchmarks/code_tests.py [--responses 32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from ppokit.components.reward.sandbox import UNSAFE_ENV
from ppokit.registry import get_registry

RIGHT = "def add(a, b):\n    return a + b\n"
WRONG = "def add(a, b):\n    return a - b\n"
TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--responses", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    n = args.responses
    programs = [RIGHT if i % 2 else WRONG for i in range(n)]
    os.environ[UNSAFE_ENV] = "1"
    registry = get_registry()
    print(f"{n} responses a call, 3 tests each, median of {args.repeats}")
    print(
        "| concurrency | sandbox (bwrap) responses/s | unisolated responses/s | sandbox s/response extra |"
    )
    print("|---:|---:|---:|---:|")
    for concurrency in (1, 2, 4):
        rates = {}
        for label, isolated in (("sandbox", True), ("unisolated", False)):
            reward = registry.create("reward", "code_tests", concurrency=concurrency, unsafe=True)
            if not isolated:
                reward.isolated = False  # the unsafe path, on a machine that has bwrap
            reward(["p"], programs[:1], tests=[TESTS])  # warm-up: the first call's imports
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                out = reward(["p"] * n, programs, tests=[TESTS] * n)
                times.append(time.perf_counter() - start)
                assert out.scores == [float(i % 2) for i in range(n)], out.scores
            rates[label] = n / statistics.median(times)
        extra = 1 / rates["sandbox"] - 1 / rates["unisolated"]
        print(f"| {concurrency} | {rates['sandbox']:.1f} | {rates['unisolated']:.1f} | "
              f"{extra * 1000:.0f} ms |")  # fmt: skip


if __name__ == "__main__":
    main()
