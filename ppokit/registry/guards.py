"""The guards around a plugin's code while it loads: a print, a write to file descriptor 1
and ``os._exit`` cannot take the command line down with it."""

from __future__ import annotations

import contextlib
import io
import os
import sys
from collections.abc import Iterator
from typing import NoReturn


class PluginExit(Exception):
    """A plugin called ``os._exit`` while it loaded."""


#: What a plugin may raise while it loads without taking the command line down with it
#: (``sys.exit`` and ``os._exit`` included); KeyboardInterrupt still stops the program.
PLUGIN_ERRORS = (Exception, SystemExit)


class PluginPrinted(RuntimeError):
    """A plugin wrote to standard output while it loaded (which would corrupt JSON output)."""


@contextlib.contextmanager
def isolated_output() -> Iterator[None]:
    """Run plugin code with standard output captured: anything it prints raises
    :class:`PluginPrinted` (the text goes to standard error)."""
    buffer = io.StringIO()
    try:
        with contextlib.redirect_stdout(buffer):
            yield
    finally:
        text = buffer.getvalue()
        if text:
            sys.stderr.write(text)
    if text:
        first = text.strip().splitlines()[0][:80] if text.strip() else repr(text[:20])
        raise PluginPrinted(f"wrote to standard output while loading: {first!r}")


@contextlib.contextmanager
def stdout_fd_to_stderr() -> Iterator[None]:
    """File descriptor 1 points to standard error for the block (what code writes to it
    directly, ``os.write(1, ...)`` or a C library's ``printf``, cannot corrupt a command's
    JSON output); put back after."""
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:  # no standard output to protect
        yield
        return
    try:
        with contextlib.suppress(OSError):
            os.dup2(2, 1)
        yield
    finally:
        flush_c_streams()  # what C code buffered for fd 1 goes where fd 1 pointed
        os.dup2(saved, 1)
        os.close(saved)


def flush_c_streams() -> None:
    """The C library's ``fflush(NULL)``, where there is one (best effort)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None).fflush(None)


@contextlib.contextmanager
def exit_refused() -> Iterator[None]:
    """``os._exit`` raises :class:`PluginExit` for the block instead of ending the process
    (``sys.exit`` raises ``SystemExit``, which the callers catch)."""
    real = os._exit

    def refuse(status: int) -> NoReturn:
        raise PluginExit(f"called os._exit({status}) while loading")

    os._exit = refuse
    try:
        yield
    finally:
        os._exit = real


@contextlib.contextmanager
def guarded() -> Iterator[None]:
    """The guards around plugin code run while plugins load: standard output captured (a
    print is an error), file descriptor 1 sent to standard error, ``os._exit`` refused."""
    with stdout_fd_to_stderr(), exit_refused(), isolated_output():
        yield
