"""The HTTP client of the rewards scored by servers (:mod:`ppokit.components.reward.remote`):
the standard library's :mod:`http.client` under a deadline, with tenacity's retries. It
imports no reward and nothing of the trainer.

Each try of a request has ``timeout`` seconds for its whole exchange (the host's name
looked up, the connection and its TLS handshake made, the request sent, the status line,
headers and body read: before each step the socket may wait only for what is left, so a
server that trickles its answer a byte at a time is stopped at the timeout as one that
never answers). A failed try (no connection, a timeout, a dropped connection, HTTP 408,
429 or 5xx) is tried again after an exponential backoff with random jitter, each try with
its own ``timeout``; at most ``concurrency`` requests are in flight, and an answer is read
up to a bound. Connections are kept between requests (one found closed by the server is
replaced within the try). Every way a request can fail is one line naming the URL and what
happened (:class:`RemoteError`). Nothing waits without a bound.
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
from collections.abc import Callable
from typing import Any

from ppokit.bounded import in_threads
from ppokit.components.reward import SERVE_INSTALL
from ppokit.errors import MissingDependency, UserError, said

__all__ = [
    "TRANSIENT_STATUS",
    "BadAnswer",
    "Client",
    "RemoteError",
    "jsonable",
    "shown",
]

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
        line = f"answered HTTP {status} {said(reason, 80)}".strip()
        super().__init__(f"{line}: {said(body)}" if body.strip() else line)
        self.status = status
        self.again = status in TRANSIENT_STATUS


class BadAnswer(_Failed):
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


def shown(url: str) -> str:
    """The URL without a user name or password in it."""
    return re.sub(r"//[^/@]*@", "//", url)


def _body_line(body: bytes) -> str:
    text = body.decode("utf-8", "replace")
    return next((line for line in text.splitlines() if line.strip()), "")


def _reason(exc: OSError) -> str:
    """An OS error's reason in words (``connection refused``), without its class."""
    if isinstance(exc, socket.gaierror):
        return f"the host's name does not resolve: {exc.strerror or exc}"
    text = exc.strerror or str(exc) or "no reason given"
    return said(text[:1].lower() + text[1:])


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
        return BadAnswer(f"answered no valid HTTP ({said(str(exc), 120) or 'malformed'})")
    if isinstance(exc, ssl.SSLError):
        return _Lost(f"TLS failed ({said(str(exc.reason or exc))})")
    if isinstance(exc, (ConnectionResetError, ConnectionAbortedError, BrokenPipeError)):
        return _Lost(f"dropped the connection ({_reason(exc)})")
    if isinstance(exc, OSError):
        return _Lost(f"the connection failed ({_reason(exc)})")
    return BadAnswer(f"failed ({said(str(exc), 120) or type(exc).__name__})")


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
                why = said(exc.verify_message or str(exc))
                raise BadAnswer(f"cannot connect (TLS: {why})") from None
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
            raise UserError(f"{what}: {shown(url)} is no http:// or https:// URL")
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
            where = shown(r.getheader("location") or "")
            raise BadAnswer(f"redirected to {said(where, 300)}, not followed")
        if r.status >= 300:
            raise _Status(r.status, r.reason, _body_line(r.read(_SNIPPET)))
        if r.length is not None and r.length > self.max_bytes:
            raise BadAnswer(f"answered more than {self.max_mb:g} MiB (max_response_mb)")
        chunks, size = [], 0
        while chunk := r.read(min(65536, self.max_bytes + 1 - size)):
            size += len(chunk)
            if size > self.max_bytes:
                raise BadAnswer(f"answered more than {self.max_mb:g} MiB (max_response_mb)")
            chunks.append(chunk)
        if r.length:  # the connection ended before the length its headers announced
            total = size + r.length
            raise _Lost(f"closed the connection after {size} of the answer's {total} bytes")
        text = b"".join(chunks)
        try:
            return json.loads(text)
        except RecursionError:
            raise BadAnswer("answered JSON nested too deep") from None
        except ValueError as exc:  # UnicodeDecodeError included
            raise BadAnswer(f"answered no JSON ({said(str(exc), 120)}; {text[:80]!r})") from None

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
            raise RemoteError(f"{self.what}: {shown(self.url)}: {cause}{after}") from None
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
