"""Rewards scored by servers (catalogue: :mod:`ppokit.components.reward`): ``http`` (a ppokit
reward server, or any that speaks its JSON) and ``judge`` (an LLM behind an
OpenAI-compatible chat-completions endpoint), over one :class:`Client`.

The client is the standard library's :mod:`http.client` under a deadline, with tenacity's
retries: each try of a request has ``timeout`` seconds for its whole exchange (the host's
name looked up, the connection and its TLS handshake made, the request sent, the status
line, headers and body read: before each step the socket may wait only for what is left,
so a server that trickles its answer a byte at a time is stopped at the timeout as one that
never answers). A failed try (no connection, a timeout, a dropped connection, HTTP 408,
429 or 5xx) is tried again after an exponential backoff with random jitter, each try with
its own ``timeout``; at most ``concurrency`` requests are in flight, and an answer is read
up to a bound. Connections are kept between requests (one found closed by the server is
replaced within the try). Every way a request can fail, the answer's checks included (a
redirect, no HTTP, no JSON, JSON nested too deep, a score that is no finite number, the
wrong count), is one line naming the URL and what happened (:class:`RemoteError`): it stops
the run, or, with ``on_error: zero``, scores its responses 0 and flags them ``failed``.
Nothing waits without a bound. Results are in the order of the responses whatever order the
answers come in.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import io
import ipaddress
import json
import math
import os
import re
import socket
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from typing import Any

from ppokit.bounded import in_threads
from ppokit.components.reward import (
    HTTP,
    JUDGE,
    JUDGE_GROUP_TEMPLATE,
    JUDGE_TEMPLATE,
    JUDGE_VERDICT_TEMPLATE,
    SERVE_INSTALL,
    Scored,
)
from ppokit.errors import MissingDependency, UserError, printable

__all__ = ["Client", "HttpReward", "JudgeReward", "RemoteError", "jsonable", "parse_score"]

#: HTTP statuses worth another try: the server is busy, restarting or overloaded.
TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})
#: Bytes of an error status's body read for its line.
_SNIPPET = 4096


class RemoteError(UserError):
    """A reward that could not be had from its server: one line naming the URL and the cause."""


class _Failed(Exception):
    """A try that failed: its message is the user's line of what happened; ``again``:
    whether another try may help."""

    again = False


class _Lost(_Failed):
    """No connection, a timeout, a connection dropped: worth another try."""

    again = True


class _Status(_Failed):
    """An HTTP error status (and the first line of its body)."""

    def __init__(self, status: int, reason: str, body: str) -> None:
        line = f"answered HTTP {status} {_said(reason, 80)}".strip()
        super().__init__(f"{line}: {_said(body)}" if body.strip() else line)
        self.status = status
        self.again = status in TRANSIENT_STATUS


class _Bad(_Failed):
    """An answer that breaks the protocol (too large, no JSON, the wrong shape): no retry."""


def jsonable(value: Any) -> Any:
    """``value`` as JSON can hold it: numpy and torch scalars and arrays as numbers and
    lists, anything else unknown as its ``str()``."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    tolist = getattr(value, "tolist", None)
    if callable(tolist):
        return jsonable(tolist())
    return str(value)


def _shown(url: str) -> str:
    """The URL without a user name or password in it."""
    return re.sub(r"//[^/@]*@", "//", url)


def _said(text: str, limit: int = 200) -> str:
    """What a server (or the system) said, as part of one line: its whitespace collapsed,
    its control characters escaped, at most ``limit`` characters."""
    text = printable(" ".join(text.split()))
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _first_line(body: bytes) -> str:
    text = body.decode("utf-8", "replace")
    return next((line for line in text.splitlines() if line.strip()), "")


def _reason(exc: OSError) -> str:
    """An OS error's reason in words (``connection refused``), without its class."""
    if isinstance(exc, socket.gaierror):
        return f"the host's name does not resolve: {exc.strerror or exc}"
    text = exc.strerror or str(exc) or "no reason given"
    return _said(text[:1].lower() + text[1:])


def _cause(exc: BaseException, timeout: float) -> _Failed:
    """A try's failure, from what ``http.client`` or the socket raised."""
    if isinstance(exc, _Failed):
        return exc
    if isinstance(exc, TimeoutError):
        return _Lost(f"no complete answer within {timeout:g} s")
    if isinstance(exc, http.client.RemoteDisconnected):
        return _Lost("closed the connection without an answer")
    if isinstance(exc, http.client.IncompleteRead):  # cut short, or a broken chunk
        return _Lost(f"closed the connection or broke off after {len(exc.partial)} bytes")
    if isinstance(exc, http.client.HTTPException):
        return _Bad(f"answered no valid HTTP ({_said(str(exc), 120) or 'malformed'})")
    if isinstance(exc, ssl.SSLError):
        return _Lost(f"TLS failed ({_said(str(exc.reason or exc))})")
    if isinstance(exc, (ConnectionResetError, ConnectionAbortedError, BrokenPipeError)):
        return _Lost(f"dropped the connection ({_reason(exc)})")
    if isinstance(exc, OSError):
        return _Lost(f"the connection failed ({_reason(exc)})")
    return _Bad(f"failed ({_said(str(exc), 120) or type(exc).__name__})")


#: What a kept connection that the server closed meanwhile raises on its next request.
_STALE = (ConnectionResetError, ConnectionAbortedError, BrokenPipeError)


def _addresses(host: str, port: int, seconds: float) -> list[Any]:
    """``getaddrinfo`` for a TCP connection, waited for at most ``seconds`` (a name's
    lookup on its own thread, which ends on the resolver's own timeouts)."""
    with contextlib.suppress(ValueError):
        ipaddress.ip_address(host)
        return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    found: list[Any] = []

    def look() -> None:
        try:
            found.append(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
        except OSError as exc:
            found.append(exc)

    thread = threading.Thread(target=look, name="ppokit-resolve", daemon=True)
    thread.start()
    thread.join(seconds)
    if not found:
        raise TimeoutError("the host's name was not looked up in time")
    if isinstance(found[0], OSError):
        raise found[0]
    return list(found[0])


class _Bounded:
    """A connected socket whose every send and read waits at most until its connection's
    deadline (``left``: the seconds left, TimeoutError when none are). Closed for real once
    the connection and every file made of it are (as :meth:`socket.socket.makefile`'s)."""

    def __init__(self, sock: socket.socket, left: Callable[[], float]) -> None:
        self._sock, self._left = sock, left
        self._files, self._closed = 0, False

    def sendall(self, data: Any) -> None:
        with memoryview(data) as view, view.cast("B") as octets:
            sent = 0
            while sent < len(octets):
                self._sock.settimeout(self._left())
                sent += self._sock.send(octets[sent : sent + 65536])

    def recv_into(self, buffer: Any) -> int:
        self._sock.settimeout(self._left())
        return self._sock.recv_into(buffer)

    def makefile(self, mode: str = "rb", *args: Any, **kwargs: Any) -> io.BufferedReader:
        self._files += 1
        return io.BufferedReader(_Reader(self))

    def release(self) -> None:
        self._files -= 1
        if self._closed and self._files <= 0:
            self._sock.close()

    def close(self) -> None:
        self._closed = True
        if self._files <= 0:
            self._sock.close()

    def kill(self) -> None:
        """Close it now, whatever still reads it."""
        self._closed = True
        self._sock.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


class _Reader(io.RawIOBase):
    """The raw reads of a :class:`_Bounded` socket, each under its deadline."""

    def __init__(self, sock: _Bounded) -> None:
        self._sock = sock

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        return self._sock.recv_into(buffer)

    def close(self) -> None:
        if not self.closed:
            self._sock.release()
        super().close()


class _Connection(http.client.HTTPConnection):
    """One connection to the server (TLS with ``context``) whose every step, from the name's
    lookup to the answer's last byte, waits at most until ``deadline`` (``time.monotonic``).
    Its sends and reads go through a :class:`_Bounded` socket."""

    def __init__(self, host: str, port: int, context: ssl.SSLContext | None) -> None:
        super().__init__(host, port)
        self.context = context
        self.deadline = math.inf
        self.bounded: _Bounded | None = None
        if context is not None:
            self.default_port = http.client.HTTPS_PORT  # the Host header's port

    def left(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the deadline passed")
        return left

    def connect(self) -> None:
        failure: OSError = OSError("the host's name has no address")
        try:
            found = _addresses(self.host, self.port, self.left())
        except TimeoutError:
            raise
        except OSError as exc:
            raise _Lost(f"cannot connect ({_reason(exc)})") from None
        for family, kind, proto, _, address in found:
            sock = socket.socket(family, kind, proto)
            try:
                sock.settimeout(self.left())
                sock.connect(address)
                break
            except TimeoutError:
                sock.close()
                raise
            except OSError as exc:
                sock.close()
                failure = exc
        else:
            if isinstance(failure, ConnectionRefusedError):
                raise _Lost("cannot connect (connection refused)")
            raise _Lost(f"cannot connect ({_reason(failure)})")
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.context is not None:
            try:
                sock.settimeout(self.left())  # the handshake, whole, within what is left
                sock = self.context.wrap_socket(sock, server_hostname=self.host)
            except ssl.SSLCertVerificationError as exc:
                sock.close()
                why = _said(exc.verify_message or str(exc))
                raise _Bad(f"cannot connect (TLS: {why})") from None
            except BaseException:
                sock.close()
                raise
        self.bounded = _Bounded(sock, self.left)
        self.sock = self.bounded  # type: ignore[assignment]  # what http.client uses of one

    def kill(self) -> None:
        """Close it now, an answer still being read included."""
        if self.bounded is not None:
            self.bounded.kill()
            self.bounded = None
        self.close()


class Client:
    """POSTs JSON to one URL (see the module's docstring): ``post`` one request with its
    retries, ``post_all`` several at once, in order."""

    def __init__(
        self,
        url: str,
        *,
        what: str,
        timeout: float,
        retries: int,
        backoff: float,
        max_backoff: float,
        concurrency: int,
        max_response_mb: float,
        api_key_env: str | None,
    ) -> None:
        self.url, self.what = url, what
        self.timeout = timeout
        self.retries, self.backoff, self.max_backoff = retries, backoff, max_backoff
        self.max_mb, self.max_bytes = max_response_mb, int(max_response_mb * 2**20)
        parts = urllib.parse.urlsplit(url)
        try:
            port = parts.port
        except ValueError:
            port = -1
        if parts.scheme not in ("http", "https") or not parts.hostname or port == -1:
            raise UserError(f"{what}: {_shown(url)} is no http:// or https:// URL")
        self.tls = parts.scheme == "https"
        self.host = parts.hostname
        self.port = port or (http.client.HTTPS_PORT if self.tls else http.client.HTTP_PORT)
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self.path = urllib.parse.quote(path, safe="/%:@!$&'()*+,;=?~")  # as httpx sent it
        self.headers = {"content-type": "application/json", "user-agent": "ppokit"}
        if parts.username is not None:  # as the URL gives them (the key below wins)
            user = urllib.parse.unquote(parts.username)
            word = urllib.parse.unquote(parts.password or "")
            token = base64.b64encode(f"{user}:{word}".encode()).decode()
            self.headers["authorization"] = f"Basic {token}"
        if api_key_env is not None:
            key = os.environ.get(api_key_env)
            if not key:
                raise UserError(f"{what}: the environment variable {api_key_env} is not set")
            if not key.isprintable():  # a header's value, which it would end
                raise UserError(
                    f"{what}: the environment variable {api_key_env} holds a control character"
                )
            self.headers["authorization"] = f"Bearer {key}"
        self.concurrency = concurrency
        self._connect()

    def _connect(self) -> None:
        """The retries, the TLS context and the kept connections (which no pickle
        carries: a worker process that receives this client makes its own)."""
        try:
            import tenacity
        except ImportError as exc:
            raise MissingDependency(exc.name or "tenacity", self.what, SERVE_INSTALL) from None
        self.tenacity = tenacity
        self.context: ssl.SSLContext | None = None
        if self.tls:
            try:
                import certifi

                cafile: str | None = certifi.where()
            except ImportError:
                cafile = None
            self.context = ssl.create_default_context(cafile=cafile)
        self._idle: list[_Connection] = []
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        for unpicklable in ("tenacity", "context", "_idle", "_lock"):
            state.pop(unpicklable, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._connect()

    def _take(self) -> _Connection:
        """A kept connection, or a new one (which connects when used)."""
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return _Connection(self.host, self.port, self.context)

    def _keep(self, conn: _Connection) -> None:
        with self._lock:
            if len(self._idle) < self.concurrency:
                self._idle.append(conn)
                return
        conn.close()

    def _exchange(self, conn: _Connection, body: bytes) -> Any:
        """One request and its whole answer on ``conn`` (under its deadline)."""
        conn.request("POST", self.path, body=body, headers=self.headers)
        r = conn.getresponse()
        if 300 <= r.status < 400 and r.getheader("location"):
            where = _shown(r.getheader("location") or "")
            raise _Bad(f"redirected to {_said(where, 300)}, not followed")
        if r.status >= 300:
            raise _Status(r.status, r.reason, _first_line(r.read(_SNIPPET)))
        if r.length is not None and r.length > self.max_bytes:
            raise _Bad(f"answered more than {self.max_mb:g} MiB (max_response_mb)")
        chunks, size = [], 0
        while chunk := r.read(min(65536, self.max_bytes + 1 - size)):
            size += len(chunk)
            if size > self.max_bytes:
                raise _Bad(f"answered more than {self.max_mb:g} MiB (max_response_mb)")
            chunks.append(chunk)
        if r.length:  # the connection ended before the length its headers announced
            total = size + r.length
            raise _Lost(f"closed the connection after {size} of the answer's {total} bytes")
        text = b"".join(chunks)
        try:
            return json.loads(text)
        except RecursionError:
            raise _Bad("answered JSON nested too deep") from None
        except ValueError as exc:  # UnicodeDecodeError included
            raise _Bad(f"answered no JSON ({_said(str(exc), 120)}; {text[:80]!r})") from None

    def _once(self, body: bytes) -> Any:
        """One try: its whole exchange within ``timeout``. A kept connection that the
        server closed meanwhile is replaced by a new one, within the same deadline."""
        deadline = time.monotonic() + self.timeout
        conn = self._take()
        while True:
            kept = conn.sock is not None
            conn.deadline = deadline
            try:
                answer = self._exchange(conn, body)
            except Exception as exc:
                conn.kill()
                if kept and isinstance(exc, _STALE) and time.monotonic() < deadline:
                    conn = _Connection(self.host, self.port, self.context)
                    continue
                raise _cause(exc, self.timeout) from None
            self._keep(conn)
            return answer

    def post(self, payload: Any) -> Any:
        """The JSON answer to ``payload``, tried ``1 + retries`` times; RemoteError naming
        the URL and the cause after the last (whatever failed: nothing else is raised)."""
        body = json.dumps(jsonable(payload)).encode()
        t = self.tenacity
        tries = t.Retrying(
            stop=t.stop_after_attempt(self.retries + 1),
            wait=t.wait_exponential_jitter(
                multiplier=self.backoff, max=self.max_backoff, jitter=self.backoff
            ),
            retry=t.retry_if_exception(lambda exc: isinstance(exc, _Failed) and exc.again),
            reraise=True,
        )
        attempts = 0
        try:
            for attempt in tries:
                with attempt:
                    attempts += 1
                    return self._once(body)
        except Exception as exc:
            cause = _cause(exc, self.timeout)
            after = f" (after {attempts} tries)" if attempts > 1 else ""
            raise RemoteError(f"{self.what}: {_shown(self.url)}: {cause}{after}") from None
        raise AssertionError("unreachable")  # tenacity returns or raises

    def post_all(self, payloads: list[Any], *, stop: bool) -> list[Any]:
        """The answers to ``payloads`` in their order, ``concurrency`` at once. ``stop``: the
        first failure (in order) is raised and the requests not yet sent are cancelled;
        otherwise a failed request's place holds its :class:`RemoteError`."""
        return in_threads(
            self.post, payloads, self.concurrency, "ppokit-remote", RemoteError if stop else None
        )

    def close(self) -> None:
        """Close the kept connections."""
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def __del__(self) -> None:
        # no contextlib here: at interpreter exit the modules' names may be gone already
        try:  # noqa: SIM105
            self.close()
        except Exception:  # half-built, or at interpreter exit
            pass


def _kind(value: Any) -> str:
    """A JSON value in words (``true``, ``the text '1'``, ``a list``), for a line."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, str):
        return f"the text {_said(repr(value), 40)}"
    if isinstance(value, (list, dict)):
        return "a list" if isinstance(value, list) else "an object"
    if isinstance(value, int):
        digits = len(str(abs(value))) if value.bit_length() < 10_000 else None
        return f"an integer of {digits} digits" if digits else "a very large integer"
    return repr(value)


def _numbers(value: Any, n: int, what: str) -> list[float]:
    """``value`` as ``n`` finite floats, or _Bad naming the first that is not one."""
    if not isinstance(value, list) or len(value) != n:
        got = f"{len(value)} values" if isinstance(value, list) else _kind(value)
        raise _Bad(f"{what}: expected {n} numbers, got {got}")
    out = []
    for i, v in enumerate(value):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise _Bad(f"{what}: item {i} is {_kind(v)}, not a number")
        try:
            x = float(v)
        except OverflowError:  # an integer beyond a float's range
            x = math.inf
        if not math.isfinite(x):
            raise _Bad(f"{what}: item {i} is {_kind(v)}, not a finite number")
        out.append(x)
    return out


def _chunks(n: int, size: int) -> list[slice]:
    return [slice(a, min(a + size, n)) for a in range(0, n, size)]


@HTTP.implementation
class HttpReward:
    """Each request is ``{"prompts": [...], "responses": [...], "fields": {name: [...]}}``
    for a chunk of responses (the data's columns, ``lengths``, ``truncated``), and its
    answer ``{"scores": [...]}`` (one number per response; ``parts: {name: [...]}`` and
    ``flags`` when the server serves several rewards), checked: a wrong count, or a score
    that is no finite number (a text, a bool, NaN, an integer beyond a float's range), is a
    failure like a refused connection (not retried)."""

    blocking = True  # its calls wait on a server or a sandbox

    def __init__(
        self,
        *,
        url: str,
        chunk_size: int,
        part: str | None,
        timeout: float,
        retries: int,
        backoff: float,
        max_backoff: float,
        concurrency: int,
        on_error: str,
        api_key_env: str | None,
        max_response_mb: float,
    ) -> None:
        self.url, self.chunk_size, self.part, self.on_error = url, chunk_size, part, on_error
        self.client = Client(
            url, what="the http reward", timeout=timeout, retries=retries, backoff=backoff,
            max_backoff=max_backoff, concurrency=concurrency, api_key_env=api_key_env,
            max_response_mb=max_response_mb,
        )  # fmt: skip

    def _scores(self, answer: Any, n: int) -> list[float]:
        if not isinstance(answer, dict):
            raise _Bad("answered JSON that is no object")
        if self.part is None:
            return _numbers(answer.get("scores"), n, "its 'scores'")
        parts = answer.get("parts")
        if not isinstance(parts, dict) or self.part not in parts:
            names = sorted(parts) if isinstance(parts, dict) else []
            raise _Bad(f"its answer has no part {self.part!r} (parts: {names})")
        return _numbers(parts[self.part], n, f"its part {self.part!r}")

    def __call__(self, prompts: list[str], responses: list[str], **fields: Any) -> Any:
        cuts = _chunks(len(responses), self.chunk_size)
        payloads = [
            {
                "prompts": prompts[c],
                "responses": responses[c],
                "fields": {k: list(v)[c] for k, v in fields.items()},
            }
            for c in cuts
        ]
        answers = self.client.post_all(payloads, stop=self.on_error == "stop")
        scores: list[float] = []
        failed: list[bool] = []
        for c, answer in zip(cuts, answers, strict=True):
            n = c.stop - c.start
            try:
                if isinstance(answer, RemoteError):
                    raise answer
                got = self._scores(answer, n)
            except _Bad as exc:
                if self.on_error == "stop":
                    raise RemoteError(f"the http reward: {_shown(self.url)}: {exc}") from None
                got = None
            except RemoteError:
                got = None
            scores += got if got is not None else [0.0] * n
            failed += [got is None] * n
        if self.on_error == "zero":
            return Scored(scores, {"failed": failed})
        return scores

    def __repr__(self) -> str:
        return f"HttpReward({_shown(self.url)!r})"


_NUMBER = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)"
#: " / H" after a score: the top of the scale, which must be ``high``.
_OUT_OF = rf"(?:\s*/\s*({_NUMBER}))?"
# Each pattern is matched whole against one line (fullmatch: one start), and no two
# quantified neighbours can take the same character, so a failed match gives each character
# back at most once: linear in the line's length.
_SCORE = re.compile(rf"(?:final\s+)?score\s*(?:[:=]\s*)?({_NUMBER}){_OUT_OF}", re.IGNORECASE)
_BARE = re.compile(rf"({_NUMBER}){_OUT_OF}")
_REPLY = re.compile(rf"reply\s*(?:#\s*)?(\d+)\s*[:=\-]\s*({_NUMBER}){_OUT_OF}", re.IGNORECASE)
_LABEL = re.compile(r"(?:verdict|answer)\s*:\s*", re.IGNORECASE)
#: Markdown's bold, italic and code marks, dropped from a line before it is read.
_MARKS = str.maketrans("", "", "*`")


def _plain(line: str) -> str:
    """``line`` as read: without ``*`` and backquotes, leading ``#``, surrounding
    blanks and trailing ``.`` or ``!``."""
    return line.translate(_MARKS).strip().lstrip("#").strip().rstrip(".!").rstrip()


def _lines(text: str) -> list[str]:
    """The non-empty lines of ``text`` as read (:func:`_plain`), in order."""
    return [line for line in map(_plain, text.splitlines()) if line]


def _scaled(number: str, out_of: str | None, low: float, high: float) -> float | None:
    value = float(number)
    if out_of is not None and float(out_of) != high:
        return None
    if not math.isfinite(value) or not low <= value <= high:
        return None
    return (value - low) / (high - low)


def parse_score(
    text: str, mode: str, low: float, high: float, positive: Sequence[str], negative: Sequence[str]
) -> float | None:
    """The judge's score in [0, 1] read from its answer, or None when there is none.

    Only the answer's last non-empty line is read, where the rubric asks for the verdict,
    and it must be the verdict whole: a score or word anywhere earlier (a judge quoting the
    reply, say) never counts. A line is read without markdown marks (``*``, backquotes),
    leading ``#``, surrounding blanks and a trailing ``.`` or ``!``.

    Mode ``number``: that line is ``Score: N`` (``Score N``, ``Score = N``, ``Final score:
    N``, any case; ``N / high`` allowed), or the whole answer is the number alone; N in
    [low, high] is scaled to (N − low) / (high − low). Mode ``verdict``: that line is one of
    the verdict words (any case, optionally after ``Verdict:`` or ``Answer:``), 1 for a
    positive one and 0 for a negative. Linear in the answer's length."""
    lines = _lines(text)
    if not lines:
        return None
    last = lines[-1]
    if mode == "verdict":
        label = _LABEL.match(last)
        word = last[label.end() :] if label else last
        words = {_plain(w).casefold(): 1.0 for w in positive}
        words |= {_plain(w).casefold(): 0.0 for w in negative}
        return words.get(word.casefold()) if word else None
    found = _SCORE.fullmatch(last) or (_BARE.fullmatch(last) if len(lines) == 1 else None)
    return _scaled(found.group(1), found.group(2), low, high) if found else None


def parse_group(text: str, count: int, low: float, high: float) -> list[float | None]:
    """Each reply's score in [0, 1] from a group answer, None where it has none.

    Only the answer's final block of ``Reply K: N`` lines is read (``Reply #K - N``,
    ``Reply K = N`` too; blank lines may part them): the lines from the end up to the
    first non-empty line of another shape, each read as :func:`parse_score` reads a line.
    A K given twice in that block, out of 1..count, or an N out of [low, high] scores
    none. Linear in the answer's length."""
    scores: dict[int, float | None] = {}
    twice: set[int] = set()
    for line in reversed(_lines(text)):
        found = _REPLY.fullmatch(line)
        if found is None:
            break
        digits = found.group(1).lstrip("0")
        k = int(digits) if 0 < len(digits) <= len(str(count)) else 0
        if k in scores:
            twice.add(k)
        scores[k] = _scaled(found.group(2), found.group(3), low, high)
    return [None if k in twice else scores.get(k) for k in range(1, count + 1)]


def _code(seed: bytes, n: int) -> str:
    """The ``n``-th code a fence may take in a request whose texts hash to ``seed``."""
    import hashlib

    return hashlib.sha256(seed + n.to_bytes(8, "big")).hexdigest()[:8]


def _fence(texts: Sequence[str]) -> str:
    """The fence's tag for a request of ``texts``: ``reply-`` and 8 hex digits, the first of
    :func:`_code`'s that occurs in none of them (in any case), so a reply pasted between
    ``<tag>`` and ``</tag>`` cannot close its fence or open another. The digits come from
    SHA-256 over the texts: the same request is sent the same rubric (a judge at
    temperature 0 answers it alike)."""
    import hashlib

    whole = hashlib.sha256()
    for text in texts:
        data = text.encode("utf-8", "surrogatepass")
        whole.update(len(data).to_bytes(8, "big") + data)
    seed, seen, n = whole.digest(), [t.casefold() for t in texts], 0
    while any((code := _code(seed, n)) in t for t in seen):
        n += 1
    return f"reply-{code}"


@JUDGE.implementation
class JudgeReward:
    """One chat-completions request per response (``group``: per run of consecutive
    responses to the same prompt, its replies numbered from 1), asked for
    ``max_tokens`` tokens at ``temperature``, each response pasted in the rubric inside its
    fence (:func:`_fence`); the answer's ``choices[0].message.content`` is parsed
    (:func:`parse_score`, :func:`parse_group`). An answer without that field is a
    failure of the server (``on_error``); an answer without a score is ``unparsed``."""

    blocking = True  # its calls wait on a server or a sandbox

    def __init__(
        self,
        *,
        url: str,
        model: str,
        template: str | None,
        system: str | None,
        field: str | None,
        mode: str,
        low: float,
        high: float,
        positive: list[str],
        negative: list[str],
        unparsed: float,
        group: bool,
        temperature: float,
        max_tokens: int,
        timeout: float,
        retries: int,
        backoff: float,
        max_backoff: float,
        concurrency: int,
        on_error: str,
        api_key_env: str | None,
        max_response_mb: float,
    ) -> None:
        self.endpoint = url.rstrip("/") + "/chat/completions"
        self.model, self.system, self.field = model, system, field
        default = JUDGE_VERDICT_TEMPLATE if mode == "verdict" else JUDGE_TEMPLATE
        self.template = template or (JUDGE_GROUP_TEMPLATE if group else default)
        self.mode, self.low, self.high = mode, low, high
        self.positive, self.negative, self.unparsed = positive, negative, unparsed
        self.group, self.temperature, self.max_tokens = group, temperature, max_tokens
        self.on_error = on_error
        self.client = Client(
            self.endpoint, what="the judge reward", timeout=timeout, retries=retries,
            backoff=backoff, max_backoff=max_backoff, concurrency=concurrency,
            api_key_env=api_key_env, max_response_mb=max_response_mb,
        )  # fmt: skip

    def _request(self, text: str) -> dict[str, Any]:
        messages = [{"role": "user", "content": text}]
        if self.system is not None:
            messages.insert(0, {"role": "system", "content": self.system})
        return {
            "model": self.model,
            "messages": messages,
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
        }

    def _groups(self, prompts: list[str]) -> list[slice]:
        """Runs of consecutive responses to the same prompt (one run each without group)."""
        if not self.group:
            return [slice(i, i + 1) for i in range(len(prompts))]
        cuts, start = [], 0
        for i in range(1, len(prompts) + 1):
            if i == len(prompts) or prompts[i] != prompts[start]:
                cuts.append(slice(start, i))
                start = i
        return cuts

    def _text(self, prompts: list[str], responses: list[str], answers: list[Any], c: slice) -> str:
        """The rubric of the responses ``c``, each pasted inside its fence (``{tag}``,
        :func:`_fence`), whatever the template."""
        answer = answers[c.start]
        gold = "(none given)" if answer is None else str(answer)
        mine = responses[c]
        texts = [prompts[c.start], gold, self.template, self.system or "", *mine]
        tag = _fence([str(t) for t in texts])
        values = {"prompt": prompts[c.start], "answer": gold, "low": self.low, "high": self.high}
        fenced = [f"<{tag}>\n{r}\n</{tag}>" for r in mine]
        if self.group:
            listed = "\n\n".join(f"Reply {k + 1}:\n{r}" for k, r in enumerate(fenced))
            return self.template.format(**values, tag=tag, responses=listed, count=len(mine))
        words = {"positive": self.positive[0], "negative": self.negative[0]}
        return self.template.format(**values, **words, tag=tag, response=fenced[0])

    @staticmethod
    def _content(answer: Any) -> str:
        try:
            content = answer["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            raise _Bad("answered no choices[0].message.content") from None
        if not isinstance(content, str):
            raise _Bad("answered a message whose content is no text")
        return content

    def _parse(self, content: str, n: int) -> list[float | None]:
        if self.group:
            return parse_group(content, n, self.low, self.high)
        args = (self.mode, self.low, self.high, self.positive, self.negative)
        return [parse_score(content, *args)]

    def __call__(self, prompts: list[str], responses: list[str], **fields: Any) -> Scored:
        answers: list[Any] = [None] * len(responses)
        if self.field is not None and self.field in fields:
            answers = list(fields[self.field])
        cuts = self._groups(prompts)
        requests = [self._request(self._text(prompts, responses, answers, c)) for c in cuts]
        replies = self.client.post_all(requests, stop=self.on_error == "stop")
        scores: list[float] = []
        unparsed: list[bool] = []
        failed: list[bool] = []
        for c, reply in zip(cuts, replies, strict=True):
            n = c.stop - c.start
            try:
                if isinstance(reply, RemoteError):
                    raise reply
                parsed = self._parse(self._content(reply), n)
            except (_Bad, RemoteError) as exc:
                if self.on_error == "stop":
                    if isinstance(exc, RemoteError):
                        raise
                    raise RemoteError(f"the judge reward: {_shown(self.endpoint)}: {exc}") from None
                scores += [0.0] * n
                unparsed += [False] * n
                failed += [True] * n
                continue
            scores += [self.unparsed if p is None else p for p in parsed]
            unparsed += [p is None for p in parsed]
            failed += [False] * n
        flags: dict[str, list[bool]] = {"unparsed": unparsed}
        if self.on_error == "zero":
            flags["failed"] = failed
        return Scored(scores, flags)

    def __repr__(self) -> str:
        return f"JudgeReward({_shown(self.endpoint)!r}, model={self.model!r})"
