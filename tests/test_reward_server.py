"""``ppokit reward-server`` as a user runs it: a process serving a reward on a loopback
port it picks, the trainer's scorer with an ``http`` reward scored by it (the same scores
as the reward run in the trainer, on the same responses), and SIGTERM while a request is in flight:
the request is answered, the process exits 0 and the port is free again."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from ppokit.trainer.assembly import Assembly
from ppokit.trainer.scoring import Scorer
from tests.helpers.trainer import small_spec

ROOT = Path(__file__).resolve().parents[1]

#: The served reward: 1 when the response has a letter a-m (as the regex reward
#: '[a-m]'); a request whose first prompt is "slow" is held a while (in flight at SIGTERM).
SERVED = """
import re
import time

def reward(prompts, responses):
    if prompts and prompts[0] == "slow":
        time.sleep(1.5)
    return [float(re.search("[a-m]", r) is not None) for r in responses]
"""


def _start(*args: str) -> tuple[subprocess.Popen[str], str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "ppokit.cli", "reward-server", *args, "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if "http://" not in line:
        proc.kill()
        raise AssertionError(f"no address: {line!r} {proc.stderr.read() if proc.stderr else ''}")
    url = line.split(" on ")[1].split()[0]
    deadline = time.monotonic() + 60
    while True:  # serving (its signal handlers in place) once /health answers
        try:
            httpx.get(f"{url}/health", timeout=5).raise_for_status()
            return proc, url
        except httpx.HTTPError:
            if time.monotonic() > deadline:
                proc.kill()
                raise
            time.sleep(0.05)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[subprocess.Popen, str]]:
    code = tmp_path_factory.mktemp("served") / "served.py"
    code.write_text(SERVED)
    proc, url = _start("python", "-p", f"function={code}:reward")
    yield proc, url
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=30)


def test_the_scorers_http_reward_matches_the_reward_run_here(server) -> None:
    url = server[1]
    health = httpx.get(f"{url}/health", timeout=10).json()
    assert health == {"status": "ok", "rewards": ["python"], "weights": {"python": 1.0}}
    # the reward in the trainer and over http, side by side on the same responses
    remote = f"{{name: http, url: '{url}/score', chunk_size: 3, weight: 0}}"
    spec = small_spec(None, f"reward=[{{name: regex, pattern: '[a-m]'}}, {remote}]")
    scorer = Scorer(Assembly.from_spec(spec), None, torch.device("cpu"))
    rng = random.Random(0)
    responses = ["".join(rng.choice("abnopxyz ") for _ in range(3)) for _ in range(16)]
    rows = [{"prompt": "p", "answer": "a"}] * 16
    got = scorer.score(rows, responses, [3] * 16, [False] * 16)
    assert torch.equal(got.parts["http"], got.parts["regex"])
    assert 0 < float(got.parts["regex"].mean()) < 1  # the responses differ: it can fail


def test_a_request_body_too_large_is_refused(server) -> None:
    big = json.dumps({"prompts": ["p" * (17 << 20)], "responses": ["r"]})
    answer = httpx.post(f"{server[1]}/score", content=big, timeout=30)
    assert answer.status_code == 413 and "larger than 16 MiB" in answer.json()["error"]


def test_sigterm_answers_the_request_in_flight_then_exits_0(server) -> None:
    """The last test of the module: it stops the module's server."""
    proc, url = server
    port = int(url.rsplit(":", 1)[1])
    got: dict[str, object] = {}

    def ask() -> None:
        body = {"prompts": ["slow"], "responses": ["b!"]}
        got["answer"] = httpx.post(f"{url}/score", json=body, timeout=30).json()

    before = _connections(proc, port)
    asking = threading.Thread(target=ask)
    asking.start()
    while not _connections(proc, port) - before:  # its connection is made
        pass
    proc.send_signal(signal.SIGTERM)
    asking.join(30)
    out, err = proc.communicate(timeout=30)
    assert got["answer"] == {"scores": [1.0], "parts": {"python": [1.0]}, "flags": {}}
    assert proc.returncode == 0, err
    assert "stopped" in out and "Traceback" not in err
    with socket.socket() as s:  # the port is free again (its closed connection aside)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))


def _connections(proc: subprocess.Popen[str], port: int) -> set[str]:
    """The established connections to the server's ``port`` (their remote ends), from
    /proc/net/tcp."""
    assert proc.poll() is None
    table = Path("/proc/net/tcp").read_text().splitlines()[1:]
    local = f":{port:04X}"
    return {r.split()[2] for r in table if r.split()[1].endswith(local) and r.split()[3] == "01"}
