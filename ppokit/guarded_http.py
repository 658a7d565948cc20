"""The reward server's connections bounded against clients that send slowly, partly or not
at all (:mod:`ppokit.serve`): uvicorn's h11 protocol with a read deadline and a cap on open
connections. It imports nothing of ppokit's but its errors' helpers, and uvicorn only when
a server starts.

A connection waits on its client at most ``timeout`` seconds, from its start or from its
previous answer, for a request in full (its head at most 16 KiB, unless it comes whole in
one read); an answer its client has not taken by then is dropped with the connection;
beyond ``limit`` connections the one waiting longest on its client is closed. What it closes
for its client's sake it tells in one line.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from ppokit.errors import printable

__all__ = ["CLOSED", "Connections", "guarded"]


#: The scope key set on a request whose connection the guard closed (it told why).
CLOSED = "ppokit.closed"


class Connections:
    """The open connections of one server (:func:`serve`): how many, and those waiting on
    their client (for a request, or to take an answer), the longest waiting first."""

    def __init__(self, limit: int, timeout: float, say: Callable[[str], None]) -> None:
        self.limit, self.timeout, self.say = limit, timeout, say
        self.open = 0
        self.waiting: dict[Any, None] = {}


def guarded(connections: Connections) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol (a request's head at most 16 KiB, unless it comes whole in one
    read) bounded by ``connections``: a connection waits on its client at most ``timeout``
    seconds, from its start or from its previous answer, for a request in full; an
    answer it has not taken by then is dropped with the connection; beyond ``limit``
    connections, the one waiting longest on its client is closed. What it closes for its
    client's sake it tells in one line."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    timeout = connections.timeout

    class Guarded(H11Protocol):
        timer: asyncio.TimerHandle | None = None
        waits = True  # on its client (for a request); else the server is answering one
        heard = False  # part of a request came since it began to wait

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            connections.open += 1
            if connections.open > connections.limit:
                oldest = next(iter(connections.waiting), None)
                if oldest is None:
                    message = (
                        f"the reward server holds {connections.limit} connections, each with a "
                        "request in progress (--max-connections); try again"
                    )
                    self._tell(503, message)
                    self._close(503, message)
                    return
                oldest._evict()
            self._wait()

        def _wait(self) -> None:
            """The connection waits on its client from now, ``timeout`` seconds at most."""
            self.waits, self.heard = True, False
            connections.waiting.pop(self, None)
            connections.waiting[self] = None  # the last to be closed for a newer one
            self._disarm()
            self.timer = self.loop.call_later(timeout, self._expired)

        def _disarm(self) -> None:
            if self.timer is not None:
                self.timer.cancel()
                self.timer = None

        def data_received(self, data: bytes) -> None:
            self.heard = self.heard or self.waits
            super().data_received(data)

        def handle_events(self) -> None:
            super().handle_events()
            cycle = self.cycle
            if (
                self.waits
                and cycle is not None
                and not cycle.more_body
                and not cycle.response_complete
            ):  # the request is in: the server's to answer, its client waited on no more
                self.waits = False
                self._disarm()
                connections.waiting.pop(self, None)

        def on_response_complete(self) -> None:
            self._wait()
            super().on_response_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            connections.waiting.pop(self, None)
            connections.open -= 1
            super().connection_lost(exc)

        def shutdown(self) -> None:
            if self.waits and self.heard:
                self._close(503, "the reward server is stopping")
            else:
                super().shutdown()

        def send_400_response(self, msg: str) -> None:
            self._tell(400, "not a valid HTTP/1.1 request")
            self._close(400, "the reward server cannot read the request: not valid HTTP/1.1")

        def _untaken(self) -> bool:
            """Whether part of an answer still waits for its client to take it."""
            return bool(self.transport.get_write_buffer_size())

        def _expired(self) -> None:
            self.timer = None
            if self._untaken():
                self._tell(
                    0, f"its answer not taken within {timeout:g} s (--read-timeout): dropped"
                )
                self._close(0)
            elif self.heard:
                message = f"no complete request within {timeout:g} s (--read-timeout)"
                self._tell(408, f"{message}: closed")
                self._close(408, message)
            else:  # idle between requests: closed as any keep-alive connection is
                self._close(0)

        def _evict(self) -> None:
            connections.waiting.pop(self, None)
            if self.heard or self._untaken():
                message = (
                    "closed for a newer connection: the reward server holds at most "
                    f"{connections.limit} (--max-connections)"
                )
                self._tell(503, message)
                self._close(503, message)
            else:
                self._close(0)

        def _tell(self, status: int, what: str) -> None:
            client = f"{self.client[0]}:{self.client[1]}" if self.client else "-"
            connections.say(printable(f"{client} {status or '-'} {what}"))

        def _close(self, status: int, message: str = "") -> None:
            """Close the connection, first answering ``status`` (not 0) with ``message``
            where no answer has begun (a request being read sees its client gone); an
            answer its client has not taken is dropped."""
            self._disarm()
            transport = self.transport
            if not transport.is_closing():
                cycle: Any = self.cycle
                active = cycle is not None and not cycle.response_complete
                if status and not (active and cycle.response_started):
                    body = json.dumps({"error": message}).encode()
                    head = (
                        f"HTTP/1.1 {status} {_REASONS.get(status, '')}\r\n"
                        "content-type: application/json\r\n"
                        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
                    )
                    transport.write(head.encode() + body)
                if active:
                    cycle.scope[CLOSED] = True
                    cycle.disconnected = True
                    cycle.message_event.set()
                transport.close()
            if transport.get_write_buffer_size():  # not taken: closing would wait for it
                transport.abort()

    return Guarded


_REASONS = {400: "Bad Request", 408: "Request Timeout", 503: "Service Unavailable"}
