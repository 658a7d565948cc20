"""Servers on loopback for the tests of the rewards that call servers: a starlette
application run by uvicorn on a thread of the test process (:class:`Running`), a stub of
an OpenAI-compatible chat-completions endpoint whose answers a test sets, and a socket that
takes connections and never answers; and a server process (vLLM's) started and awaited."""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ppokit.serve import bind

__all__ = ["ChatStub", "Running", "run_app", "silent_socket", "started_process"]


@dataclass
class Running:
    """A server on a thread: its base URL and the uvicorn server (``should_exit`` stops it)."""

    url: str
    server: uvicorn.Server
    thread: threading.Thread


@contextmanager
def run_app(app: Any) -> Iterator[Running]:
    """``app`` served on 127.0.0.1 on a free port until the block ends."""
    sock = bind("127.0.0.1", 0)
    config = uvicorn.Config(app, lifespan="off", log_level="error", access_log=False)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    try:
        yield Running(f"http://127.0.0.1:{sock.getsockname()[1]}", server, thread)
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


@dataclass
class ChatStub:
    """An OpenAI-compatible ``/v1/chat/completions`` whose answer a test sets:
    ``reply(messages) -> content`` (text), or ``status`` (an HTTP error for the next
    ``fail`` requests), ``delay`` (seconds before answering), ``raw`` (a body instead of a
    completion). It records every request and the most in flight at once."""

    reply: Callable[[list[dict[str, str]]], str] = lambda messages: "Score: 7"
    status: int = 0
    fail: int = 0
    delay: float = 0.0
    raw: bytes | None = None
    requests: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    in_flight: int = 0
    most: int = 0

    def app(self) -> Starlette:
        lock = threading.Lock()

        async def chat(request: Request) -> Response:
            body = await request.json()
            with lock:
                self.requests.append(body)
                self.headers.append(dict(request.headers))
                self.in_flight += 1
                self.most = max(self.most, self.in_flight)
            try:
                if self.delay:
                    await asyncio.sleep(self.delay)
                if self.fail > 0:
                    self.fail -= 1
                    return JSONResponse({"error": "busy"}, status_code=self.status)
                if self.raw is not None:
                    return Response(self.raw, media_type="application/json")
                content = self.reply(body["messages"])
                return JSONResponse(
                    {
                        "choices": [
                            {"index": 0, "message": {"role": "assistant", "content": content}}
                        ]
                    }
                )
            finally:
                with lock:
                    self.in_flight -= 1

        return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])


@contextmanager
def silent_socket() -> Iterator[str]:
    """A URL whose server takes the connection (the kernel's backlog) and never answers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/score"


@contextmanager
def started_process(
    args: list[str], env: dict[str, str], log: Path, url: str, start: float
) -> Iterator[str]:
    """The server process ``args`` (its output in ``log``), once ``url``/health answers 200,
    within ``start`` seconds; ended (SIGTERM, then SIGKILL after 60 s) when the block ends."""
    out = log.open("w")
    proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + start
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server ended: {log.read_text()}")
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start within {start} s")
            time.sleep(0.5)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        out.close()
