"""Errors a user can cause. The CLI prints their message on one line and exits non-zero."""

from __future__ import annotations

import contextlib
import unicodedata
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import typer


class UserError(Exception):
    """A problem the user can fix (bad input, missing optional dependency, bad checkpoint)."""


class MissingDependency(UserError):
    """An optional dependency is not installed; the message says how to install it."""

    def __init__(self, package: str, purpose: str, install: str | None = None) -> None:
        install = install or f"pip install {package}"
        super().__init__(f"{purpose} needs the '{package}' package: {install}")
        self.package = package


class ComponentError(UserError):
    """A component broke its kind's contract at the trainer's boundary (wrong type, shape,
    dtype, a gradient where none belongs) or failed to start; the message names its slot,
    the component and its plugin."""


class ComponentTimeout(ComponentError):
    """A reward or environment call did not return within its bound
    (``train.reward_timeout``, ``rollout.environment_timeout``)."""


class NonFiniteError(UserError):
    """A NaN or infinite reward, estimate, loss or gradient norm stopped the run before it
    reached the parameters; the message names the round and where it appeared."""


def printable(text: str) -> str:
    """``text`` with every control character but newline and tab (terminal escape codes,
    carriage returns, bidirectional overrides, line separators) written as a Python escape
    (``\\x1b``): text that plugins or data provide cannot drive the terminal it is shown on."""
    return "".join(
        c
        if c in "\n\t" or unicodedata.category(c) not in ("Cc", "Cf", "Zl", "Zp")
        else ascii(c)[1:-1]
        for c in text
    )


def clipped(text: str, limit: int) -> str:
    """``text`` in at most ``limit`` characters: cut, ``...`` at its end, when longer."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def said(text: str, limit: int = 200) -> str:
    """What another program said (a server, the system, a client), as part of one line: its
    whitespace collapsed, its control characters escaped (:func:`printable`), at most
    ``limit`` characters (:func:`clipped`)."""
    return clipped(printable(" ".join(text.split())), limit)


def one_line(exc: BaseException) -> str:
    """An exception as one line of an error message: ``Type: message``, the message's
    whitespace (newlines included) collapsed and its control characters escaped
    (:func:`printable`); the type alone when the message is empty."""
    text = " ".join(str(exc).split())
    return printable(f"{type(exc).__name__}: {text}" if text else type(exc).__name__)


def error_lines(exc: BaseException) -> list[str]:
    """What a command prints for an error the user caused: a spec error's lines, each
    prefixed with the spec's path; else ``error: <message>``, its first line only."""
    errors = getattr(exc, "errors", None)
    if isinstance(errors, list) and hasattr(exc, "source"):  # a SpecError
        where = f"{exc.source}: " if exc.source else ""
        return [f"{where}{e}" for e in errors] or [f"{where}invalid spec"]
    if isinstance(exc, FileNotFoundError):
        return [f"error: file not found: {exc.filename or exc}"]
    return [f"error: {exc}".splitlines()[0]]


def fail(lines: str | list[str], code: int = 1) -> typer.Exit:
    """Print each line in red on stderr; return the ``typer.Exit(code)`` to raise."""
    import typer
    from rich.console import Console
    from rich.markup import escape

    err = Console(stderr=True, highlight=False, soft_wrap=True)
    for line in [lines] if isinstance(lines, str) else lines:
        err.print(f"[red]{escape(printable(line))}[/red]")
    return typer.Exit(code)


def raised_at(exc: BaseException) -> str | None:
    """``file:line`` where ``exc`` was raised: the innermost frame of its traceback outside
    Python's standard library (the code that raised it, or called the library function that
    did), relative to the working directory when under it; None without a traceback."""
    import os
    import sysconfig
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return None
    stdlib = tuple(
        os.path.join(os.path.realpath(sysconfig.get_paths()[k]), "")
        for k in ("stdlib", "platstdlib")
    )

    def library(filename: str) -> bool:
        return filename.startswith("<frozen") or (
            not filename.startswith("<") and os.path.realpath(filename).startswith(stdlib)
        )

    frame = next((f for f in reversed(frames) if not library(f.filename)), frames[-1])
    path = frame.filename
    with contextlib.suppress(ValueError):
        relative = os.path.relpath(path)
        if not relative.startswith(".."):
            path = relative
    return f"{path}:{frame.lineno}"


#: The environment switch (``ppokit --traceback`` sets it) that shows the full traceback of
#: an error, behind its one line: for the authors of plugins and of ppokit.
TRACEBACK = "PPOKIT_TRACEBACK"


def tracebacks_on() -> bool:
    """Whether PPOKIT_TRACEBACK asks for full tracebacks (1/true/yes/on)."""
    import os

    return os.environ.get(TRACEBACK, "").strip().lower() in ("1", "true", "yes", "on")


def full_traceback(exc: BaseException) -> str:
    """``exc``'s traceback with its causes, and the traceback of each cause that was raised
    in a worker process (its ``remote_traceback``)."""
    import traceback

    parts = ["".join(traceback.format_exception(type(exc), exc, exc.__traceback__))]
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        remote = getattr(cause, "remote_traceback", None)
        if isinstance(remote, str) and remote:
            parts.append(f"in the worker process:\n{remote}")
        cause = cause.__cause__ or cause.__context__
    return "\n".join(parts)
