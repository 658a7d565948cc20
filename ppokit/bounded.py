"""Bounded calls: the one place where ppokit runs code it does not control under a time limit.

Two ways, for two kinds of code:

- **In a worker process** (:class:`ppokit.workers.WorkerPool`): rewards and environments,
  whose inputs and outputs are text and numbers. A call that runs over is stopped for real:
  its process is killed and replaced. This is the bound that holds whatever the code does.
- **In this process** (:func:`deadline`): code that works on the trainer's own objects (a
  rollout engine's ``generate`` and ``sync`` on the actor, a group filter or a correction on
  tensors of the device, a plugin's import) cannot move to another process. On the main
  thread, ``SIGALRM`` raises :class:`TimedOut` inside the block at the bound (Python code,
  ``time.sleep``, any C code that lets signal handlers run); and in case the block holds the
  interpreter in C code and never lets the handler run, :mod:`faulthandler`'s watchdog (a C
  thread that needs no GIL) writes every thread's stack to standard error and ends the
  process with status 1 :data:`GRACE` seconds later. Off the main thread a deadline bounds
  nothing (ppokit's commands run their bounded calls on the main thread).

:func:`counting_interrupts` tells a Ctrl-C from a ``KeyboardInterrupt`` that code raised
itself (:func:`interrupts` counts the former); :func:`holding_interrupts` holds one to the end
of a block (work that must not be left half done), :func:`terminating_as_interrupt` makes
SIGTERM one. :func:`in_threads` is the one way calls that
wait on something else (a server, a sandbox) run several at once, each bounded by its own
timeout, and :class:`Threads` the one way such a call runs while the caller goes on (its
result asked for later).

This module is torch-free and imports nothing of ppokit.
"""

from __future__ import annotations

import contextlib
import faulthandler
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = [
    "GRACE",
    "Started",
    "Threads",
    "TimedOut",
    "counting_interrupts",
    "deadline",
    "holding_interrupts",
    "in_threads",
    "interrupts",
    "terminating_as_interrupt",
]

T = TypeVar("T")

#: Seconds after a deadline's bound before the process is ended, when the block never let
#: the signal handler run.
GRACE = 10.0


class TimedOut(Exception):
    """A bounded call did not finish in time (its worker was killed, or :func:`deadline`
    interrupted it)."""


@dataclass
class _Open:
    end: float  # time.monotonic() at the bound
    seconds: float
    what: str
    grace: float


#: The deadlines open on the main thread, outermost first.
_OPEN: list[_Open] = []
_PREVIOUS: list[Any] = []  # the SIGALRM handler before the first deadline opened


def _expired(signum: int, frame: Any) -> None:
    now = time.monotonic()
    due = [d for d in _OPEN if d.end <= now + 1e-3]
    if not due:  # early (a timer's rounding): wait for the rest
        _arm()
        return
    first = min(due, key=lambda d: d.end)
    raise TimedOut(f"{first.what} did not finish within {first.seconds:g} s")


def _arm() -> None:
    """Set the timer and the watchdog for the earliest open deadline, or clear both."""
    if not _OPEN:
        signal.setitimer(signal.ITIMER_REAL, 0)
        faulthandler.cancel_dump_traceback_later()
        if _PREVIOUS:
            signal.signal(signal.SIGALRM, _PREVIOUS.pop())
        return
    if not _PREVIOUS:
        _PREVIOUS.append(signal.signal(signal.SIGALRM, _expired))
    first = min(_OPEN, key=lambda d: d.end)
    left = max(first.end - time.monotonic(), 1e-3)
    signal.setitimer(signal.ITIMER_REAL, left)
    with contextlib.suppress(Exception):  # no usable standard error: the signal alone
        faulthandler.dump_traceback_later(left + first.grace, exit=True, file=sys.stderr)


@contextlib.contextmanager
def deadline(seconds: float | None, what: str, grace: float = GRACE) -> Iterator[None]:
    """The block, bounded to ``seconds`` (None: unbounded): :class:`TimedOut` ("``what`` did
    not finish within N s") is raised inside it at the bound; if the block does not let that
    happen, the process ends ``grace`` seconds later (module docstring). Deadlines nest: the
    earliest bound holds. Main thread only; elsewhere the block runs unbounded."""
    usable = (
        seconds is not None
        and hasattr(signal, "setitimer")
        and threading.current_thread() is threading.main_thread()
    )
    if not usable:
        yield
        return
    assert seconds is not None
    entry = _Open(time.monotonic() + seconds, seconds, what, grace)
    _OPEN.append(entry)
    try:
        _arm()
        yield
    finally:
        try:
            signal.setitimer(signal.ITIMER_REAL, 0)  # first: no signal lands in the cleanup
        finally:
            _OPEN.remove(entry)
            _arm()


_SIGINTS = [0]


@dataclass
class _Hold:
    when: Callable[[], bool]
    told: Callable[[], None]
    held: bool = False


#: The :func:`holding_interrupts` blocks open on the main thread, outermost first.
_HOLDS: list[_Hold] = []


def _on_sigint(signum: int, frame: Any) -> None:
    _SIGINTS[0] += 1
    hold = _HOLDS[-1] if _HOLDS else None
    if hold is not None and not hold.held and hold.when():
        hold.held = True
        hold.told()
        return
    raise KeyboardInterrupt


def interrupts() -> int:
    """How many Ctrl-C (SIGINT) arrived inside :func:`counting_interrupts` blocks so far: a
    ``KeyboardInterrupt`` caught while this did not change was raised by code itself."""
    return _SIGINTS[0]


@contextlib.contextmanager
def counting_interrupts() -> Iterator[None]:
    """For the block, SIGINT raises ``KeyboardInterrupt`` as Python's own handler does and
    is counted (:func:`interrupts`); main thread only, and not where SIGINT is ignored
    (elsewhere nothing changes)."""
    main = threading.current_thread() is threading.main_thread()
    if not main or signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        yield
        return
    previous = signal.signal(signal.SIGINT, _on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def terminating_as_interrupt() -> Iterator[None]:
    """For the block, SIGTERM (a scheduler's stop) is a Ctrl-C: it raises
    ``KeyboardInterrupt`` (counted, held by :func:`holding_interrupts`); main thread only."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def holding_interrupts(when: Callable[[], bool], told: Callable[[], None]) -> Iterator[None]:
    """For the block (inside :func:`counting_interrupts`), the first Ctrl-C that arrives
    while ``when()`` is true is held: ``told()`` is called at once and ``KeyboardInterrupt``
    is raised when the block ends (a block that raises ends with its own exception); a
    second Ctrl-C raises at once."""
    hold = _Hold(when, told)
    _HOLDS.append(hold)
    try:
        yield
    finally:
        _HOLDS.remove(hold)
    if hold.held:
        raise KeyboardInterrupt


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


class Started:
    """A call begun on :class:`Threads`: :meth:`result` waits for it (what it raised is
    raised there), :meth:`cancel` drops it if it has not begun."""

    def __init__(self, future: Future[Any]) -> None:
        self._future = future

    def result(self) -> Any:
        return self._future.result()

    def cancel(self) -> None:
        self._future.cancel()


class Threads:
    """At most ``workers`` threads called ``name`` for calls that wait on something else
    (each bounded by its own timeout, or its worker process's), run while the caller goes
    on: :meth:`start` begins one. :meth:`close` drops the calls not begun; one under way
    ends on its own bound (a Ctrl-C on the caller's thread is not held up by it)."""

    def __init__(self, workers: int, name: str) -> None:
        self._pool = ThreadPoolExecutor(max(1, workers), thread_name_prefix=name)

    def start(self, fn: Callable[..., Any], *args: Any) -> Started:
        return Started(self._pool.submit(fn, *args))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
