"""How ppokit starts processes of its own (a sweep's runs, the processes of ``train --nproc``,
the worker processes of :mod:`ppokit.workers`) and ties their lives to their parent's.

- :func:`python_command`: a child imports ppokit from where its parent did and nothing from
  the working directory (``python -m`` would put the working directory first on
  ``sys.path``, so that a ``typer.py`` planted there would run in every child); any
  ``python -c`` child likewise with :func:`off_the_working_directory` (multiprocessing's
  forkserver and resource tracker: :mod:`ppokit.workers`).
- :func:`die_with_parent`: on Linux, the kernel signals the child when its parent ends
  (``PR_SET_PDEATHSIG``), even when the parent is killed with SIGKILL.
- :func:`keep_tree`: a process that runs code it does not control in a child, and keeps
  every process that code starts among its descendants (on Linux a subreaper,
  ``PR_SET_CHILD_SUBREAPER``: a helper that starts a session of its own or double-forks
  included), ends them all (:func:`end_descendants`) when the child ends, when told to
  (SIGTERM), or when its parent or a watched process ends, however it ends.
- :data:`PARENT`: a child started with this environment variable set to its parent's
  process id ties itself to it as it starts (:func:`tie_to_parent`, called by the command
  line), and ends at once if the parent is already gone.

Torch-free; imports nothing of ppokit.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import NoReturn

__all__ = [
    "PARENT",
    "ROOT",
    "become_subreaper",
    "child_env",
    "descendants",
    "die_with_parent",
    "end_descendants",
    "keep_tree",
    "off_the_working_directory",
    "python_command",
    "reap",
    "tie_to_parent",
]

#: The environment variable that names the process a child must end with.
PARENT = "PPOKIT_PARENT_PID"
#: linux/prctl.h: PR_SET_PDEATHSIG.
_PR_SET_PDEATHSIG = 1
#: linux/prctl.h: PR_SET_CHILD_SUBREAPER.
_PR_SET_CHILD_SUBREAPER = 36

#: The folder ppokit is imported from: a child finds the same ppokit there.
ROOT = str(Path(__file__).resolve().parent.parent)


def off_the_working_directory(code: str) -> str:
    """``code`` for ``python -c``, run with the working directory off ``sys.path`` (``-c``
    puts it first, as ''): the folder ppokit was imported from in its place, so the child
    finds the same ppokit and nothing planted where it runs (``import sys`` is built in)."""
    return f"import sys\nif sys.path and sys.path[0] == '':\n    sys.path[0] = {ROOT!r}\n{code}"


#: What a child's Python runs: ppokit's command line on the arguments that follow.
_MAIN = off_the_working_directory("from ppokit.cli import main\nmain()\n")  # as the command


def python_command(args: list[str]) -> list[str]:
    """The command line of a child ``ppokit ARGS``: this Python, ppokit's command line, the
    working directory not on its ``sys.path`` (run it with :func:`child_env`)."""
    return [sys.executable, "-c", _MAIN, *args]


def child_env(env: Mapping[str, str], parent: int | None = None) -> dict[str, str]:
    """``env`` for a child of :func:`python_command`: ``PYTHONPATH`` begins with the folder
    ppokit was imported from (so the child finds the same ppokit without the working
    directory); with ``parent``, the child ends when that process ends (:data:`PARENT`)."""
    out = dict(env)
    paths = [p for p in out.get("PYTHONPATH", "").split(os.pathsep) if p]
    if ROOT not in paths:
        out["PYTHONPATH"] = os.pathsep.join([ROOT, *paths])
    if parent is not None:
        out[PARENT] = str(parent)
    else:
        out.pop(PARENT, None)
    return out


def _prctl(option: int, value: int) -> bool:
    """Linux's ``prctl(option, value)``; False where it cannot be asked for or fails."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(option, value, 0, 0, 0) == 0)
    except Exception:
        return False


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Linux: this process gets ``sig`` when its parent ends (the thread that started it,
    exactly); False where that cannot be asked for (elsewhere), True otherwise."""
    return _prctl(_PR_SET_PDEATHSIG, int(sig))


def become_subreaper() -> bool:
    """Linux: a descendant of this process whose parent ends (a helper that double-forked,
    or started a session of its own and outlived its parent) becomes this process's child,
    not init's, so that :func:`end_descendants` finds it; this process reaps them (``wait``)
    as they end. Not inherited by its children. False where it cannot be asked for."""
    return _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def descendants(pid: int) -> list[tuple[int, bool]] | None:
    """(pid, zombie) of every descendant of ``pid``, parents before their children, read
    from ``/proc``; None where ``/proc`` cannot be read (not Linux)."""
    try:
        names = os.listdir("/proc")
    except OSError:
        return None
    children: dict[int, list[tuple[int, bool]]] = {}
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # it ended meanwhile
            continue
        fields = stat.rpartition(b")")[2].split()  # the name before it may hold anything
        if len(fields) < 2:
            continue
        state, ppid = fields[0], int(fields[1])
        children.setdefault(ppid, []).append((int(name), state in (b"Z", b"X")))
    found: list[tuple[int, bool]] = []
    todo = [pid]
    while todo:
        below = children.get(todo.pop(), [])
        found.extend(below)
        todo.extend(p for p, _ in below)
    return found


def end_descendants(within: float = 5.0) -> bool:
    """SIGKILL every descendant of this process and reap them, again until none is left
    alive (what a dying helper starts comes back to this process when it is a subreaper:
    :func:`become_subreaper`); True when none is left, False after ``within`` seconds or
    where ``/proc`` cannot be read."""
    deadline = time.monotonic() + within
    while True:
        found = descendants(os.getpid())
        if found is None:
            return False
        for pid, _ in found:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        reap()
        if not any(not zombie for _, zombie in found):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)  # the killed end; what they started comes back here


def reap() -> list[tuple[int, int]]:
    """(pid, wait status) of each child of this process that has ended, reaped now."""
    ended: list[tuple[int, int]] = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return ended
        if pid == 0:
            return ended
        ended.append((pid, status))


def tie_to_parent() -> None:
    """When :data:`PARENT` names this process's parent: end with it (SIGTERM), or now if it
    is gone already. The variable is removed, so that this process's own children do not
    read it."""
    raw = os.environ.pop(PARENT, None)
    if raw is None or not raw.isdigit():
        return
    die_with_parent(signal.SIGTERM)
    if os.getppid() != int(raw):  # the parent ended before the tie was made
        with contextlib.suppress(Exception):
            sys.stderr.write("ppokit: the process that started this one has ended\n")
        os._exit(1)


def _wake(signum: int, frame: object) -> None:
    """A keeper's handler: the signal's number is written to its wake-up pipe, read there."""


def keep_tree(run: Callable[[], int], watched: int, forked: Callable[[], None]) -> NoReturn:
    """Fork a child that runs ``run()`` (its return: the child's exit status) in a process
    group of its own, killed (SIGKILL) when this process ends; this process, the child's
    keeper, is a subreaper and reaps what ends in the child's tree. When the child ends,
    when this process gets SIGTERM (its parent's death among others: the parent-death
    signal), or when the process ``watched`` ends (a pidfd, Linux 5.3), every process of
    that tree is killed, and this process ends as the child did (SIGKILL when it did not
    end). ``forked``: called here once the child is started (to close what is the child's
    alone)."""
    woken, wake = os.pipe()
    os.set_blocking(woken, False)
    os.set_blocking(wake, False)
    for sig in (signal.SIGTERM, signal.SIGCHLD):
        signal.signal(sig, _wake)
    signal.set_wakeup_fd(wake)
    parent = os.getppid()
    if die_with_parent(signal.SIGTERM) and os.getppid() != parent:
        os._exit(1)
    become_subreaper()
    keeper = os.getpid()
    child = os.fork()
    if child == 0:
        code = 1
        try:
            signal.set_wakeup_fd(-1)
            os.close(woken)
            os.close(wake)
            for sig in (signal.SIGTERM, signal.SIGCHLD):
                signal.signal(sig, signal.SIG_DFL)
            with contextlib.suppress(OSError):
                os.setpgid(0, 0)  # the group its helpers join
            if not (die_with_parent(signal.SIGKILL) and os.getppid() != keeper):
                code = run()
        except BaseException:
            with contextlib.suppress(BaseException):
                import traceback

                traceback.print_exc()
        finally:
            with contextlib.suppress(BaseException):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)
    forked()
    status = _watch(child, woken, watched)
    with contextlib.suppress(OSError):
        os.killpg(child, signal.SIGKILL)  # its group (where /proc cannot be read)
    end_descendants()
    _end_as(status)


def _watch(child: int, woken: int, watched: int) -> int | None:
    """The child's wait status when it ends, or None when SIGTERM arrives (on the ``woken``
    pipe) or ``watched`` ends first."""
    fds = [woken]
    try:
        fds.append(os.pidfd_open(watched))  # readable once that process ends
    except ProcessLookupError:
        return None  # gone already
    except (AttributeError, OSError):  # not Linux 5.3
        pass
    while True:
        for pid, status in reap():  # the child, and what its tree left here
            if pid == child:
                return status
        ready = select.select(fds, [], [])[0]
        if woken in ready:
            with contextlib.suppress(BlockingIOError):
                if signal.SIGTERM in os.read(woken, 4096):
                    return None
        if any(fd != woken for fd in ready):
            return None


def _end_as(status: int | None) -> NoReturn:
    """End this process as the wait ``status`` says (None: killed, SIGKILL)."""
    if status is not None and os.WIFEXITED(status):
        os._exit(os.WEXITSTATUS(status))
    sig = os.WTERMSIG(status) if status is not None and os.WIFSIGNALED(status) else signal.SIGKILL
    with contextlib.suppress(Exception):
        import resource

        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # the child's core is its own
    with contextlib.suppress(Exception):
        signal.signal(sig, signal.SIG_DFL)
    with contextlib.suppress(Exception):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {sig})
    os.kill(os.getpid(), sig)
    os._exit(128 + sig)
