"""``ppokit reward-server`` as a user runs it: a process serving a reward on a loopback
port it picks, the trainer's scorer with an ``http`` reward scored by it (the same scores
as the reward run in the trainer, on the same responses), and SIGTERM while a request is in flight:
the request is answered, the process exits 0 and the port is free again.

And as hostile clients meet it: connections that send part of a request (or trickle it)
and then nothing, beyond every limit, while a well-behaved client is still answered and
they are closed at the read timeout; bodies held at once bounded in bytes; bodies parsed
only in their turn; malformed bodies (nested beyond reading, fields named as a reward's
own arguments, no JSON) each a 400 one-liner and one line of the log, never a traceback;
the key a server beyond loopback needs; and a stop that answers what is in flight, or
with a one-line 503."""

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient
from typer.testing import CliRunner

from ppokit.cli import app as cli
from ppokit.serve import MAX_DEPTH, REFUSED_FIELDS, ScoreService, build_app
from ppokit.spec import validate_spec
from ppokit.trainer.assembly import Assembly, rewards_of
from ppokit.trainer.scoring import Scorer
from tests.helpers.components import make
from tests.helpers.servers import run_app
from tests.helpers.trainer import small_spec

ROOT = Path(__file__).resolve().parents[1]

#: The served reward: 1 when the response has a letter a-m (as the regex reward
#: '[a-m]'); a request whose first prompt is "slow SECONDS [FILE]" is held that long (in
#: flight at a signal), FILE made once its call has begun.
SERVED = """
import re
import time
from pathlib import Path

def reward(prompts, responses):
    if prompts and prompts[0].startswith("slow "):
        _, seconds, *begun = prompts[0].split(" ")
        for path in begun:
            Path(path).touch()
        time.sleep(float(seconds))
    return [float(re.search("[a-m]", r) is not None) for r in responses]
"""

KEY_VAR = "PPOKIT_TEST_SERVER_KEY"
KEY = "k3y-for-the-tests"


@dataclass
class Served:
    """A reward server in a process of its own: its URL, and its log (stderr) as it comes."""

    proc: subprocess.Popen[str]
    url: str
    log: list[str] = field(default_factory=list)
    reader: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def lines_after(self, start: int, count: int, timeout: float = 10.0) -> list[str]:
        """The log's lines from ``start`` once there are ``count`` of them (or the timeout)."""
        deadline = time.monotonic() + timeout
        while len(self.log) - start < count and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.log[start:]

    def stop(self, *signals: signal.Signals, timeout: float = 30) -> tuple[str, str]:
        """Send ``signals`` (0.2 s apart), then its stdout's rest and its whole log."""
        for i, sig in enumerate(signals or (signal.SIGTERM,)):
            if i:
                time.sleep(0.2)
            self.proc.send_signal(sig)
        out = self.proc.stdout.read() if self.proc.stdout else ""
        self.proc.wait(timeout)
        if self.reader is not None:
            self.reader.join(timeout)
        return out, "".join(self.log)


def _start(*args: str, env: dict[str, str] | None = None) -> Served:
    environ = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    proc = subprocess.Popen(
        [sys.executable, "-m", "ppokit.cli", "reward-server", *args, "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=environ,
    )
    assert proc.stdout is not None and proc.stderr is not None
    line = proc.stdout.readline()
    if "http://" not in line:
        proc.kill()
        raise AssertionError(f"no address: {line!r} {proc.stderr.read()}")
    served = Served(proc, line.split(" on ")[1].split()[0])
    stderr = proc.stderr

    def read() -> None:  # the log, as it comes (a pipe nobody reads would stall the server)
        for text in stderr:
            served.log.append(text)

    served.reader = threading.Thread(target=read, daemon=True)
    served.reader.start()
    deadline = time.monotonic() + 60
    headers = {"authorization": f"Bearer {KEY}"}
    while True:  # serving (its signal handlers in place) once /health answers
        try:
            httpx.get(f"{served.url}/health", headers=headers, timeout=5).raise_for_status()
            return served
        except httpx.HTTPError:
            if time.monotonic() > deadline:
                proc.kill()
                raise
            time.sleep(0.05)


def _python_reward(tmp: Path) -> list[str]:
    code = tmp / "served.py"
    code.write_text(SERVED)
    return ["python", "-p", f"function={code}:reward"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    served = _start(*_python_reward(tmp_path_factory.mktemp("served")))
    yield served
    if served.proc.poll() is None:
        served.stop()


#: Limits small enough for a test to pass each: one request scored and one waiting, 12
#: connections, 1 s to send a request, 1 MiB of bodies held, 1.5 s a reward call.
TIGHT = [
    "--concurrency", "1", "--max-pending", "1", "--max-connections", "12",
    "--read-timeout", "1", "--max-request-mb", "1", "--max-inflight-mb", "1",
    "--set", "train.reward_timeout=1.5",
]  # fmt: skip


@pytest.fixture(scope="module")
def tight(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    served = _start(*_python_reward(tmp_path_factory.mktemp("served")), *TIGHT)
    yield served
    if served.proc.poll() is None:
        served.stop()


def _one_line_error(answer: httpx.Response, status: int) -> str:
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert isinstance(error, str) and "\n" not in error and 0 < len(error) <= 400
    return error


# ---------------------------------------------------------------------- serving
def test_the_scorers_http_reward_matches_the_reward_run_here(server) -> None:
    url = server.url
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
    answer = httpx.post(f"{server.url}/score", content=big, timeout=30)
    assert answer.status_code == 413 and "larger than 16 MiB" in answer.json()["error"]


# ---------------------------------------------------------------------- bad requests
def _nested(depth: int, opening: bytes = b"[", closing: bytes = b"]") -> bytes:
    return opening * depth + closing * depth


#: Bodies that break the protocol, each a 400: (body, what its error says).
BAD = [
    (_nested(100_000), "deeper than JSON can be read"),
    (b'{"a":' * 50_000 + b"1" + b"}" * 50_000, "deeper than JSON can be read"),
    (
        b'{"prompts": ["p"], "responses": ["a"], "fields": {"x": [' + _nested(500) + b"]}}",
        f"more than {MAX_DEPTH} levels",
    ),
    *[
        (json.dumps({"prompts": ["p"], "responses": ["a"], "fields": {n: [1]}}).encode(), n)
        for n in ("self", "prompts", "responses", "completions")
    ],
    (b"\xff\xfe{}", "no JSON"),
    (b'{"prompts": [' + b"1" * 5000 + b"]}", "no JSON"),
    (b'{"prompts": ["p"], "responses": ["a"], "fields": {"\\ud800\\n": 3}}', "ud800"),
    (b"", "no JSON"),
    (b'{"prompts": "p", "responses": "a"}', "'prompts' must be a list of strings"),
]


def _posted_from(url: str, body: bytes) -> tuple[str, httpx.Response]:
    """``body`` posted to ``url``/score on a connection of its own: the client's address as
    the server's log names it, and the answer."""
    with socket.create_connection(httpx.URL(url).netloc.decode().rsplit(":", 1)) as sock:
        host, port = sock.getsockname()[:2]
        head = f"POST /score HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
        sock.sendall(f"{head}Connection: close\r\n\r\n".encode() + body)
        raw = b"".join(iter(lambda: sock.recv(65536), b""))
    status_line, _, rest = raw.partition(b"\r\n")
    _, _, content = rest.partition(b"\r\n\r\n")
    answer = httpx.Response(int(status_line.split()[1]), content=content)
    return f"{host}:{port}", answer


def test_bad_requests_are_400_one_liners_and_one_log_line_each(server) -> None:
    """Each bad request is a one-line 400 and exactly one line of the log (told apart from
    other tests' lines, which may reach the log later, by the client's address)."""
    start, clients = len(server.log), []
    for body, says in BAD:
        client, answer = _posted_from(server.url, body)
        assert says in _one_line_error(answer, 400)
        if says in REFUSED_FIELDS:  # names what a field may not be called
            assert ", ".join(REFUSED_FIELDS) in answer.json()["error"]
        clients.append(client)

    def ours() -> list[str]:
        return [line for line in server.log[start:] if any(f" {c} " in line for c in clients)]

    deadline = time.monotonic() + 10
    while len(ours()) < len(BAD) and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.3)  # a second line of any request would come now
    lines = ours()
    assert len(lines) == len(BAD), lines
    for client in clients:
        (line,) = [line for line in lines if f" {client} " in line]
        assert f" {client} POST /score 400 " in line, line
    assert "Traceback" not in "".join(server.log)


JSONS = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=12,
)
NAMES = st.sampled_from([*REFUSED_FIELDS, "answer", "lengths", ""]) | st.text(max_size=6)


@st.composite
def bodies(draw: st.DrawFn) -> dict[str, Any]:
    """A /score body: prompts, responses and fields of one length (fields of any names and
    values, an answer for exact_match mostly among them), at times one key spoiled."""
    responses = draw(st.lists(st.text(max_size=5), min_size=1, max_size=3))
    n = len(responses)
    fields = draw(st.dictionaries(NAMES, st.lists(JSONS, min_size=n, max_size=n), max_size=3))
    if draw(st.booleans()):
        fields["answer"] = draw(st.lists(st.text(max_size=3), min_size=n, max_size=n))
    body: dict[str, Any] = {"prompts": ["p"] * n, "responses": responses, "fields": fields}
    spoiled = draw(st.sampled_from([None, None, "prompts", "responses", "fields"]))
    if spoiled is not None:
        body[spoiled] = draw(JSONS)
    return body


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bodies())
def test_any_json_body_is_scored_or_a_one_line_400_or_422(exact, body) -> None:
    """Whatever JSON a client sends, the answer is the scores, a 400 (the protocol) or a
    422 (the reward's error), in one line: never a 500."""
    answer = exact[1].post("/score", content=json.dumps(body))
    if answer.status_code != 200:
        _one_line_error(answer, 400 if answer.status_code == 400 else 422)


@pytest.fixture(scope="module")
def exact() -> tuple[ScoreService, TestClient]:
    """The exact_match reward's service, and a client of its application in this process."""
    service = ScoreService(rewards_of(validate_spec({"reward": "exact_match"})))
    return service, TestClient(build_app(service, service.health))


def test_a_body_is_parsed_only_in_its_turn(exact) -> None:
    """With one request scored at a time, a second one's body (no JSON here) waits, unread,
    for the first to end: what waits holds its bytes, not their parsed objects."""
    release, holding = threading.Event(), threading.Event()

    def held(data: Any) -> dict[str, Any]:
        holding.set()
        release.wait(30)
        return exact[0](data)

    app = build_app(held, exact[0].health, concurrency=1, max_pending=4)
    good = {"prompts": ["p"], "responses": ["a"], "fields": {"answer": ["a"]}}
    got: dict[str, httpx.Response] = {}
    with run_app(app) as running:

        def ask(name: str, content: bytes) -> None:
            got[name] = httpx.post(f"{running.url}/score", content=content, timeout=30)

        first = threading.Thread(target=ask, args=("first", json.dumps(good).encode()))
        first.start()
        assert holding.wait(30)  # the first holds the one turn
        second = threading.Thread(target=ask, args=("second", b"{no json"))
        second.start()
        second.join(0.5)
        assert "second" not in got  # not parsed (and refused) while the first is scored
        release.set()
        first.join(30)
        second.join(30)
    assert got["first"].json()["scores"] == [1.0]
    assert "no JSON" in _one_line_error(got["second"], 400)


# ---------------------------------------------------------------------- slow clients
def _half_open(port: int, kind: str) -> socket.socket:
    """A connection that sends part of a request and then nothing (``head``: a head whose
    body never comes; ``partial``: part of a head) or trickles it (``trickle``: a header
    byte now and then; ``drip``: a body byte now and then: :func:`_trickle`)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=20)
    heads = {
        "head": b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n",
        "partial": b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Le",
        "trickle": b"POST /score HTTP/1.1\r\nHost: x\r\nX-Slow: ",
        "drip": b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Length: 9000\r\n\r\n{",
    }
    sock.sendall(heads[kind])
    return sock


def _trickle(socks: list[socket.socket], stop: threading.Event) -> None:
    while not stop.wait(0.1):
        for sock in list(socks):
            try:
                sock.send(b"a")
            except OSError:  # closed by the server
                socks.remove(sock)


def _closed_by_server(sock: socket.socket) -> bytes:
    """What the server sent before closing the connection (socket.timeout if it never does)."""
    got = b""
    try:
        while chunk := sock.recv(4096):
            got += chunk
    except ConnectionResetError:  # closed while a trickle was sending
        pass
    return got


def _good(url: str) -> httpx.Response:
    body = {"prompts": ["p", "p"], "responses": ["a", "x"]}
    return httpx.post(f"{url}/score", json=body, timeout=20)


def test_half_open_connections_hold_no_slot_and_are_closed_at_the_read_timeout(tight) -> None:
    """Beyond the requests the server takes (1 scored, 1 waiting) and then beyond its 12
    connections, connections that sent part of a request leave a good client answered, and
    each is closed within the read timeout (1 s): the oldest first when one more comes."""
    start = len(tight.log)
    stop = threading.Event()
    kinds = ["head", "partial", "trickle", "drip"] * 5
    socks = [_half_open(tight.port, kind) for kind in kinds[:10]]  # beyond 2 requests
    trickling = [s for s, k in zip(socks, kinds, strict=False) if k in ("trickle", "drip")]
    trickler = threading.Thread(target=_trickle, args=(trickling, stop), daemon=True)
    trickler.start()
    try:
        assert _good(tight.url).json()["scores"] == [1.0, 0.0]
        more = [_half_open(tight.port, kind) for kind in kinds[10:]]  # beyond 12 connections
        trickling += [s for s, k in zip(more, kinds[10:], strict=True) if k in ("trickle", "drip")]
        socks += more
        assert _good(tight.url).json()["scores"] == [1.0, 0.0]
        for sock in socks:  # each closed by the server, some with a one-line 408 or 503
            said = _closed_by_server(sock)
            if said:
                status = int(said.split(b" ", 2)[1])
                error = json.loads(said.split(b"\r\n\r\n", 1)[1])["error"]
                assert status in (408, 503) and "\n" not in error, said
    finally:
        stop.set()
        addresses = ["{}:{}".format(*sock.getsockname()[:2]) for sock in socks]
        for sock in socks:
            sock.close()

    def closing() -> list[str]:  # told apart from other tests' lines by the client's address
        return [
            line
            for line in tight.log[start:]
            if any(f" {a} " in line for a in addresses) and (" 408 " in line or " 503 " in line)
        ]

    deadline = time.monotonic() + 10
    while len(closing()) < len(socks) and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.3)  # a second line of any connection would come now
    assert len(closing()) == len(socks), tight.log[start:]  # one line each
    assert "Traceback" not in "".join(tight.log)


def test_bodies_held_at_once_are_bounded_in_bytes(tight) -> None:
    """Of two bodies of 700000 bytes promised at once, with 1 MiB held at most, one is
    refused at once, unread (503), the other waited for (then 408: it never comes); a
    small one still fits."""
    head = b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Length: 700000\r\n\r\n{"
    socks = [socket.create_connection(("127.0.0.1", tight.port), timeout=20) for _ in "ab"]
    try:
        for sock in socks:
            sock.sendall(head)
        answers = sorted(_closed_by_server(sock) for sock in socks)
        assert [a.split(b" ", 2)[1] for a in answers] == [b"408", b"503"], answers
        assert b"--max-inflight-mb" in answers[1]
        assert _good(tight.url).json()["scores"] == [1.0, 0.0]
    finally:
        for sock in socks:
            sock.close()


def test_a_reward_that_times_out_is_a_422_that_speaks_of_the_server(tight) -> None:
    body = {"prompts": ["slow 5"], "responses": ["a"]}
    answer = httpx.post(f"{tight.url}/score", json=body, timeout=30)
    error = _one_line_error(answer, 422)
    assert "train.reward_timeout (1.5 s)" in error and "the run" not in error


# ---------------------------------------------------------------------- the key
def test_beyond_loopback_without_a_key_and_limits_that_do_not_fit_are_one_line(
    monkeypatch,
) -> None:
    monkeypatch.delenv(KEY_VAR, raising=False)

    def served(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("it served")

    monkeypatch.setattr("ppokit.serve.serve", served)
    for args, says in [
        (["--host", "0.0.0.0"], ["--api-key-env VAR", "--allow-no-key"]),
        (["--host", "::"], ["--api-key-env VAR", "--allow-no-key"]),
        (["--api-key-env", KEY_VAR], [KEY_VAR, "not set"]),
        (["--max-connections", "10", "--max-pending", "8"], ["must exceed"]),
        (["--max-inflight-mb", "8"], ["--max-request-mb (16)"]),
    ]:
        result = CliRunner().invoke(cli, ["reward-server", "exact_match", *args])
        assert result.exit_code == 1 and result.stdout == "", result.output
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert all(s in result.stderr for s in says), result.stderr


# ---------------------------------------------------------------------- stopping
def _in_flight(served: Served, tmp: Path, seconds: float) -> tuple[threading.Thread, dict]:
    """A request held ``seconds`` by the reward, once its call has begun."""
    begun = tmp / "begun"
    got: dict[str, Any] = {}

    def ask() -> None:
        body = {"prompts": [f"slow {seconds} {begun}"], "responses": ["b!"]}
        headers = {"authorization": f"Bearer {KEY}"}
        got["answer"] = httpx.post(f"{served.url}/score", json=body, headers=headers, timeout=60)

    asking = threading.Thread(target=ask)
    asking.start()
    deadline = time.monotonic() + 60
    while not begun.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    return asking, got


def _stopped_with_a_503(served: Served, tmp: Path, *signals: signal.Signals) -> str:
    """The server stopped by ``signals`` while a request it cannot wait for is in flight:
    that request answered with a one-line 503, the process ended with status 0; its log."""
    asking, got = _in_flight(served, tmp, 2.0)
    out, err = served.stop(*signals)
    asking.join(30)
    assert "stopping" in _one_line_error(got["answer"], 503)
    assert served.proc.returncode == 0 and "stopped" in out, err
    assert "Traceback" not in err and " 503 the reward server is stopping" in err
    return err


def test_the_key_is_required_for_scores_and_sent_by_the_http_reward(tmp_path: Path) -> None:
    """And a request still scored when the stop's time (0.5 s here) is up: a 503."""
    options = ["--api-key-env", KEY_VAR, "--shutdown-timeout", "0.5"]
    served = _start(*_python_reward(tmp_path), *options, env={KEY_VAR: KEY})
    url = served.url
    body = {"prompts": ["p"], "responses": ["a"]}
    for headers in ({}, {"authorization": "Bearer nope"}, {"authorization": KEY}):
        answer = httpx.post(f"{url}/score", json=body, headers=headers, timeout=10)
        assert "needs its key" in _one_line_error(answer, 401)
    keyed = {"authorization": f"bearer {KEY}"}
    answer = httpx.post(f"{url}/score", json=body, headers=keyed, timeout=10)
    assert answer.json()["scores"] == [1.0]
    assert httpx.get(f"{url}/health", timeout=10).json() == {"status": "ok"}
    health = httpx.get(f"{url}/health", headers=keyed, timeout=10).json()
    assert health["rewards"] == ["python"]
    os.environ[KEY_VAR] = KEY
    try:
        reward = make("reward", "http", url=f"{url}/score", api_key_env=KEY_VAR, retries=0)
    finally:
        del os.environ[KEY_VAR]
    assert reward(["p", "p"], ["a", "x"]) == [1.0, 0.0]
    err = _stopped_with_a_503(served, tmp_path, signal.SIGTERM)
    assert KEY not in err


def test_beyond_loopback_told_that_no_key_is_meant_it_warns_and_ctrl_c_twice_stops_at_once(
    tmp_path: Path,
) -> None:
    served = _start(*_python_reward(tmp_path), "--host", "0.0.0.0", "--allow-no-key")
    err = _stopped_with_a_503(served, tmp_path, signal.SIGINT, signal.SIGINT)
    assert "warning: listening on 0.0.0.0 without a key" in err


def test_sigterm_answers_the_request_in_flight_then_exits_0(tmp_path: Path) -> None:
    served = _start(*_python_reward(tmp_path))
    asking, got = _in_flight(served, tmp_path, 1.5)
    out, err = served.stop(signal.SIGTERM)
    asking.join(30)
    assert got["answer"].json() == {"scores": [1.0], "parts": {"python": [1.0]}, "flags": {}}
    assert served.proc.returncode == 0, err
    assert "stopped" in out and "Traceback" not in err
    with socket.socket() as s:  # the port is free again (its closed connection aside)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", served.port))
