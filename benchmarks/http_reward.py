"""Benchmark of the ``http`` reward: responses scored per second against ``ppokit
reward-server``'s application on loopback, by chunk size and concurrency, side by side in
one process, with the same reward run in the process as the reference.

Two servers (uvicorn on a thread of this process, as ``ppokit reward-server`` runs them):
``fast`` serves ``exact_match`` (microseconds a response: the cost is the HTTP round
trips and JSON), ``slow`` a stand-in for a model server, a reward that takes ``--latency``
seconds a request plus ``--per-response`` seconds a response (so chunks and requests in
flight both matter). Each setting scores the same ``--responses`` responses ``--repeats``
times; the median is printed, with its ratio to one response per request, one at a time.

    python benchmarks/http_reward.py [--responses 512] [--repeats 3]
                                     [--latency 0.02] [--per-response 0.0005]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

from ppokit.registry import get_registry
from ppokit.serve import ScoreService, bind, build_app

#: (chunk_size, concurrency) settings, the first the reference of the ratios.
SETTINGS = [(1, 1), (1, 8), (16, 1), (64, 1), (64, 4), (512, 1)]


@contextmanager
def served(rewards: list[tuple[str, Any, float]], concurrency: int) -> Iterator[str]:
    service = ScoreService(rewards)
    app = build_app(service, service.health, max_request_mb=64, concurrency=concurrency)
    sock = bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="error", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/score"
    finally:
        server.should_exit = True
        thread.join()


def slow_reward(latency: float, per_response: float) -> Callable[..., list[float]]:
    def reward(prompts: list[str], responses: list[str], **fields: Any) -> list[float]:
        time.sleep(latency + per_response * len(responses))
        return [float(len(r) % 2) for r in responses]

    return reward


def median_seconds(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--responses", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--latency", type=float, default=0.02)
    parser.add_argument("--per-response", type=float, default=0.0005)
    args = parser.parse_args()
    registry = get_registry()
    n = args.responses
    prompts = [f"prompt {i}" for i in range(n)]
    responses = [("a" if i % 3 else "b") * (1 + i % 7) for i in range(n)]
    fields = {"answer": ["a"] * n, "lengths": [8] * n, "truncated": [False] * n}
    local = registry.create("reward", "exact_match")
    slow = slow_reward(args.latency, args.per_response)
    servers = {
        "fast (exact_match)": ([("exact_match", local, 1.0)], local),
        f"slow ({args.latency * 1000:g} ms + {args.per_response * 1000:g} ms/response)": (
            [("slow", slow, 1.0)],
            slow,
        ),
    }
    print(f"{n} responses a call, median of {args.repeats}; server threads: 8")
    for label, (rewards, here) in servers.items():
        in_process = median_seconds(lambda here=here: here(prompts, responses, **fields), 3)
        print(f"\n{label}: in the process {n / in_process:,.0f} responses/s")
        print("| chunk_size | concurrency | requests | responses/s | vs chunk 1, one at a time |")
        print("|---:|---:|---:|---:|---:|")
        with served(rewards, concurrency=8) as url:
            reference = None
            for chunk, concurrency in SETTINGS:
                http = registry.create(
                    "reward", "http", url=url, chunk_size=chunk, concurrency=concurrency
                )
                assert list(http(prompts, responses, **fields)) == list(
                    map(float, here(prompts, responses, **fields))
                )
                seconds = median_seconds(
                    lambda http=http: http(prompts, responses, **fields), args.repeats
                )
                reference = reference or seconds
                requests = -(-n // chunk)
                print(
                    f"| {chunk} | {concurrency} | {requests} | {n / seconds:,.0f} | "
                    f"{reference / seconds:.1f}x |"
                )


if __name__ == "__main__":
    main()
