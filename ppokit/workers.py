"""Worker processes for code ppokit does not control: a :class:`WorkerPool` of processes that
each hold their own copy of one object (a reward, an environment) and answer calls of it, so
that a call can be stopped for real, whatever it does (C code that holds the GIL included).

A call that runs over its timeout has its process killed (SIGKILL): :class:`TimedOut` is
raised, and the pool starts a fresh process, from the object as it was first sent, at its
next call. A call that raises comes back as :class:`Raised` (the exception's type, its one
line, where it was raised, its traceback text; the exception itself when it can cross), one
whose process dies (``os._exit``, a signal) as :class:`WorkerDied`. ``SystemExit`` and
``KeyboardInterrupt`` raised by the code are exceptions like any other there.

**What crosses is pickled.** The object once a process start (with ``cloudpickle``: a
function or class defined in a script or inside a function crosses by value, one of an
importable module by reference and is imported again in the worker); each call's method name,
arguments and result with the standard pickle. So a worker works on its own copies: what a
call changes in its arguments stays in the worker (return what the caller needs), and what it
keeps on ``self`` stays in that process, lost when it is killed. A pool of several processes
spreads :meth:`WorkerPool.map`'s calls over them: the state of one process is not the others'.

**Processes.** Every worker is forked from multiprocessing's ``forkserver`` (one server a
Python process, started by the first pool with torch imported, so a worker starts in
milliseconds and never inherits the trainer's threads or CUDA context), with the parent's
``sys.path`` but not its main module: a worker's code crosses by reference to an importable
module or by value, so the script that started the run is not imported again (it needs no
``if __name__ == "__main__"`` guard). A worker ignores Ctrl-C (its caller stops it) and ends with the process that
started it (on Linux by the parent-death signal, elsewhere at its next read).

Torch-free itself; ``cloudpickle`` is imported when a pool starts.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import sys
import tempfile
import threading
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from multiprocessing import connection, get_context, util
from typing import Any

from ppokit.bounded import TimedOut
from ppokit.children import die_with_parent
from ppokit.errors import one_line, raised_at

__all__ = [
    "PRELOAD",
    "START_TIMEOUT",
    "Call",
    "Raised",
    "WorkerDied",
    "WorkerPool",
    "describe_exit",
    "dumps",
]

#: Modules the forkserver imports once, so that a worker forked from it has them.
PRELOAD = ("ppokit.workers", "torch")
#: Seconds a new worker may take to load its object (a plugin's import) before it is killed.
START_TIMEOUT = 120.0
#: Seconds a worker closed by :meth:`WorkerPool.close` gets to end before it is killed.
CLOSE_GRACE = 0.5


class Raised(Exception):
    """What a call raised in its worker: ``kind`` (the exception's type name), ``message``
    (the exception as one line), ``location`` (``file:line`` where it was raised, or None),
    ``remote_traceback`` (its traceback text in the worker), ``fatal`` (a ``BaseException``
    that is not an ``Exception``: ``SystemExit``, ``KeyboardInterrupt``, ...) and
    :attr:`original` (the exception itself, when it can be unpickled here)."""

    def __init__(
        self,
        kind: str,
        message: str,
        location: str | None,
        remote_traceback: str,
        fatal: bool,
        pickled: bytes | None = None,
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.location = location
        self.remote_traceback = remote_traceback
        self.fatal = fatal
        self.pickled = pickled

    def __reduce__(self) -> tuple[Any, ...]:
        args = (self.kind, self.message, self.location, self.remote_traceback, self.fatal)
        return (type(self), (*args, self.pickled))

    @property
    def original(self) -> BaseException | None:
        """The exception as raised in the worker (None: it cannot be unpickled here)."""
        if self.pickled is None:
            return None
        try:
            exc = pickle.loads(self.pickled)
        except Exception:
            return None
        return exc if isinstance(exc, BaseException) else None

    @classmethod
    def of(cls, exc: BaseException) -> Raised:
        """The description of ``exc``, caught in a worker."""
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        location = raised_at(exc)
        try:
            pickled: bytes | None = pickle.dumps(exc.with_traceback(None))
        except Exception:  # an exception that cannot cross (unpicklable fields)
            pickled = None
        fatal = not isinstance(exc, Exception)
        return cls(type(exc).__name__, one_line(exc), location, text, fatal, pickled)


class WorkerDied(Exception):
    """A worker's process ended during a call (``os._exit``, a signal, the OOM killer)."""

    def __init__(self, exitcode: int | None) -> None:
        super().__init__(f"its worker process {describe_exit(exitcode)}")
        self.exitcode = exitcode


def describe_exit(exitcode: int | None) -> str:
    """``ended with status 3`` or ``was killed by signal SIGKILL``."""
    if exitcode is None:
        return "ended"
    if exitcode >= 0:
        return f"ended with status {exitcode}"
    try:
        name = signal.Signals(-exitcode).name
    except ValueError:
        name = f"number {-exitcode}"
    return f"was killed by signal {name}"


@dataclass(frozen=True)
class Call:
    """One call: ``target.method(*args, **kwargs)`` (``method`` None: ``target(...)``)."""

    method: str | None
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] | None = None


# ---------------------------------------------------------------------- the worker's side
def _die_with_parent() -> None:
    """This process gets SIGKILL when its parent (the forkserver, which ends with the
    process that started it) ends; it ends now if that parent is gone already."""
    parent = os.getppid()
    if die_with_parent(signal.SIGKILL) and os.getppid() != parent:
        os._exit(1)


def _send(conn: Any, message: tuple[str, Any]) -> None:
    """``message`` pickled (the standard pickle: a tensor crosses as bytes, never as shared
    memory or a CUDA handle), or what made it fail to."""
    try:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # a result that cannot be pickled
        problem = TypeError(f"its result cannot be sent back: {one_line(exc)}")
        data = pickle.dumps(("raised", Raised.of(problem)), protocol=pickle.HIGHEST_PROTOCOL)
    conn.send_bytes(data)


def serve(conn: Any, payload: bytes) -> None:
    """A worker's life: load the object from ``payload``, then for each list of calls
    received on ``conn`` answer every call in turn, as soon as it is done, with
    ``("ok", result)`` or ``("raised", Raised)``, until the pipe closes or ``None``
    arrives."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the caller's to handle
    _die_with_parent()
    try:
        target = pickle.loads(payload)
    except BaseException as exc:
        _send(conn, ("raised", Raised.of(exc)))
        return
    _send(conn, ("ok", None))
    while True:
        try:
            calls = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return
        if calls is None:
            return
        for call in calls:
            try:
                fn = target if call.method is None else getattr(target, call.method)
                result = fn(*call.args, **(call.kwargs or {}))
            except BaseException as exc:  # SystemExit and KeyboardInterrupt too: reported
                _send(conn, ("raised", Raised.of(exc)))
            else:
                _send(conn, ("ok", result))
        del calls


# ---------------------------------------------------------------------- the caller's side
class _Worker:
    """One process and the caller's end of its pipe."""

    def __init__(self, process: Any, conn: Any) -> None:
        self.process = process
        self.conn = conn
        self.ready = False  # its object loaded (the first reply read)
        self.busy_since: float | None = None

    def kill(self) -> None:
        with contextlib.suppress(Exception):
            self.process.kill()
        with contextlib.suppress(Exception):
            self.process.join(5)
        with contextlib.suppress(Exception):
            self.conn.close()


def _kill_all(workers: list[_Worker | None]) -> None:
    for worker in workers:
        if worker is not None:
            worker.kill()
    workers[:] = [None] * len(workers)


def dumps(target: Any) -> bytes:
    """``target`` pickled to cross into a worker: by reference when it can be (its code keeps
    its file names), else with cloudpickle (code defined in a script or a function crosses
    by value, its file name shown as ``<dynamic-code>``). What names the main module is
    pickled by value too: a worker does not import the parent's main module."""
    try:
        payload = pickle.dumps(target, protocol=pickle.HIGHEST_PROTOCOL)
        if b"__main__" not in payload:
            return payload
    except Exception:
        pass
    import cloudpickle

    return cloudpickle.dumps(target, protocol=pickle.HIGHEST_PROTOCOL)  # type: ignore[no-any-return]


#: The longest temporary folder under which multiprocessing's sockets still fit: a socket's
#: path has at most 107 bytes on Linux, and theirs lie two names (about 35 bytes) below it.
SOCKET_FOLDER_MAX = 70


def _short_socket_folder() -> None:
    """multiprocessing keeps its sockets (the forkserver's) in a folder of its own, made
    once a process under tempfile's; under a long ``TMPDIR`` their paths pass the bound
    (``OSError: AF_UNIX path too long``), so that folder is then made under /tmp."""
    if len(os.fsencode(tempfile.gettempdir())) <= SOCKET_FOLDER_MAX:
        return
    if not os.access("/tmp", os.W_OK | os.X_OK):
        return
    previous = tempfile.tempdir
    tempfile.tempdir = "/tmp"
    try:
        util.get_temp_dir()  # made now, and kept for the process
    finally:
        tempfile.tempdir = previous


def _context() -> Any:
    """multiprocessing's forkserver context, its server started (once a process)."""
    from multiprocessing import forkserver

    _short_socket_folder()
    ctx = get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    forkserver.ensure_running()
    return ctx


_LAUNCHING = threading.Lock()


@contextlib.contextmanager
def _without_main() -> Iterator[None]:
    """multiprocessing's preparation of a new process without the parent's main module
    (whose import a spawned or forkserver child repeats: a script that starts a run at its
    top level would start it again there)."""
    from multiprocessing import spawn

    original = spawn.get_preparation_data

    def prepared(name: str) -> dict[str, Any]:
        data = original(name)
        data.pop("init_main_from_path", None)
        data.pop("init_main_from_name", None)
        return data

    with _LAUNCHING:
        spawn.get_preparation_data = prepared
        try:
            yield
        finally:
            spawn.get_preparation_data = original


class WorkerPool:
    """``size`` worker processes, each holding its own copy of ``target``.

    ``pool.call(Call(...), timeout)`` runs one call on a worker; ``pool.map(calls, timeout)``
    spreads calls over the workers and returns their results in order. Every call is bounded
    by ``timeout`` seconds from when it was sent (None: unbounded). Raises :class:`TimedOut`,
    :class:`Raised`, :class:`WorkerDied`; after any of them the workers that were busy are
    killed and replaced at the next call. ``close`` (or the end of a ``with`` block, or of the
    process) ends them. ``target`` is pickled here: what cannot be pickled raises at once
    (``pickle.PicklingError`` or the error of its ``__reduce__``)."""

    def __init__(self, target: Any, size: int = 1, name: str = "ppokit-worker") -> None:
        if size < 1:
            raise ValueError(f"a pool needs at least one worker (size={size})")
        self.name = name
        self.size = size
        self._target = target
        self._payload = dumps(target)
        self._by_value_modules: set[str] = set()
        _context()  # the server boots (imports torch) while the caller goes on
        self._workers: list[_Worker | None] = [None] * size
        self._lock = threading.Lock()
        # killed at the pool's collection and at the process's end, before multiprocessing
        # joins its children (a process started by mp.spawn runs no atexit hook)
        self._finalizer = util.Finalize(self, _kill_all, args=(self._workers,), exitpriority=10)

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ processes
    def start(self) -> None:
        """Start every worker now (else each starts at its first call)."""
        for i in range(self.size):
            self._worker(i)

    def _worker(self, i: int) -> _Worker:
        worker = self._workers[i]
        if worker is not None and worker.process.exitcode is None:
            return worker
        if worker is not None:
            worker.kill()
        ctx = _context()
        mine, theirs = ctx.Pipe()
        process = ctx.Process(
            target=serve, args=(theirs, self._payload), name=f"{self.name}-{i}", daemon=False
        )
        with _without_main():
            process.start()
        theirs.close()
        worker = self._workers[i] = _Worker(process, mine)
        return worker

    def close(self) -> None:
        """End every worker: ``None`` to the idle ones, a moment to end, then SIGKILL."""
        for worker in self._workers:
            if worker is not None and worker.busy_since is None:
                with contextlib.suppress(Exception):
                    worker.conn.send_bytes(pickle.dumps(None))
        for worker in self._workers:
            if worker is not None:
                with contextlib.suppress(Exception):
                    worker.process.join(CLOSE_GRACE)
        _kill_all(self._workers)

    @property
    def pids(self) -> list[int | None]:
        """The process id of each worker (None: not started)."""
        return [None if w is None else w.process.pid for w in self._workers]

    # ------------------------------------------------------------ calls
    def call(self, call: Call, timeout: float | None) -> Any:
        """The result of one call, on the first worker."""
        return self.map([call], timeout)[0]

    def map(self, calls: Sequence[Call], timeout: float | None) -> list[Any]:
        """The results of ``calls``, in order: each worker gets a contiguous share of them
        in one message and answers them in turn, each answer sent as it is ready, each call
        bounded by ``timeout`` seconds from the answer before it (a pool of one answers them
        all in order). Calls from several threads take turns (a reward server's)."""
        with self._lock:
            return self._map(calls, timeout)

    def _map(self, calls: Sequence[Call], timeout: float | None) -> list[Any]:
        import time

        results: list[Any] = [None] * len(calls)
        each = -(-len(calls) // self.size) if calls else 0
        pending: dict[int, list[int]] = {}  # worker -> its calls not yet answered, in order
        since: dict[int, float] = {}  # worker -> when its current call began
        try:
            for i in range(self.size):
                share = list(range(i * each, min(len(calls), (i + 1) * each)))
                if not share:
                    continue
                worker = self._ready(self._worker(i))
                batch = [calls[k] for k in share]
                worker.conn.send_bytes(pickle.dumps(batch, pickle.HIGHEST_PROTOCOL))
                pending[i], since[i] = share, time.monotonic()
                worker.busy_since = since[i]
            while pending:
                now = time.monotonic()
                wait = None
                if timeout is not None:
                    wait = max(0.0, min(since[i] + timeout for i in pending) - now)
                handles: dict[Any, int] = {}
                for i in pending:
                    busy = self._busy(i)
                    handles[busy.conn] = handles[busy.process.sentinel] = i
                ready = {handles[h] for h in connection.wait(list(handles), wait)}
                for i in sorted(ready):
                    busy = self._busy(i)
                    while i in pending and (busy.conn.poll() or i in ready):
                        ready.discard(i)  # a sentinel alone: read once, to find it dead
                        index = pending[i].pop(0)
                        results[index] = self._reply(i)
                        since[i] = time.monotonic()
                        if not pending[i]:
                            del pending[i]
                            busy.busy_since = None
                if timeout is not None:
                    now = time.monotonic()
                    if any(now - since[i] >= timeout for i in pending):
                        raise TimedOut(f"did not finish within {timeout:g} s")
        except BaseException:
            for i in [i for i, left in pending.items() if left]:  # abandoned: the processes go
                gone = self._workers[i]
                if gone is not None:
                    gone.kill()
                self._workers[i] = None
            raise
        return results

    def _ready(self, worker: _Worker) -> _Worker:
        """Wait for a new worker to have loaded its object (for START_TIMEOUT seconds). A
        module the object was pickled by reference from, which the worker cannot import (one
        made here from a file, not on ``sys.path``), is pickled by value instead, and the
        worker started again."""
        while not worker.ready:
            if not connection.wait([worker.conn, worker.process.sentinel], START_TIMEOUT):
                worker.kill()
                raise TimedOut(f"its worker did not start within {START_TIMEOUT:g} s")
            status, value = self._receive(worker)
            if status == "ok":
                worker.ready = True
                break
            missing = getattr(value.original, "name", None) if isinstance(value, Raised) else None
            if value.kind != "ModuleNotFoundError" or not self._by_value(missing):
                raise value
            i = self._workers.index(worker)
            worker.kill()
            self._workers[i] = None
            worker = self._worker(i)
        return worker

    def _by_value(self, module: str | None) -> bool:
        """Pickle ``module`` (one this process has) by value from now on; False if it
        cannot be."""
        import cloudpickle

        found = sys.modules.get(module) if module else None
        if module is None or found is None or module in self._by_value_modules:
            return False
        self._by_value_modules.add(module)
        cloudpickle.register_pickle_by_value(found)
        self._payload = cloudpickle.dumps(self._target, protocol=pickle.HIGHEST_PROTOCOL)
        return True

    def _receive(self, worker: _Worker) -> tuple[str, Any]:
        try:
            if worker.conn.poll():
                return pickle.loads(worker.conn.recv_bytes())  # type: ignore[no-any-return]
        except (EOFError, OSError):
            pass
        worker.process.join(5)
        raise WorkerDied(worker.process.exitcode)

    def _busy(self, i: int) -> _Worker:
        worker = self._workers[i]
        assert worker is not None  # a worker with calls pending
        return worker

    def _reply(self, i: int) -> Any:
        status, value = self._receive(self._busy(i))
        if status == "raised":
            raise value
        return value
