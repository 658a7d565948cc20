"""Worker processes for code ppokit does not control: a :class:`WorkerPool` of processes that
each hold their own copy of one object (a reward, an environment) and answer calls of it, so
that a call can be stopped for real, whatever it does (C code that holds the GIL included).

A call that runs over its timeout has its worker ended, every process it started with it:
:class:`TimedOut` is raised, and the pool starts a fresh worker, from the object as it was
first sent, at its next call. A call that raises comes back as :class:`Raised` (the
exception's type, its one line, where it was raised, its traceback text; the exception
itself when it can cross), one whose process dies (``os._exit``, a signal) as
:class:`WorkerDied`, one whose reply cannot be taken (larger than its bound, :func:`reply_bound`) as
:class:`ReplyRefused`. ``SystemExit`` and ``KeyboardInterrupt`` raised by the code are
exceptions like any other there.

**What crosses is pickled.** The object once a process start (with ``cloudpickle``: a
function or class defined in a script or inside a function crosses by value, one of an
importable module by reference and is imported again in the worker); each call's method name,
arguments and result with the standard pickle. So a worker works on its own copies: what a
call changes in its arguments stays in the worker (return what the caller needs), and what it
keeps on ``self`` stays in that process, lost when it is killed. A pool of several processes
spreads :meth:`WorkerPool.map`'s calls over them: the state of one process is not the others'.

**A reply is bounded before it is read.** A call's reply may have at most
:attr:`Call.reply_bytes` bytes pickled, by default :data:`REPLY_FLOOR` plus
:data:`REPLY_PER_BYTE` times the size of the call as it was sent. The worker stops pickling a
reply at its bound and sends word of it in its place; the pool reads the length that heads
every message before the message (``Connection.recv_bytes(maxlength)``) and refuses a longer
one unread. An error the code raised whose text passes the bound comes back cut to
:data:`ERROR_TEXT` characters. What goes wrong in taking a reply (refused, or a
``MemoryError`` under a memory cap) is a :class:`ReplyRefused` that says so; only what
cannot be pickled among a call's inputs raises as it is.

**Processes.** Every worker is forked from multiprocessing's ``forkserver`` (one server a
Python process, started by the first pool with torch imported, so a worker starts in
milliseconds and never inherits the trainer's threads or CUDA context), with the parent's
``sys.path`` but not its main module: a worker's code crosses by reference to an importable
module or by value, so the script that started the run is not imported again (it needs no
``if __name__ == "__main__"`` guard). A worker is two processes: its *keeper*, the
forkserver's child, and the *runner*, the keeper's child, which loads the object and answers
the calls in a process group of its own. The keeper is a subreaper (Linux): whatever the code
starts stays among its descendants, a helper that starts a session of its own or
double-forks included. When the runner ends, when the pool ends the worker (a timeout,
:meth:`WorkerPool.close`: SIGTERM to the keeper), or when the pool's process or the
forkserver ends, however it ends (SIGKILL included: the parent-death signal, and a pidfd of
the pool's process), the keeper kills every process of that tree (SIGKILL), then ends with
the runner's status. The forkserver ends with the process that started it (a worker holds no
copy of its "alive" pipe). A worker ignores Ctrl-C (its caller stops it). The pools of a
process close when its main thread ends, before Python waits for its other threads, so that
a thread waiting on a worker's call (a reward server's request) ends then.

Torch-free itself; ``cloudpickle`` is imported when a pool starts.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import signal
import sys
import tempfile
import threading
import time
import traceback
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from multiprocessing import connection, get_context, util
from typing import Any

from ppokit.bounded import TimedOut
from ppokit.children import keep_tree, off_the_working_directory
from ppokit.errors import one_line, raised_at

__all__ = [
    "ERROR_TEXT",
    "PRELOAD",
    "REPLY_FLOOR",
    "REPLY_PER_BYTE",
    "START_TIMEOUT",
    "Call",
    "Raised",
    "ReplyRefused",
    "WorkerDied",
    "WorkerPool",
    "describe_exit",
    "dumps",
    "reply_bound",
]

#: Modules the forkserver imports once, so that a worker forked from it has them.
PRELOAD = ("ppokit.workers", "torch")
#: Seconds a new worker may take to load its object (a plugin's import) before it is killed.
START_TIMEOUT = 120.0
#: Seconds a worker closed by :meth:`WorkerPool.close` gets to end before it is killed.
CLOSE_GRACE = 0.5
#: Seconds a worker's keeper gets to end its process tree before the pool kills what is left.
KILL_GRACE = 5.0
#: The bound of a reply, in bytes pickled, whose call names none (:func:`reply_bound`):
#: this, plus :data:`REPLY_PER_BYTE` times the size of the call as sent. A reply answers what
#: its call sent (a reward: a score and a few flags for each response; an environment: its
#: text and the row it was given), so its bound grows with the call; this floor is room for
#: a small call's answer (a list of 1.8 million scores pickled, an environment's state).
REPLY_FLOOR = 16 * 2**20
#: See :data:`REPLY_FLOOR`.
REPLY_PER_BYTE = 64
#: Characters of an error's message and of its traceback that cross back when the whole
#: would pass its reply's bound; a bound is never below what such an error needs (its four
#: texts at 4 bytes a character, and the rest).
ERROR_TEXT = 4096
_ERROR_ROOM = 16 * ERROR_TEXT + 4096


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

    def cut(self, chars: int) -> Raised:
        """This description with its message cut to its first ``chars`` characters, its
        traceback to its last, and without the exception itself: what crosses back when
        the whole would pass its reply's bound."""

        def head(text: str) -> str:
            return text if len(text) <= chars else f"{text[:chars]}... ({len(text):,} characters)"

        tail = self.remote_traceback
        if len(tail) > chars:
            tail = f"...({len(tail):,} characters)\n{tail[-chars:]}"
        location = None if self.location is None else head(self.location)
        return Raised(head(self.kind), head(self.message), location, tail, self.fatal)


class WorkerDied(Exception):
    """A worker's process ended during a call (``os._exit``, a signal, the OOM killer), or
    was ended by its pool (:meth:`WorkerPool.close`, a reply it could not take:
    :class:`ReplyRefused`)."""

    def __init__(self, exitcode: int | None, message: str | None = None) -> None:
        super().__init__(message or f"its worker process {describe_exit(exitcode)}")
        self.exitcode = exitcode


class ReplyRefused(WorkerDied):
    """A call's reply that the pool did not take: larger than its bound
    (:func:`reply_bound`), or not received or unpickled here (``MemoryError`` under a memory
    cap, ...). The worker is ended when what it sent is left unread."""

    def __init__(self, message: str) -> None:
        super().__init__(None, message)


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
    """One call: ``target.method(*args, **kwargs)`` (``method`` None: ``target(...)``);
    ``reply_bytes``: the most bytes its reply may have pickled (None: :func:`reply_bound`'s
    default)."""

    method: str | None
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] | None = None
    reply_bytes: int | None = None


def reply_bound(call: Call, sent: int) -> int:
    """The most bytes the reply to ``call`` may have pickled: its ``reply_bytes``, or
    :data:`REPLY_FLOOR` + :data:`REPLY_PER_BYTE` × ``sent`` (the bytes the call took to
    send); never less than an error cut to :data:`ERROR_TEXT` needs."""
    if call.reply_bytes is not None:
        return max(_ERROR_ROOM, call.reply_bytes)
    return REPLY_FLOOR + REPLY_PER_BYTE * sent


def _size(n: int) -> str:
    """``n`` bytes for a message: ``512 bytes``, ``97.7 KiB``, ``16.0 MiB``."""
    if n < 2**10:
        return f"{n} bytes"
    return f"{n / 2**10:.1f} KiB" if n < 2**20 else f"{n / 2**20:.1f} MiB"


# ---------------------------------------------------------------------- the worker's side
def keep(conn: Any, payload: bytes, pool: int) -> None:
    """A worker's keeper, the process the forkserver forks (``pool``: the pid of the pool's
    process): it runs the worker's runner (:func:`run`) in a child and keeps its process
    tree (:func:`ppokit.children.keep_tree`), ended with it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the caller's to handle
    _leave_forkserver_alive()
    keep_tree(lambda: run(conn, payload), pool, conn.close)


def _leave_forkserver_alive() -> None:
    """This process's copy of the forkserver's "alive" pipe, closed: multiprocessing hands
    one to each child of the server, which ends only once every copy is closed; without
    theirs, it ends with the process that started it."""
    module = sys.modules.get("multiprocessing.forkserver")
    server = getattr(module, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if server is not None and fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)
        server._forkserver_alive_fd = None


def _forget_forkserver() -> None:
    """In a child forked (``os.fork``) from the process that started the forkserver: the
    server's "alive" pipe closed (the server ends with the process that started it, not
    with the last of its forked children) and the server forgotten (not this process's
    child: one of its own starts if it needs one)."""
    module = sys.modules.get("multiprocessing.forkserver")
    server: Any = getattr(module, "_forkserver", None)
    if getattr(server, "_forkserver_pid", None) is None:
        return
    _leave_forkserver_alive()
    server._forkserver_pid = None
    server._forkserver_address = None


os.register_at_fork(after_in_child=_forget_forkserver)


class _Overflow(Exception):
    """A pickle that passed its bound (:class:`_Capped`)."""


class _Capped(io.BytesIO):
    """A buffer that refuses to hold more than ``bound`` bytes (raises :class:`_Overflow`)."""

    def __init__(self, bound: int) -> None:
        super().__init__()
        self.bound = bound

    def write(self, data: Any) -> int:
        if self.tell() + memoryview(data).nbytes > self.bound:
            raise _Overflow
        return super().write(data)


def _pickled(message: tuple[str, Any], bound: int) -> bytes | None:
    """``message`` pickled (the standard pickle: a tensor crosses as bytes, never as shared
    memory or a CUDA handle), or None once it passes ``bound`` bytes (pickled no further)."""
    out = _Capped(bound)
    try:
        pickle.Pickler(out, protocol=pickle.HIGHEST_PROTOCOL).dump(message)
    except _Overflow:
        return None
    return out.getvalue()


def _send(conn: Any, message: tuple[str, Any], bound: int) -> None:
    """``message`` pickled, or what made it fail to; an error cut to fit ``bound``, any
    other reply that passes it replaced by ``("large", bound)``."""
    try:
        data = _pickled(message, bound)
    except Exception as exc:  # a result that cannot be pickled
        problem = TypeError(f"its result cannot be sent back: {one_line(exc)}")
        message = ("raised", Raised.of(problem))
        data = _pickled(message, bound)
    if data is None and message[0] == "raised":
        data = _pickled(("raised", message[1].cut(ERROR_TEXT)), bound)
    if data is None:
        data = pickle.dumps(("large", bound), protocol=pickle.HIGHEST_PROTOCOL)
    conn.send_bytes(data)


def run(conn: Any, payload: bytes) -> int:
    """A worker's runner: load the object from ``payload``, then for each list of calls
    received on ``conn`` answer every call in turn, as soon as it is done, with
    ``("ok", result)``, ``("raised", Raised)`` or ``("large", bound)`` (:func:`reply_bound`),
    until the pipe closes or ``None`` arrives. Returns the process's exit status."""
    try:
        target = pickle.loads(payload)
    except BaseException as exc:
        _send(conn, ("raised", Raised.of(exc)), REPLY_FLOOR)
        return 0
    _send(conn, ("ok", os.getpid()), REPLY_FLOOR)
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            return 0
        calls = pickle.loads(data)
        if calls is None:
            return 0
        sent = -(-len(data) // max(1, len(calls)))
        del data
        for call in calls:
            bound = reply_bound(call, sent)
            try:
                fn = target if call.method is None else getattr(target, call.method)
                result = fn(*call.args, **(call.kwargs or {}))
            except BaseException as exc:  # SystemExit and KeyboardInterrupt too: reported
                _send(conn, ("raised", Raised.of(exc)), bound)
            else:
                _send(conn, ("ok", result), bound)
                del result
        del calls


# ---------------------------------------------------------------------- the caller's side
class _Worker:
    """One worker (its keeper's process) and the caller's end of its pipe."""

    def __init__(self, process: Any, conn: Any) -> None:
        self.process = process
        self.conn = conn
        self.ready = False  # its object loaded (the first reply read)
        self.runner: int | None = None  # the runner's pid (and its group's), once ready
        self.busy_since: float | None = None

    def stop(self) -> None:
        """Ask its keeper to end the worker, its whole process tree (SIGTERM)."""
        with contextlib.suppress(Exception):
            if self.process.exitcode is None:
                self.process.terminate()

    def finish(self) -> None:
        """Wait for it to end (:data:`KILL_GRACE`), else kill its keeper and the runner's
        group."""
        with contextlib.suppress(Exception):
            self.process.join(KILL_GRACE)
        with contextlib.suppress(Exception):
            if self.process.exitcode is None:
                if self.runner is not None:
                    with contextlib.suppress(OSError):
                        os.killpg(self.runner, signal.SIGKILL)
                self.process.kill()
                self.process.join(5)

    def kill(self) -> None:
        self.stop()
        self.finish()


def _kill_all(workers: list[_Worker | None]) -> None:
    ending = [w for w in workers if w is not None]
    workers[:] = [None] * len(workers)
    for worker in ending:
        worker.stop()
    for worker in ending:
        worker.finish()


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
    with _launching():
        forkserver.ensure_running()
    return ctx


_LAUNCHING = threading.Lock()


@contextlib.contextmanager
def _launching() -> Iterator[None]:
    """multiprocessing's new processes started as ppokit starts its own: without the
    parent's main module (whose import a spawned or forkserver child repeats: a script that
    starts a run at its top level would start it again there), and the interpreters it
    starts with ``-c`` (the forkserver, the resource tracker) with the working directory off
    their ``sys.path`` (:func:`ppokit.children.off_the_working_directory`: a ``torch.py``
    planted where a run starts would run in the forkserver, which preloads torch)."""
    from multiprocessing import spawn

    prepare, start = spawn.get_preparation_data, util.spawnv_passfds

    def prepared(name: str) -> dict[str, Any]:
        data = prepare(name)
        data.pop("init_main_from_path", None)
        data.pop("init_main_from_name", None)
        return data

    def started(path: Any, args: Sequence[Any], passfds: Any) -> int:
        if len(args) >= 2 and args[-2] == "-c":
            args = [*args[:-1], off_the_working_directory(args[-1])]
        return start(path, args, passfds)  # type: ignore[no-any-return]

    with _LAUNCHING:
        spawn.get_preparation_data, util.spawnv_passfds = prepared, started
        try:
            yield
        finally:
            spawn.get_preparation_data, util.spawnv_passfds = prepare, start


#: The pools of this process, closed as its main thread ends (:func:`_close_pools`).
_POOLS: weakref.WeakSet[WorkerPool] = weakref.WeakSet()


def _close_pools() -> None:
    """Every pool of this process closed, as its main thread ends and before Python waits
    for its other threads: a thread waiting on a worker's call then ends, the call raising
    :class:`WorkerDied`."""
    for pool in list(_POOLS):
        with contextlib.suppress(Exception):
            pool.close()


with contextlib.suppress(Exception):  # threading's hook for what ends with the main thread
    threading._register_atexit(_close_pools)  # type: ignore[attr-defined]


class WorkerPool:
    """``size`` worker processes, each holding its own copy of ``target``.

    ``pool.call(Call(...), timeout)`` runs one call on a worker; ``pool.map(calls, timeout)``
    spreads calls over the workers and returns their results in order. Every call is bounded
    by ``timeout`` seconds from when it was sent (None: unbounded), its reply by
    :func:`reply_bound`. Raises :class:`TimedOut`, :class:`Raised`, :class:`WorkerDied`
    (:class:`ReplyRefused` among them); after any of them the workers that were busy are
    ended and replaced at the next call. What cannot be pickled among a call's inputs
    raises as it is, nothing sent. ``close`` (or the end of a ``with`` block, or of the
    process's main thread) ends them. ``target`` is pickled here: what cannot be pickled
    raises at once (``pickle.PicklingError`` or the error of its ``__reduce__``)."""

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
        self._closes = 0  # how many times it was closed: a call in flight then ends
        _POOLS.add(self)
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
            target=keep,
            args=(theirs, self._payload, os.getpid()),
            name=f"{self.name}-{i}",
            daemon=False,
        )
        with _launching():
            process.start()
        theirs.close()
        worker = self._workers[i] = _Worker(process, mine)
        return worker

    def close(self) -> None:
        """End every worker: ``None`` to the idle ones, a moment to end, then the rest
        killed, each with its whole process tree. A call in flight on another thread raises
        :class:`WorkerDied`."""
        self._closes += 1
        workers = [w for w in self._workers if w is not None]
        for worker in workers:
            if worker.busy_since is None:
                with contextlib.suppress(Exception):
                    worker.conn.send_bytes(pickle.dumps(None))
        deadline = time.monotonic() + CLOSE_GRACE
        for worker in workers:
            with contextlib.suppress(Exception):
                worker.process.join(max(0.0, deadline - time.monotonic()))
        _kill_all(self._workers)

    @property
    def pids(self) -> list[int | None]:
        """The process id of each worker's keeper (None: not started)."""
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
        results: list[Any] = [None] * len(calls)
        each = -(-len(calls) // self.size) if calls else 0
        closes = self._closes
        busy: dict[int, _Worker] = {}  # worker -> its process, for this map
        pending: dict[int, list[tuple[int, int]]] = {}  # worker -> (call, its reply's bound)
        since: dict[int, float] = {}  # worker -> when its current call began
        try:
            for i in range(self.size):
                share = list(range(i * each, min(len(calls), (i + 1) * each)))
                if not share:
                    continue
                worker = self._ready(self._worker(i))
                data = pickle.dumps([calls[k] for k in share], pickle.HIGHEST_PROTOCOL)
                sent = -(-len(data) // len(share))
                busy[i] = worker
                pending[i] = [(k, reply_bound(calls[k], sent)) for k in share]
                self._send(worker, data)
                since[i] = worker.busy_since = time.monotonic()
            while pending:
                wait = None
                if timeout is not None:
                    wait = max(0.0, min(since[i] + timeout for i in pending) - time.monotonic())
                handles: dict[Any, int] = {}
                for i in pending:
                    handles[busy[i].conn] = handles[busy[i].process.sentinel] = i
                ready = {handles[h] for h in connection.wait(list(handles), wait)}
                for i in sorted(ready):
                    worker = busy[i]
                    while i in pending and (i in ready or _has_reply(worker)):
                        ready.discard(i)  # a sentinel alone: read once, to find it dead
                        index, bound = pending[i].pop(0)
                        results[index] = self._reply(worker, bound, closes)
                        since[i] = time.monotonic()
                        if not pending[i]:
                            del pending[i]
                            worker.busy_since = None
                if timeout is not None:
                    now = time.monotonic()
                    if any(now - since[i] >= timeout for i in pending):
                        raise TimedOut(f"did not finish within {timeout:g} s")
        except BaseException:
            abandoned = [i for i, left in pending.items() if left]  # their processes go
            for i in abandoned:
                busy[i].stop()
            for i in abandoned:
                busy[i].finish()
                if self._workers[i] is busy[i]:
                    self._workers[i] = None
            raise
        return results

    def _send(self, worker: _Worker, data: bytes) -> None:
        """``data`` to ``worker``; :class:`WorkerDied` if it is gone."""
        try:
            worker.conn.send_bytes(data)
        except OSError:  # a broken pipe: it ended
            with contextlib.suppress(Exception):
                worker.process.join(5)
            raise WorkerDied(worker.process.exitcode) from None

    def _ready(self, worker: _Worker) -> _Worker:
        """Wait for a new worker to have loaded its object (for START_TIMEOUT seconds). A
        module the object was pickled by reference from, which the worker cannot import (one
        made here from a file, not on ``sys.path``), is pickled by value instead, and the
        worker started again."""
        while not worker.ready:
            if not connection.wait([worker.conn, worker.process.sentinel], START_TIMEOUT):
                worker.kill()
                raise TimedOut(f"its worker did not start within {START_TIMEOUT:g} s")
            status, value = self._receive(worker, REPLY_FLOOR)
            if status == "ok":
                worker.ready = True
                worker.runner = value if isinstance(value, int) else None
                break
            if status != "raised":
                raise ReplyRefused(f"its worker's first reply was more than {_size(value)}")
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

    def _receive(self, worker: _Worker, bound: int, closes: int | None = None) -> tuple[str, Any]:
        """The next message of ``worker``, at most ``bound`` bytes, read before it is
        unpickled: :class:`ReplyRefused` for one that cannot be taken, :class:`WorkerDied`
        when the worker ended (``closes``: the pool's count of closes when the call began,
        to tell that it was the pool's)."""
        data: bytes | None = None
        try:
            if worker.conn.poll():
                data = worker.conn.recv_bytes(bound)  # its length, read first, is checked
        except EOFError:
            pass
        except OSError as exc:  # a closed or broken pipe; or a reply too long, left unread
            if exc.args == ("bad message length",):
                worker.kill()  # the pipe is out of step
                raise ReplyRefused(
                    f"its worker's result was more than the {_size(bound)} a result of this call "
                    "may be; it was not read, and the worker was stopped"
                ) from None
        except Exception as exc:  # a MemoryError under a cap: the pipe is out of step
            worker.kill()
            raise ReplyRefused(
                f"its worker's result could not be received here ({one_line(exc)}); the "
                "worker was stopped"
            ) from exc
        except BaseException:  # Ctrl-C
            worker.kill()
            raise
        if data is None:
            with contextlib.suppress(Exception):
                worker.process.join(5)
            exitcode = worker.process.exitcode
            if closes is not None and closes != self._closes:
                raise WorkerDied(exitcode, "its worker process was stopped: its pool closed")
            raise WorkerDied(exitcode)
        try:
            status, value = pickle.loads(data)
        except Exception as exc:
            raise ReplyRefused(
                f"its worker's result ({_size(len(data))}) could not be read here: {one_line(exc)}"
            ) from exc
        return status, value

    def _reply(self, worker: _Worker, bound: int, closes: int) -> Any:
        status, value = self._receive(worker, bound, closes)
        if status == "raised":
            raise value
        if status == "large":
            raise ReplyRefused(
                f"its worker's result was more than the {_size(bound)} a result of this call may be"
            )
        return value


def _has_reply(worker: _Worker) -> bool:
    """Whether ``worker`` has a message waiting, or its pipe is closed (False: closed here)."""
    try:
        return bool(worker.conn.poll())
    except (OSError, ValueError):
        return False
