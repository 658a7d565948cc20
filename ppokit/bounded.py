"""Calls waited for at most a bound: :func:`run_bounded`, the one way ppokit runs code it
does not control (a plugin's import, a reward, an environment, a weight push) under a
timeout; and :func:`in_threads`, the one way calls that wait on something else (a server,
a sandbox) run several at once."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

__all__ = ["TimedOut", "in_threads", "run_bounded"]

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


def in_threads(
    fn: Callable[[Any], T],
    items: Sequence[Any],
    workers: int,
    name: str,
    stop: type[BaseException] | None = None,
) -> list[T | Exception]:
    """``fn(item)`` for each item on at most ``workers`` threads called ``name``, the
    results in the items' order whatever order they end in. An exception an item's call
    raises takes its place in the list; one of type ``stop`` is raised instead (the first
    in the items' order), and the calls not yet started are cancelled (those running end
    on their own, each bounded by its own timeout)."""
    pool = ThreadPoolExecutor(max(1, workers), thread_name_prefix=name)
    futures = [pool.submit(fn, item) for item in items]
    out: list[T | Exception] = []
    try:
        for future in futures:
            try:
                out.append(future.result())
            except Exception as exc:
                if stop is not None and isinstance(exc, stop):
                    raise
                out.append(exc)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    return out
