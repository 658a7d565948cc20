"""Calls waited for at most a bound: :func:`run_bounded`, the one way ppokit runs code it
does not control (a plugin's import, a reward, an environment, a weight push) under a
timeout."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TypeVar

__all__ = ["TimedOut", "run_bounded"]

T = TypeVar("T")


class TimedOut(Exception):
    """A call run by :func:`run_bounded` did not finish in time (it goes on in the
    background, on a daemon thread)."""


def run_bounded(fn: Callable[[], T], timeout: float | None, name: str) -> T:
    """``fn()`` on a daemon thread called ``name``, waited for at most ``timeout`` seconds
    (``None``: called here, unbounded); :class:`TimedOut` when it runs over. Whatever ``fn``
    raises (``SystemExit`` included) is raised here. A Python thread cannot be killed: an
    overrunning call goes on in the background, and being a daemon thread it does not keep
    the process from exiting."""
    if timeout is None:
        return fn()
    future: Future[T] = Future()

    def run() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn())
        except BaseException as exc:  # handed to the waiting thread
            future.set_exception(exc)

    threading.Thread(target=run, name=name, daemon=True).start()
    try:
        return future.result(timeout)
    except FutureTimeout:
        raise TimedOut(f"did not finish within {timeout:g} s") from None
