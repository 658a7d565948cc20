"""The rewards that call servers against hostile servers on loopback (threads with raw
sockets, each stopping by itself): ``timeout`` bounds a try's whole exchange (a server that
trickles its status line, its headers or its body one byte at a time is stopped at the
timeout, not when it likes), and every way a request can fail (a redirect, an answer that is
no HTTP, no JSON, JSON nested too deep, a score that is no finite number, ...) is one line
naming what happened, which ``on_error: zero`` turns into scores of 0 flagged ``failed``;
also the connections kept between requests."""

from __future__ import annotations

import datetime
import re
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from ppokit.components.reward.remote import RemoteError
from ppokit.errors import UserError
from ppokit.trainer.assembly import Checked, Where, scored
from tests.helpers import free_port
from tests.helpers.components import make
from tests.helpers.servers import silent_socket

#: Seconds between two bytes of a trickle, and how long a whole trickle would last.
EVERY, TRICKLE = 0.2, 30.0
#: What a one-second timeout may take at most: the timeout, a try's setup, a loaded machine
#: (before, a trickling server held the request for as long as it trickled, 30 s here).
BOUND = 5.0

#: Names of exceptions and internal classes, which no user's line holds.
INTERNAL = re.compile(
    r"\b_[A-Za-z]\w*|Traceback"
    r"|\b(?:[A-Z][a-z]+)+(?:Error|Exception|Timeout|Disconnected|Read|Line|Headers)\b"
)

Answer = Callable[[socket.socket, threading.Event], bool | None]


def _request(conn: socket.socket, heads: list[bytes]) -> bool:
    """Read one HTTP request (its head, kept in ``heads``, and its Content-Length body);
    False at a closed connection."""
    data = b""
    while b"\r\n\r\n" not in data:
        got = conn.recv(65536)
        if not got:
            return False
        data += got
    head, _, body = data.partition(b"\r\n\r\n")
    heads.append(head)
    length = re.search(rb"(?i)content-length:\s*(\d+)", head)
    need = int(length.group(1)) if length else 0
    while len(body) < need:
        got = conn.recv(65536)
        if not got:
            return False
        body += got
    return True


@contextmanager
def hostile(
    answer: Answer, life: float = TRICKLE + 5, tls: ssl.SSLContext | None = None
) -> Iterator[tuple[str, list[list[bytes]]]]:
    """A server on 127.0.0.1 (over TLS with ``tls``) that reads each request of a
    connection and calls ``answer(conn, stop)`` (True: read the connection's next request).
    It stops by itself: after ``life`` seconds, and when the block ends (``stop`` is set,
    which every wait of an answer watches). Yields its URL and its connections, each the
    list of its requests' heads."""
    stop = threading.Event()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    listener.settimeout(0.05)
    connections: list[list[bytes]] = []

    def handle(conn: socket.socket, heads: list[bytes]) -> None:
        with conn:
            conn.settimeout(life)
            try:
                if tls is not None:
                    conn = tls.wrap_socket(conn, server_side=True)
                while not stop.is_set() and _request(conn, heads) and answer(conn, stop):
                    pass
            except OSError:
                pass  # the client went away

    def serve() -> None:
        end = time.monotonic() + life
        while not stop.is_set() and time.monotonic() < end:
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            connections.append([])
            threading.Thread(target=handle, args=(conn, connections[-1]), daemon=True).start()
        stop.set()  # its answers end too

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        scheme = "https" if tls else "http"
        yield f"{scheme}://127.0.0.1:{listener.getsockname()[1]}/score", connections
    finally:
        stop.set()
        thread.join(5)
        listener.close()


def sends(raw: bytes, *, close: bool = True) -> Answer:
    """An answer that sends ``raw`` at once (and then closes the connection, or keeps it)."""

    def answer(conn: socket.socket, stop: threading.Event) -> bool:
        conn.sendall(raw)
        return not close

    return answer


def trickles(fast: bytes, slow: bytes) -> Answer:
    """An answer that sends ``fast`` at once, then ``slow`` one byte each :data:`EVERY` s."""

    def answer(conn: socket.socket, stop: threading.Event) -> bool:
        conn.sendall(fast)
        for i in range(len(slow)):
            if stop.wait(EVERY):
                break
            conn.sendall(slow[i : i + 1])
        return False

    return answer


def http(status: str, body: bytes, *headers: str) -> bytes:
    head = "".join(f"{h}\r\n" for h in (*headers, f"Content-Length: {len(body)}"))
    return f"HTTP/1.1 {status}\r\n{head}\r\n".encode() + body


def ok(body: bytes | str) -> bytes:
    return http("200 OK", body.encode() if isinstance(body, str) else body)


N = int(TRICKLE / EVERY)
PADDED = [f"X-Pad-{i}: {'a' * 40}" for i in range(N // 40 + 1)]
#: A whole answer of one score whose status line and headers last TRICKLE s at one byte
#: each EVERY s, and one whose body does.
SLOW_HEAD = http("200 OK", b'{"scores": [1.0]}', *PADDED)
SLOW_BODY = (b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (N + 20), b" " * (N + 20))


def _lines_are_plain(text: str) -> None:
    assert "\n" not in text and not INTERNAL.search(text), text


def _reward(kind: str, url: str, **params: Any) -> Any:
    params = {"retries": 0, "backoff": 0.0, "timeout": 1.0, **params}
    if kind == "judge":
        return make("reward", "judge", url=url.removesuffix("/score"), model="m", **params)
    return make("reward", "http", url=url, **params)


def _fails(kind: str, answer: Answer, cause: str, **params: Any) -> None:
    """``on_error: stop``: one plain line naming ``cause``; ``zero``: through the trainer's
    boundary, scores 0 flagged failed; each within :data:`BOUND` s."""
    with hostile(answer) as (url, _):
        start = time.monotonic()
        with pytest.raises(RemoteError) as info:
            _reward(kind, url, **params)(["p"], ["a"], answer=["a"])
        assert time.monotonic() - start < BOUND
        _lines_are_plain(str(info.value))
        base = url if kind == "http" else url.removesuffix("/score")
        assert cause in str(info.value) and f"the {kind} reward: {base}" in str(info.value)
        reward = _reward(kind, url, on_error="zero", **params)
        wrapped = Checked("reward", Where("reward", kind, "ppokit"), reward)
        start = time.monotonic()
        got, flags = scored(wrapped, "reward", ["p", "p"], ["a", "b"], {"answer": ["a", "a"]})
        assert time.monotonic() - start < BOUND
    assert torch.equal(got, torch.zeros(2)) and torch.equal(flags["failed"], torch.ones(2))


# ---------------------------------------------------------------------- the deadline
@pytest.mark.parametrize("kind", ["http", "judge"])
@pytest.mark.parametrize(
    "answer", [trickles(b"", SLOW_HEAD), trickles(*SLOW_BODY)], ids=["head", "body"]
)
def test_a_trickling_server_is_stopped_at_the_timeout(kind: str, answer: Answer) -> None:
    """One byte of the status line and headers (or of the body) each 0.2 s for 30 s: with
    ``timeout: 1`` the request fails after about 1 s (before: after the 30 s)."""
    _fails(kind, answer, "no complete answer within 1 s")


def test_each_try_has_its_own_timeout() -> None:
    with hostile(trickles(b"", SLOW_HEAD)) as (url, connections):
        start = time.monotonic()
        with pytest.raises(RemoteError) as info:
            _reward("http", url, retries=1)(["p"], ["a"])
        assert 2.0 <= time.monotonic() - start < 2 * BOUND
    assert str(info.value).endswith("no complete answer within 1 s (after 2 tries)")
    assert len(connections) == 2


def test_informational_answers_without_end_are_stopped_at_the_timeout() -> None:
    def forever(conn: socket.socket, stop: threading.Event) -> bool:
        while not stop.wait(0.01):
            conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
        return False

    _fails("http", forever, "no complete answer within 1 s")


# ---------------------------------------------------------------------- every failure
DEEP = b'{"scores": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
FAILURES = {
    "400 digits": (ok('{"scores": [1' + "0" * 399 + "]}"), "item 0 is an integer of 400 digits"),
    "NaN": (ok('{"scores": [NaN]}'), "item 0 is nan, not a finite number"),
    "Infinity": (ok('{"scores": [-Infinity]}'), "item 0 is -inf, not a finite number"),
    "1e999": (ok('{"scores": [1e999]}'), "item 0 is inf, not a finite number"),
    "text": (ok('{"scores": ["1"]}'), "item 0 is the text '1', not a number"),
    "bool": (ok('{"scores": [true]}'), "item 0 is true, not a number"),
    "null": (ok('{"scores": [null]}'), "item 0 is null, not a number"),
    "length": (ok('{"scores": [1, 2, 3]}'), "expected 1 numbers, got 3 values"),
    "no scores": (ok('{"score": 1}'), "its 'scores': expected 1 numbers, got null"),
    "array": (ok("[1]"), "answered JSON that is no object"),
    "deep": (ok(DEEP), "answered JSON nested too deep"),
    "no JSON": (ok("<html>"), "answered no JSON"),
    "not UTF-8": (ok(b'{"scores": [1], "x": "\xff\xfe"}'), "answered no JSON"),
    "huge int": (ok('{"scores": [' + "9" * 5000 + "]}"), "answered no JSON"),
    "redirect": (
        http("302 Found", b"", "Location: http://elsewhere.example/x"),
        "redirected to http://elsewhere.example/x, not followed",
    ),
    "500": (
        http("500 Internal Server Error", b"it broke\ntraceback\n"),
        "answered HTTP 500 Internal Server Error: it broke",
    ),
    "418": (http("418 Teapot", b""), "answered HTTP 418 Teapot"),
    "too large": (ok(b" " * 3000), "answered more than 0.001 MiB"),
    "too large, chunked": (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        + b"100\r\n%s\r\n" % (b" " * 256) * 8,
        "answered more than 0.001 MiB",
    ),
    "closed": (b"", "closed the connection without an answer"),
    "cut short": (
        b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{",
        "closed the connection after 1 of the answer's 100 bytes",
    ),
    "no HTTP": (b"SSH-2.0-OpenSSH\r\n\r\n", "answered no valid HTTP"),
    "bad chunk": (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        "closed the connection or broke off after 0 bytes",
    ),
    "long header": (b"HTTP/1.1 200 OK\r\nX: " + b"a" * 70_000, "answered no valid HTTP"),
    "many headers": (http("200 OK", b"{}", *["X: y"] * 200), "answered no valid HTTP"),
}


@pytest.mark.parametrize("raw", list(FAILURES.values()), ids=list(FAILURES))
def test_every_failure_is_one_line_or_scores_zero_in_the_http_reward(raw) -> None:
    """Each stops the run with one line naming what happened (``on_error: stop``), or
    scores 0 flagged (``on_error: zero``, through the trainer's boundary): no other
    exception (an OverflowError, a RecursionError, ...) escapes the reward."""
    answer, cause = raw
    _fails("http", sends(answer), cause, max_response_mb=0.001 if "MiB" in cause else 16)


@pytest.mark.parametrize(
    "name", ["deep", "redirect", "500", "closed", "no HTTP", "cut short", "huge int"]
)
def test_every_failure_is_one_line_or_scores_zero_in_the_judge_reward(name: str) -> None:
    answer, cause = FAILURES[name]
    _fails("judge", sends(answer), cause)


def test_no_server_is_one_plain_line() -> None:
    url = f"http://127.0.0.1:{free_port()}/score"
    with pytest.raises(RemoteError) as info:
        _reward("http", url)(["p"], ["a"])
    _lines_are_plain(str(info.value))
    assert str(info.value) == f"the http reward: {url}: cannot connect (connection refused)"


def test_the_lines_carry_no_control_characters_from_the_server() -> None:
    raw = http("500 \x1b[31mred", b"\x1b]0;title\x07 body")
    with hostile(sends(raw)) as (url, _), pytest.raises(UserError) as info:
        _reward("http", url)(["p"], ["a"])
    assert "\x1b" not in str(info.value) and "\\x1b[31mred: \\x1b]0;title\\x07 body" in str(
        info.value
    )


# ---------------------------------------------------------------------- connections
def test_connections_are_kept_between_requests() -> None:
    with hostile(sends(ok('{"scores": [0.5]}'), close=False)) as (url, connections):
        reward = _reward("http", url)
        for _ in range(3):
            assert reward(["p"], ["a"]) == [0.5]
    assert len(connections) == 1


def test_the_request_sent() -> None:
    """Its path quoted, a user and password of the URL sent as Basic credentials (and
    never shown), the JSON body's length given."""
    with hostile(sends(ok('{"scores": [0.5]}'))) as (url, connections):
        base = url.removesuffix("/score").replace("//", "//me:s%40cret@")
        reward = _reward("http", f"{base}/scoré?x=a%20b")
        assert reward(["p"], ["a"]) == [0.5]
        assert "s%40cret" not in repr(reward)
    head = connections[0][0].decode("latin-1")
    assert head.startswith("POST /scor%C3%A9?x=a%20b HTTP/1.1\r\n")
    lines = head.split("\r\n")
    assert "authorization: Basic bWU6c0BjcmV0" in lines  # me:s@cret
    assert "Content-Length: 52" in lines  # {"prompts": ["p"], ...}


def test_a_kept_connection_the_server_closed_is_replaced() -> None:
    """The server closes each connection after its answer without saying so: the next
    request, finding its kept connection closed, makes a new one (no retry counted)."""
    with hostile(sends(ok('{"scores": [0.5]}'))) as (url, connections):
        reward = _reward("http", url)
        for _ in range(3):
            assert reward(["p"], ["a"]) == [0.5]
            time.sleep(0.05)
    assert len(connections) == 3


def test_a_request_the_server_does_not_read_is_stopped_at_the_timeout() -> None:
    """Sending is under the deadline too: 32 MiB to a server that never reads them."""
    with silent_socket() as url:
        reward = _reward("http", url, on_error="zero")
        start = time.monotonic()
        out = reward(["p"], ["a" * 2**25])
        assert time.monotonic() - start < BOUND
    assert out.scores == [0.0] and out.flags["failed"] == [True]


@pytest.mark.parametrize(
    "raw",
    [
        ok('{"scores": [0.25]}'),
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b'5\r\n{"sco\r\n0d\r\nres": [0.25]}\r\n0\r\n\r\n',
        b'HTTP/1.0 200 OK\r\n\r\n{"scores": [0.25]}',  # its end: the connection's
    ],
    ids=["length", "chunked", "close"],
)
def test_answers_in_every_framing_are_read(raw: bytes) -> None:
    with hostile(sends(raw)) as (url, _):
        assert _reward("http", url)(["p"], ["a"]) == [0.25]


# ---------------------------------------------------------------------- TLS
@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1 and its key (PEM files)."""
    pytest.importorskip("cryptography")
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    folder = tmp_path_factory.mktemp("tls")
    (folder / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (folder / "key.pem").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return str(folder / "cert.pem"), str(folder / "key.pem")


def test_https_with_a_trusted_and_an_untrusted_certificate(certificate) -> None:
    cert, key = certificate
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(cert, key)
    with hostile(sends(ok('{"scores": [0.5]}'), close=False), tls=server) as (url, seen):
        reward = _reward("http", url)
        reward.client.context = ssl.create_default_context(cafile=cert)
        assert [reward(["p"], ["a"]) for _ in range(2)] == [[0.5], [0.5]]
        assert len(seen) == 1
        with pytest.raises(RemoteError) as info:
            _reward("http", url, retries=2)(["p"], ["a"])  # not retried
        _lines_are_plain(str(info.value))
        assert str(info.value).startswith(f"the http reward: {url}: cannot connect (TLS: ")
        assert "certificate" in str(info.value) and len(seen) == 2


def test_a_host_whose_name_does_not_resolve_is_one_line() -> None:
    with pytest.raises(RemoteError) as info:
        _reward("http", "http://nowhere.invalid/score")(["p"], ["a"])
    _lines_are_plain(str(info.value))
    assert "cannot connect (the host's name does not resolve" in str(
        info.value
    ) or "no complete answer within 1 s" in str(info.value)
