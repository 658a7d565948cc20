"""``ppokit reward-server``: a spec's rewards, or one reward component with its parameters,
served over HTTP (starlette on uvicorn), for the ``http`` reward of runs elsewhere.

``POST /score`` takes ``{"prompts": [...], "responses": [...], "fields": {name: [...]}}``
(one entry per response in each list: the data's columns, ``lengths``, ``truncated``) and
answers ``{"scores": [...], "parts": {reward: [...]}, "flags": {"reward/flag": [...]}}``:
R = Σ_k w_k r_k, each reward's own scores, and the flags the rewards raised (0 or 1).
``GET /health`` answers ``{"status": "ok", "rewards": [...], "weights": {...}}`` (with a key
set, ``{"status": "ok"}`` alone to a client without it).

Bounded against clients that send slowly, partly or not at all (``serve``, a guard on
uvicorn's h11 protocol): at most ``max_connections`` connections are open (beyond, the one
waiting longest on its client is closed); a request's head (at most 16 KiB) and body arrive
within ``read_timeout`` seconds of the connection's start or of the previous answer, else
the connection is closed (with a 408 when part of a request came), an answer its client
has not taken by then dropped with it. What waits on a client holds no request slot: a
request counts once its body is in (``build_app``): at most ``concurrency`` are
parsed and scored at once, on worker threads (each reward call under the spec's
``train.reward_timeout``), and at most ``max_pending`` more wait (beyond: 503). A body
larger than ``max_request_mb`` is refused (413) before it is read in full, and the bodies
held at once, read, waiting or scored, are at most ``max_inflight_mb`` (beyond: 503).

With a key (``api_key``) every ``/score`` request carries ``Authorization: Bearer KEY``
(compared in constant time; else 401). A malformed request is a 400 (a field named as one
of a reward's own arguments, :data:`REFUSED_FIELDS`, or nested deeper than
:data:`MAX_DEPTH` included), a reward's error a 422, each ``{"error": "one line"}``
speaking of the reward server; the log (stderr) has one line per request and per
connection closed for its client's sake, never a traceback. SIGINT or SIGTERM stops it: no
new connection is taken, the requests in flight are answered (for at most
``shutdown_timeout`` seconds, then with a 503), and the process exits with status 0 once
the reward calls under way have ended. It listens on loopback unless told otherwise, and
beyond loopback only with a key or when told that none is meant.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import json
import math
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

import typer

from ppokit.components.reward import RESERVED_FIELDS, SERVE_INSTALL, TRAINER_FIELDS
from ppokit.errors import MissingDependency, UserError, clipped, one_line, said
from ppokit.guarded_http import CLOSED, Connections, guarded

__all__ = [
    "CONCURRENCY",
    "MAX_CONNECTIONS",
    "MAX_DEPTH",
    "MAX_INFLIGHT_MB",
    "MAX_PENDING",
    "MAX_REQUEST_MB",
    "READ_TIMEOUT",
    "REFUSED_FIELDS",
    "SHUTDOWN_SECONDS",
    "BadRequest",
    "ScoreService",
    "bind",
    "build_app",
    "is_loopback",
    "load_rewards",
    "parse_request",
    "reward_server_command",
    "serve",
]

#: Requests parsed and scored at once (worker threads).
CONCURRENCY = 2
#: Requests whose body is in that may wait beyond those (then: 503).
MAX_PENDING = 64
#: The largest request body, in MiB (then: 413, before it is read in full).
MAX_REQUEST_MB = 16.0
#: The request bodies held at once (read, waiting or scored), in MiB (then: 503).
MAX_INFLIGHT_MB = 128.0
#: Connections open at once (then: the one waiting longest on its client is closed).
MAX_CONNECTIONS = 256
#: Seconds a client has to send a request in full from the connection's start or the
#: previous answer, and to take an answer that fills the socket's buffers (then: closed).
READ_TIMEOUT = 30.0
#: How long a stopping server answers the requests in flight, in seconds (then: 503).
SHUTDOWN_SECONDS = 30.0
#: The deepest nesting of a request's JSON (the body's object is level 1, a field's list 3).
MAX_DEPTH = 100
#: Field names a request may not use: what a reward's call takes itself (its texts, TRL's
#: ``completions``, a reward object's ``self``), which a field of that name would shadow.
REFUSED_FIELDS = tuple(name for name in RESERVED_FIELDS if name not in TRAINER_FIELDS)
#: The longest error text served or logged, in characters.
_LONGEST = 400


class BadRequest(ValueError):
    """A request that breaks the protocol (HTTP 400)."""


def _name(name: str) -> str:
    """A client's name (a field's) as a message shows it: quoted, escaped, clipped."""
    return repr(clipped(name, 60))


def _served(text: str) -> str:
    """An error as the reward server tells its client: the boundary's words for a run
    (a reward that timed out stops it) left out, one line, clipped."""
    return said(text.replace(" and the run stops", ""), _LONGEST)


def _texts(data: dict[str, Any], key: str) -> list[str]:
    value = data.get(key)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise BadRequest(f"'{key}' must be a list of strings")
    return value


def _deeper_than(data: Any, limit: int) -> bool:
    """Whether JSON ``data`` nests lists and objects more than ``limit`` levels (without
    recursion: a deep body costs no stack)."""
    level = [data] if isinstance(data, (list, dict)) else []
    depth = 0
    while level:
        depth += 1
        if depth > limit:
            return True
        level = [
            v
            for c in level
            for v in (c.values() if isinstance(c, dict) else c)
            if isinstance(v, (list, dict))
        ]
    return False


def parse_request(data: Any) -> tuple[list[str], list[str], dict[str, list[Any]]]:
    """(prompts, responses, fields) of a ``/score`` body; BadRequest naming what is wrong."""
    if not isinstance(data, dict):
        raise BadRequest("the body must be a JSON object")
    if _deeper_than(data, MAX_DEPTH):
        raise BadRequest(f"the body nests lists and objects more than {MAX_DEPTH} levels deep")
    prompts, responses = _texts(data, "prompts"), _texts(data, "responses")
    if len(prompts) != len(responses):
        raise BadRequest(f"{len(prompts)} prompts for {len(responses)} responses")
    fields = data.get("fields", {})
    if not isinstance(fields, dict):
        raise BadRequest("'fields' must be an object of lists")
    refused = [name for name in fields if name in REFUSED_FIELDS]
    if refused:
        raise BadRequest(
            f"field {_name(refused[0])} has a name a reward's call takes itself "
            f"({', '.join(REFUSED_FIELDS)}): rename the field"
        )
    for name, values in fields.items():
        if not isinstance(values, list) or len(values) != len(responses):
            raise BadRequest(f"field {_name(name)} must be a list of {len(responses)} values")
    return prompts, responses, fields


class ScoreService:
    """The rewards (``(name, reward, weight)`` each, behind their boundary) as the answer
    to one request: what ``/score`` runs on a worker thread."""

    def __init__(self, rewards: list[tuple[str, Any, float]]) -> None:
        from ppokit.trainer.scoring import labels

        self.rewards = rewards
        self.labels = labels([name for name, _, _ in rewards])

    def __call__(self, data: Any) -> dict[str, Any]:
        import torch

        from ppokit.trainer.scoring import score_texts

        prompts, responses, fields = parse_request(data)
        got = score_texts(self.rewards, prompts, responses, fields, torch.device("cpu"))
        scores = got.total.tolist()
        bad = [i for i, v in enumerate(scores) if not math.isfinite(v)]
        if bad:
            raise UserError(f"the rewards scored response {bad[0]} {scores[bad[0]]}: not finite")
        return {
            "scores": scores,
            "parts": {k: v.tolist() for k, v in got.parts.items()},
            "flags": {k: v.tolist() for k, v in got.flags.items()},
        }

    def health(self) -> dict[str, Any]:
        weights = {label: w for label, (_, _, w) in zip(self.labels, self.rewards, strict=True)}
        return {"status": "ok", "rewards": self.labels, "weights": weights}


def _where(scope: Mapping[str, Any]) -> str:
    """The client of a request, ``host:port``."""
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else "-"


def _error(status: int, message: str, close: bool = False) -> Any:
    from starlette.responses import Response

    headers = {"connection": "close"} if close else {}
    if status == 401:
        headers["www-authenticate"] = "Bearer"
    body = json.dumps({"error": message}).encode()  # ASCII: any text the client sent, escaped
    return Response(body, status, headers, media_type="application/json")


def _answer(
    score: Callable[[Any], dict[str, Any]], body: bytearray
) -> tuple[int, bytes | str, int]:
    """(status, the answer's JSON or an error's line, the responses scored) of a ``/score``
    body: its JSON read and scored on the calling (worker) thread."""
    try:
        data = json.loads(body)
    except RecursionError:
        return 400, "the body nests lists and objects deeper than JSON can be read here", 0
    except ValueError as exc:  # UnicodeDecodeError and too long an integer included
        return 400, f"the body is no JSON: {one_line(exc)}", 0
    del body
    try:
        got = score(data)
        scores = got.get("scores") if isinstance(got, dict) else None
        return 200, json.dumps(got, allow_nan=False).encode(), len(scores or ())
    except BadRequest as exc:
        return 400, str(exc), 0
    except UserError as exc:
        return 422, one_line(exc), 0
    except Exception as exc:  # a failure of the server's own: one line, it goes on
        return 500, f"the reward server failed: {one_line(exc)}", 0


def _in_thread() -> Callable[..., Any]:
    """anyio's ``to_thread.run_sync`` that leaves a thread to end on its own when the
    request is cancelled (the server stops): ``abandon_on_cancel`` (``cancellable``
    before anyio 4.1)."""
    import functools
    import inspect

    from anyio import to_thread

    known = inspect.signature(to_thread.run_sync).parameters
    flag = "abandon_on_cancel" if "abandon_on_cancel" in known else "cancellable"
    options: dict[str, Any] = {flag: True}
    return functools.partial(to_thread.run_sync, **options)


def build_app(
    score: Callable[[Any], dict[str, Any]],
    health: Callable[[], dict[str, Any]],
    *,
    max_request_mb: float = MAX_REQUEST_MB,
    concurrency: int = CONCURRENCY,
    max_pending: int = MAX_PENDING,
    max_inflight_mb: float = MAX_INFLIGHT_MB,
    api_key: str | None = None,
    log: Callable[[str], None] | None = None,
) -> Any:
    """The ASGI application of ``/score`` (``score(json) -> answer``: the body read, then
    parsed and scored on a worker thread, ``concurrency`` at once, ``max_pending`` more
    waiting) and ``/health``, every request answered (an error as one JSON line) and, with
    ``log``, told in one line. ``api_key``: the key ``/score`` requires."""
    try:
        import anyio
        from starlette.applications import Starlette
        from starlette.exceptions import HTTPException
        from starlette.requests import ClientDisconnect, Request
        from starlette.responses import JSONResponse, Response
        from starlette.routing import Route
    except ImportError as exc:
        name = exc.name or "starlette"
        raise MissingDependency(name, "ppokit reward-server", SERVE_INSTALL) from None
    limit = int(max_request_mb * 2**20)
    budget = int(max_inflight_mb * 2**20)
    limiter = anyio.CapacityLimiter(concurrency)
    run_sync = _in_thread()
    key = None if api_key is None else api_key.encode()
    held = {"bytes": 0, "requests": 0}  # the bodies in memory; the requests in, not answered
    say = log or (lambda line: None)

    def told(request: Request, status: int, what: str) -> None:
        line = f"{_where(request.scope)} {request.method} {request.scope['path']} {status} {what}"
        say(said(line, 2 * _LONGEST))

    def refuse(request: Request, status: int, message: str, close: bool = False) -> Response:
        told(request, status, message)
        return _error(status, message, close)  # type: ignore[no-any-return]

    def keyed(request: Request) -> bool:
        if key is None:
            return True
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        given = token.strip().encode("latin-1")  # the header's bytes, as they came
        return scheme.lower() == "bearer" and hmac.compare_digest(given, key)

    async def score_route(request: Request) -> Response:
        began = time.monotonic()
        if not keyed(request):
            return refuse(request, 401, "the reward server needs its key: Authorization: "
                          "Bearer KEY (the http reward's api_key_env)", close=True)  # fmt: skip
        too_large = f"the body is larger than {max_request_mb:g} MiB (--max-request-mb)"
        declared = request.headers.get("content-length", "")
        size = int(declared) if declared.isascii() and declared.isdigit() else 0
        if size > limit:
            return refuse(request, 413, too_large, close=True)
        busy = (
            f"the reward server is busy: {max_inflight_mb:g} MiB of request bodies are "
            "held (--max-inflight-mb); try again"
        )
        if held["bytes"] + size > budget:
            return refuse(request, 503, busy, close=True)
        taken = size
        held["bytes"] += taken
        try:
            body = bytearray()
            try:
                async for chunk in request.stream():
                    body += chunk
                    if len(body) > limit:
                        return refuse(request, 413, too_large, close=True)
                    if len(body) > taken:  # more than it declared (chunked)
                        more = len(body) - taken
                        if held["bytes"] + more > budget:
                            return refuse(request, 503, busy, close=True)
                        held["bytes"] += more
                        taken += more
            except ClientDisconnect:
                if not request.scope.get(CLOSED):  # else the guard told why it closed it
                    told(request, 499, "the client left before sending its body in full")
                return Response(status_code=499)  # to no one: the client is gone
            if held["requests"] >= concurrency + max_pending:
                return refuse(request, 503, f"the reward server is busy: {concurrency} "
                              f"requests are scored and {max_pending} wait (--max-pending); "
                              "try again")  # fmt: skip
            held["requests"] += 1
            try:
                status, out, n = await run_sync(_answer, score, body, limiter=limiter)
            finally:
                held["requests"] -= 1
        finally:
            held["bytes"] -= taken
        if status != 200:
            assert isinstance(out, str)
            return refuse(request, status, _served(out))
        told(request, 200, f"{n} responses in {time.monotonic() - began:.3f} s")
        return Response(out, media_type="application/json")

    async def health_route(request: Request) -> Response:
        told(request, 200, "ok")
        return JSONResponse(health() if keyed(request) else {"status": "ok"})

    async def elsewhere(request: Request, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, HTTPException) else 500
        if status == 500:  # the wrapper below tells it, once
            return _error(500, f"the reward server failed: {one_line(exc)}")  # type: ignore[no-any-return]
        return refuse(
            request,
            status,
            f"the reward server answers POST /score and GET /health, not "
            f"{clipped(request.method, 20)} {clipped(request.scope['path'], 80)}",
        )

    inner = Starlette(
        routes=[
            Route("/score", score_route, methods=["POST"]),
            Route("/health", health_route, methods=["GET"]),
        ],
        exception_handlers={HTTPException: elsewhere, Exception: elsewhere},
    )
    stopped = asyncio.CancelledError  # uvicorn's loop is asyncio's

    async def app(scope: Any, receive: Any, send: Any) -> None:
        """``inner``, with whatever escapes it one line: a request cancelled because the
        server stops is answered 503, anything else 500 (starlette's handler answered)."""
        if scope["type"] != "http":
            return await inner(scope, receive, send)
        started = False

        async def sending(message: Any) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await inner(scope, receive, sending)
        except (Exception, stopped) as exc:
            where = f"{_where(scope)} {scope.get('method')} {scope.get('path')}"
            if isinstance(exc, stopped):
                line = "the reward server is stopping"
                status = 503
            else:
                line, status = f"the reward server failed: {one_line(exc)}", 500
            say(said(f"{where} {status} {line}", 2 * _LONGEST))
            if not started:
                response = _error(status, line, close=True)
                with contextlib.suppress(Exception):  # the connection is gone
                    await response(scope, receive, send)

    return app


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: a free one); one line when taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise UserError(f"reward-server: cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.listen(128)
    return sock


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (or ``localhost``): only this machine reaches it."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve(
    app: Any,
    sock: socket.socket,
    *,
    max_connections: int = MAX_CONNECTIONS,
    read_timeout: float = READ_TIMEOUT,
    shutdown_timeout: float = SHUTDOWN_SECONDS,
    log: Callable[[str], None] | None = None,
) -> None:
    """Run ``app`` on the bound ``sock`` (connections guarded: the module's docstring) until
    SIGINT or SIGTERM; then no new connection is taken, the requests in flight are answered,
    those not answered within ``shutdown_timeout`` seconds with a 503 (a second SIGINT:
    at once), and it returns."""
    try:
        import uvicorn
    except ImportError:
        raise MissingDependency("uvicorn", "ppokit reward-server", SERVE_INSTALL) from None

    class Stopping(uvicorn.Server):
        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            loop = asyncio.get_running_loop()
            late = loop.call_later(shutdown_timeout, self.answer_now)
            try:
                await super().shutdown(sockets=sockets)
            finally:
                late.cancel()

        def answer_now(self) -> None:
            """Cancel the requests in flight: each is answered 503 (``build_app``)."""
            for task in list(self.server_state.tasks):
                task.cancel()

    config = uvicorn.Config(
        app,
        http=guarded(Connections(max_connections, read_timeout, log or (lambda line: None))),
        timeout_keep_alive=min(5, math.ceil(read_timeout)),
        timeout_graceful_shutdown=math.ceil(shutdown_timeout) + 5,  # after answer_now's
        lifespan="off",
        log_level="error",
        access_log=False,
        proxy_headers=False,
        server_header=False,
    )
    # uvicorn stops on SIGINT/SIGTERM and then raises the signal again for the handlers it
    # found: these take it, so the process goes on to exit with status 0
    stopped = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        Stopping(config).run(sockets=[sock])
    finally:
        for sig, handler in stopped.items():
            signal.signal(sig, handler)


def _log(line: str) -> None:
    """One line of the server's log, on stderr."""
    sys.stderr.write(f"{time.strftime('%H:%M:%S')} {line}\n")
    sys.stderr.flush()


def load_rewards(target: str, params: list[str], overrides: list[str]) -> Any:
    """The spec that holds what to serve: the spec file ``target`` (with ``overrides``),
    or a spec of the one reward named ``target`` with its ``params`` (``KEY=VALUE``, the
    value read as YAML)."""
    from pathlib import Path

    import yaml

    from ppokit.spec import apply_overrides, load_spec, validate_spec

    path = Path(target)
    if path.is_file():
        if params:
            raise UserError("reward-server: --param sets a named reward's parameters; a spec "
                            "file's rewards are set in it (or with --set)")  # fmt: skip
        return load_spec(path, overrides)
    reward: dict[str, Any] = {"name": target}
    for item in params:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UserError(f"reward-server: --param {item!r}: expected KEY=VALUE")
        try:
            reward[key.strip()] = yaml.safe_load(value)
        except yaml.YAMLError as exc:
            raise UserError(f"reward-server: --param {item!r}: {one_line(exc)}") from None
    return validate_spec(apply_overrides({"reward": reward}, overrides))


def reward_server_command(
    target: str = typer.Argument(
        ...,
        metavar="SPEC_OR_REWARD",
        help="A spec file (its rewards, weighted, are served) or a reward component's name.",
    ),
    params: list[str] = typer.Option(
        [], "--param", "-p", help="KEY=VALUE: a parameter of the named reward (repeatable)."
    ),
    overrides: list[str] = typer.Option(
        [], "--set", "-s", help="Override a spec value: path=value (repeatable)."
    ),
    host: str = typer.Option(
        "127.0.0.1",
        "--host",
        help="Address to listen on (loopback; beyond it, a key or --allow-no-key).",
    ),
    port: int = typer.Option(8000, "--port", min=0, max=65535, help="Port (0: a free one)."),
    api_key_env: str | None = typer.Option(
        None,
        "--api-key-env",
        metavar="VAR",
        help="The environment variable holding the key /score requires (Authorization: "
        "Bearer KEY, as the http reward's api_key_env sends it).",
    ),
    allow_no_key: bool = typer.Option(
        False,
        "--allow-no-key",
        help="Listen beyond loopback without a key: anyone who reaches the port can ask "
        "for scores.",
    ),
    concurrency: int = typer.Option(
        CONCURRENCY, "--concurrency", min=1, help="Requests parsed and scored at once (threads)."
    ),
    max_pending: int = typer.Option(
        MAX_PENDING,
        "--max-pending",
        min=0,
        help="Requests, their bodies in, that may wait beyond those (then: 503).",
    ),
    max_request_mb: float = typer.Option(
        MAX_REQUEST_MB, "--max-request-mb", min=0.001, help="The largest request body (then: 413)."
    ),
    max_inflight_mb: float = typer.Option(
        MAX_INFLIGHT_MB,
        "--max-inflight-mb",
        min=0.001,
        help="Request bodies held at once, being read, waiting or scored (then: 503).",
    ),
    max_connections: int = typer.Option(
        MAX_CONNECTIONS,
        "--max-connections",
        min=2,
        help="Connections open at once (then: the one waiting longest on its client is closed).",
    ),
    read_timeout: float = typer.Option(
        READ_TIMEOUT,
        "--read-timeout",
        min=0.01,
        help="Seconds a client has to send a request in full from its connection's start "
        "or its previous answer (then: 408, closed; an answer not taken by then is dropped).",
    ),
    shutdown_timeout: float = typer.Option(
        SHUTDOWN_SECONDS,
        "--shutdown-timeout",
        min=0.0,
        help="Seconds a stopping server answers the requests in flight (then: 503).",
    ),
) -> None:
    """Serve rewards over HTTP for the http reward of runs elsewhere: POST /score, GET
    /health. Ctrl-C or SIGTERM stops it after the requests in flight."""
    from ppokit.errors import error_lines, fail
    from ppokit.registry import RegistryError
    from ppokit.spec import SpecError

    key: str | None = None
    try:
        if max_connections <= concurrency + max_pending:
            raise UserError(
                f"reward-server: --max-connections ({max_connections}) must exceed "
                f"--concurrency + --max-pending ({concurrency + max_pending})"
            )
        if max_inflight_mb < max_request_mb:
            raise UserError(
                f"reward-server: --max-inflight-mb ({max_inflight_mb:g}) must be at least "
                f"--max-request-mb ({max_request_mb:g})"
            )
        if api_key_env is not None:
            key = os.environ.get(api_key_env) or None
            if key is None:
                raise UserError(
                    f"reward-server: --api-key-env {api_key_env}: the environment variable "
                    "is not set (or empty)"
                )
        if key is None and not allow_no_key and not is_loopback(host):
            raise UserError(
                f"reward-server: --host {host} listens beyond loopback, where anyone who "
                "reaches the port could ask for scores: set a key with --api-key-env VAR "
                "(the http reward's api_key_env), or pass --allow-no-key"
            )
        spec = load_rewards(target, params, overrides)
        from ppokit.trainer.assembly import rewards_of

        service = ScoreService(rewards_of(spec))
        app = build_app(
            service,
            service.health,
            max_request_mb=max_request_mb,
            concurrency=concurrency,
            max_pending=max_pending,
            max_inflight_mb=max_inflight_mb,
            api_key=key,
            log=_log,
        )
        sock = bind(host, port)
    except (UserError, SpecError, RegistryError, FileNotFoundError) as exc:
        raise fail(error_lines(exc)) from None
    where = sock.getsockname()
    url = f"http://{host if ':' not in host else f'[{host}]'}:{where[1]}"
    served = " + ".join(f"{w:g}·{label}" for label, w in service.health()["weights"].items())
    keyed = ", key required" if key is not None else ""
    typer.echo(f"ppokit reward-server: {served} on {url} (POST /score, GET /health{keyed})")
    if not is_loopback(host):
        if key is None:
            typer.echo(
                f"warning: listening on {host} without a key: anyone who reaches it can ask "
                "for scores",
                err=True,
            )
        else:
            typer.echo(
                f"warning: listening on {host} over plain HTTP: the key crosses the network "
                "readable; keep it on a network you trust, or put TLS in front",
                err=True,
            )
    try:
        serve(
            app,
            sock,
            max_connections=max_connections,
            read_timeout=read_timeout,
            shutdown_timeout=shutdown_timeout,
            log=_log,
        )
    finally:
        sock.close()
        for _, reward, _ in service.rewards:  # a call still in its worker (one that hangs) ends
            close = getattr(reward, "close", None)
            if close is not None:
                close()
    typer.echo("ppokit reward-server: stopped")
