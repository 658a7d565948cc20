"""``ppokit reward-server``: a spec's rewards, or one reward component with its parameters,
served over HTTP (starlette on uvicorn), for the ``http`` reward of runs elsewhere.

``POST /score`` takes ``{"prompts": [...], "responses": [...], "fields": {name: [...]}}``
(one entry per response in each list: the data's columns, ``lengths``, ``truncated``) and
answers ``{"scores": [...], "parts": {reward: [...]}, "flags": {"reward/flag": [...]}}``:
R = Σ_k w_k r_k, each reward's own scores, and the flags the rewards raised (0 or 1).
``GET /health`` answers ``{"status": "ok", "rewards": [...], "weights": {...}}``.

Bounded: a request body larger than ``max_request_mb`` is refused (413) before it is read
in full; at most ``concurrency`` requests are scored at once (each reward call under the
spec's ``train.reward_timeout``) and at most ``max_pending`` more wait (beyond: 503). A
malformed request is a 400 and a reward's error a 422, each with ``{"error": "one line"}``.
SIGINT or SIGTERM stops it cleanly: no new connection is taken, the requests in flight are
answered (for at most ``SHUTDOWN_SECONDS``), then the process exits with status 0. It listens
on loopback unless told otherwise.
"""

from __future__ import annotations

import math
import signal
import socket
from collections.abc import Callable
from typing import Any

import typer

from ppokit.components.reward import SERVE_INSTALL
from ppokit.errors import MissingDependency, UserError, one_line

__all__ = [
    "SHUTDOWN_SECONDS",
    "BadRequest",
    "ScoreService",
    "bind",
    "build_app",
    "load_rewards",
    "parse_request",
    "reward_server_command",
    "serve",
]

#: How long a stopping server answers the requests in flight.
SHUTDOWN_SECONDS = 30


class BadRequest(ValueError):
    """A request that breaks the protocol (HTTP 400)."""


def _texts(data: dict[str, Any], key: str) -> list[str]:
    value = data.get(key)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise BadRequest(f"'{key}' must be a list of strings")
    return value


def parse_request(data: Any) -> tuple[list[str], list[str], dict[str, list[Any]]]:
    """(prompts, responses, fields) of a ``/score`` body; BadRequest naming what is wrong."""
    if not isinstance(data, dict):
        raise BadRequest("the body must be a JSON object")
    prompts, responses = _texts(data, "prompts"), _texts(data, "responses")
    if len(prompts) != len(responses):
        raise BadRequest(f"{len(prompts)} prompts for {len(responses)} responses")
    fields = data.get("fields", {})
    if not isinstance(fields, dict):
        raise BadRequest("'fields' must be an object of lists")
    for name, values in fields.items():
        if not isinstance(values, list) or len(values) != len(responses):
            raise BadRequest(f"field {name!r} must be a list of {len(responses)} values")
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


def build_app(
    score: Callable[[Any], dict[str, Any]],
    health: Callable[[], dict[str, Any]],
    *,
    max_request_mb: float,
    concurrency: int,
) -> Any:
    """The starlette application of ``/score`` (``score(json) -> answer``, on a worker
    thread, ``concurrency`` at once) and ``/health``."""
    try:
        import anyio
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import JSONResponse
        from starlette.routing import Route
    except ImportError as exc:
        name = exc.name or "starlette"
        raise MissingDependency(name, "ppokit reward-server", SERVE_INSTALL) from None
    limit = int(max_request_mb * 2**20)
    limiter = anyio.CapacityLimiter(concurrency)

    def error(status: int, message: str) -> JSONResponse:
        return JSONResponse({"error": message}, status_code=status)

    async def score_route(request: Request) -> JSONResponse:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return error(413, f"the body is larger than {max_request_mb:g} MiB")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                return error(413, f"the body is larger than {max_request_mb:g} MiB")
        try:
            import json

            data = json.loads(body)
        except ValueError as exc:
            return error(400, f"the body is no JSON: {one_line(exc)}")
        try:
            answer = await anyio.to_thread.run_sync(score, data, limiter=limiter)
        except BadRequest as exc:
            return error(400, str(exc))
        except UserError as exc:
            return error(422, one_line(exc))
        except Exception as exc:  # a reward's own failure: one line, the server goes on
            return error(500, one_line(exc))
        return JSONResponse(answer)

    async def health_route(request: Request) -> JSONResponse:
        return JSONResponse(health())

    return Starlette(
        routes=[
            Route("/score", score_route, methods=["POST"]),
            Route("/health", health_route, methods=["GET"]),
        ]
    )


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


def serve(app: Any, sock: socket.socket, *, concurrency: int, max_pending: int) -> None:
    """Run ``app`` on the bound ``sock`` until SIGINT or SIGTERM (uvicorn's handlers: the
    requests in flight are answered, at most ``SHUTDOWN_SECONDS``), then return."""
    try:
        import uvicorn
    except ImportError:
        raise MissingDependency("uvicorn", "ppokit reward-server", SERVE_INSTALL) from None
    config = uvicorn.Config(
        app,
        limit_concurrency=concurrency + max_pending,
        timeout_graceful_shutdown=SHUTDOWN_SECONDS,
        lifespan="off",
        log_level="warning",
        access_log=False,
    )
    # uvicorn stops on SIGINT/SIGTERM and then raises the signal again for the handlers it
    # found: these take it, so the process goes on to exit with status 0
    stopped = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        for sig, handler in stopped.items():
            signal.signal(sig, handler)


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
        "127.0.0.1", "--host", help="Address to listen on (loopback; 0.0.0.0: every network)."
    ),
    port: int = typer.Option(8000, "--port", min=0, max=65535, help="Port (0: a free one)."),
    concurrency: int = typer.Option(
        2, "--concurrency", min=1, help="Requests scored at once (threads)."
    ),
    max_pending: int = typer.Option(
        64, "--max-pending", min=0, help="Requests that may wait beyond those (then: 503)."
    ),
    max_request_mb: float = typer.Option(
        16.0, "--max-request-mb", min=0.001, help="The largest request body (then: 413)."
    ),
) -> None:
    """Serve rewards over HTTP for the http reward of runs elsewhere: POST /score, GET
    /health. Ctrl-C or SIGTERM stops it after the requests in flight."""
    from ppokit.errors import error_lines, fail
    from ppokit.registry import RegistryError
    from ppokit.spec import SpecError

    try:
        spec = load_rewards(target, params, overrides)
        from ppokit.trainer.assembly import rewards_of

        service = ScoreService(rewards_of(spec))
        app = build_app(
            service, service.health, max_request_mb=max_request_mb, concurrency=concurrency
        )
        sock = bind(host, port)
    except (UserError, SpecError, RegistryError, FileNotFoundError) as exc:
        raise fail(error_lines(exc)) from None
    where = sock.getsockname()
    url = f"http://{host if ':' not in host else f'[{host}]'}:{where[1]}"
    served = " + ".join(f"{w:g}·{label}" for label, w in service.health()["weights"].items())
    typer.echo(f"ppokit reward-server: {served} on {url} (POST /score, GET /health)")
    if host not in ("127.0.0.1", "::1", "localhost"):
        typer.echo(f"warning: listening on {host}: anyone who reaches it can ask for scores")
    try:
        serve(app, sock, concurrency=concurrency, max_pending=max_pending)
    finally:
        sock.close()
    typer.echo("ppokit reward-server: stopped")
