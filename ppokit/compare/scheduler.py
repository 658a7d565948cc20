"""Running a sweep's runs: each a ``ppokit train`` process in its own process group, N at a
time, stopped with the sweep; a failed run's error line. Torch-free."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ppokit.children import child_env
from ppokit.compare.progress import PlainView, Progress
from ppokit.compare.runs import (
    ANSI,
    ERROR_FILE,
    LOGS_DIR,
    RUNS_DIR,
    WAIT_BUSY,
    SweepRun,
    last_round,
    run_status,
    threads_per_job,
    train_command,
)
from ppokit.errors import UserError
from ppokit.runfolder import (
    FolderLock,
    ensure_dir,
    open_new,
    read_bytes,
    remove,
    write_atomic,
)

# ---------------------------------------------------------------------- running
#: The line of a failed run's log that says why: ppokit's ``error: ...`` line, else the last
#: line of a traceback (``ValueError: ...``).
_ERROR_LINES = (re.compile(r"^error: "), re.compile(r"^[\w.]*(Error|Exception|Interrupt)\b.*"))
#: A line with no word in it: a table border, a rule, a progress bar.
_WORDLESS = re.compile(r"^[^\w]*$")


def last_line(path: Path) -> str | None:
    """The line of a log that says why its run failed: the last ``error:`` line, else the
    last exception line, else the last line with a word in it (never a table border)."""
    try:
        text = read_bytes(path).decode("utf-8", errors="replace")
    except OSError:
        return None
    lines = [ANSI.sub("", line).strip() for line in text.splitlines()]
    for pattern in _ERROR_LINES:
        for line in reversed(lines):
            if pattern.match(line):
                return line
    for line in reversed(lines):
        if line and not _WORDLESS.match(line):
            return line
    return None


def _exit_error(rc: int, stderr: Path) -> str:
    line = last_line(stderr)
    if line:
        return line
    if rc < 0:
        try:
            return f"killed by signal {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exited with status {rc}"


def _write_error(run: SweepRun) -> None:
    try:
        ensure_dir(run.dir.parent.parent.parent, RUNS_DIR, run.name, run.dir.name)
        write_atomic(run.dir / ERROR_FILE, (run.error or "failed") + "\n")
    except UserError:
        pass  # the error is reported anyway


@dataclass
class _Child:
    proc: subprocess.Popen[bytes]
    files: list[Any] = field(default_factory=list)

    def close(self) -> None:
        for fh in self.files:
            fh.close()


def _launch(
    run: SweepRun,
    argv: list[str],
    out: Path,
    env: Mapping[str, str],
) -> _Child:
    try:
        logs = ensure_dir(out, LOGS_DIR, run.name)
        ensure_dir(out, RUNS_DIR, run.name)
    except UserError as exc:
        raise OSError(str(exc)) from None
    remove(run.dir / ERROR_FILE)  # compare's own file, of an earlier failed attempt
    stdout = open_new(logs / f"seed-{run.seed}.out")
    try:
        stderr = open_new(logs / f"seed-{run.seed}.err")
    except OSError:
        stdout.close()
        raise
    run.log = logs / f"seed-{run.seed}.err"
    kwargs: dict[str, Any] = {}
    if os.name == "posix":
        # its own process group: the sweep signals the run and all it started, on any exit
        kwargs["start_new_session"] = True
    try:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, env=dict(env), **kwargs
        )
    except OSError:
        stdout.close()
        stderr.close()
        raise
    return _Child(proc, [stdout, stderr])


def _signal(child: _Child, sig: int) -> None:
    try:
        if os.name == "posix":
            os.killpg(child.proc.pid, sig)
        elif sig == getattr(signal, "SIGKILL", None):
            child.proc.kill()
        else:
            child.proc.terminate()
    except (ProcessLookupError, PermissionError, OSError):
        pass


def _stop_all(running: Mapping[SweepRun, _Child], grace: float, stop: _StopSignals) -> None:
    """SIGINT to every run's process group (SIGTERM where the sweep ignores SIGINT, so do
    its runs), then SIGKILL to any still alive after ``grace`` seconds or at a second stop
    signal. A stopped run leaves nothing half-written that matters: checkpoints are written
    atomically, and resuming drops the metrics lines logged after the last one."""
    for child in running.values():
        _signal(child, signal.SIGTERM if stop.sigint_ignored else signal.SIGINT)
    deadline = time.monotonic() + grace
    asked = stop.count
    while time.monotonic() < deadline and stop.count <= asked:
        if all(child.proc.poll() is not None for child in running.values()):
            break
        time.sleep(0.05)
    for child in running.values():
        if child.proc.poll() is None:
            _signal(child, getattr(signal, "SIGKILL", signal.SIGTERM))
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.proc.wait(timeout=5)
        child.close()


class _StopSignals:
    """While active, SIGINT (Ctrl-C), SIGTERM and SIGHUP to the sweep ask it to stop: they
    count up a flag the loop reads (main thread only), so no signal lands between starting a
    run and recording it. A SIGINT the sweep was started to ignore stays ignored."""

    def __init__(self) -> None:
        self.count = 0
        self.old: dict[int, Any] = {}
        self.sigint_ignored = signal.getsignal(signal.SIGINT) is signal.SIG_IGN

    def __enter__(self) -> _StopSignals:
        for name in ("SIGINT", "SIGTERM", "SIGHUP"):
            sig = getattr(signal, name, None)
            if sig is None or (sig == signal.SIGINT and self.sigint_ignored):
                continue
            with contextlib.suppress(ValueError, OSError):  # not the main thread
                self.old[sig] = signal.signal(sig, self._handler)
        return self

    def _handler(self, signum: int, frame: Any) -> None:
        self.count += 1

    def __exit__(self, *exc: Any) -> None:
        for sig, old in self.old.items():
            signal.signal(sig, old)


def execute(
    runs: Sequence[SweepRun],
    out: Path,
    overrides: Sequence[str],
    jobs: int = 1,
    *,
    view: PlainView | None = None,
    command: Callable[[SweepRun, Sequence[str]], list[str]] = train_command,
    poll: float = 0.2,
    grace: float = 10.0,
    wait_busy: float = WAIT_BUSY,
) -> bool:
    """Run the runs to launch (``action`` new, resume or overwrite), ``jobs`` at a time.

    Each run's stdout and stderr go to ``out/logs/<spec>/seed-<s>.out|.err``; a failed run's
    error (its ``error:`` line, see :func:`last_line`) to ``run.error`` and
    ``RUN_DIR/error.txt``. A run whose folder another process holds (an interrupted sweep's
    run still finishing) is waited for, up to ``wait_busy`` seconds, then planned again.
    Returns False when interrupted (Ctrl-C, SIGTERM or SIGHUP: every running run is stopped
    and marked ``interrupted``), True otherwise. The runs never outlive the sweep: they are
    stopped on any exit of this function.
    """
    progress = view.progress if view is not None else Progress(runs, jobs)
    view = view or PlainView(progress)
    threads = str(threads_per_job(jobs))
    # each run imports ppokit as this process did, and ends when this process ends
    env = child_env(
        {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}, os.getpid()
    )
    pending = deque(r for r in runs if r.status == "pending")
    running: dict[SweepRun, _Child] = {}
    waiting: dict[SweepRun, float] = {}
    view.start()
    for r in runs:
        if r.action == "skip":
            view.event(r, "finished already")
        elif r.action == "blocked":
            view.event(r, "blocked")
    with _StopSignals() as stop:
        try:
            while (pending or running or waiting) and not stop.count:
                for run, deadline in list(waiting.items()):
                    if _waited(run, deadline, wait_busy, pending, view):
                        del waiting[run]
                while pending and len(running) < jobs and not stop.count:
                    run = pending.popleft()
                    if FolderLock(run.dir).held_elsewhere():
                        waiting[run] = time.monotonic() + wait_busy
                        view.event(run, "waiting (in use by another process)")
                        continue
                    run.status, run.started = "running", time.perf_counter()
                    try:
                        running[run] = _launch(run, command(run, overrides), out, env)
                    except OSError as exc:
                        run.status, run.error = "failed", f"could not start: {exc}"
                        _write_error(run)
                        view.event(run, "failed")
                        continue
                    view.event(run, {"resume": "resumed"}.get(run.action, "started"))
                for run, child in list(running.items()):
                    rc = child.proc.poll()
                    if rc is None:
                        continue
                    child.close()
                    del running[run]
                    run.wall = time.perf_counter() - (run.started or time.perf_counter())
                    _finish(run, rc)
                    view.event(run, run.status)
                view.refresh()
                if pending or running or waiting:
                    time.sleep(poll)
        except KeyboardInterrupt:  # not the main thread, where the signals are not ours
            stop.count += 1
        finally:
            if running:  # stopped, or an error of the sweep itself: the runs end with it
                _stop_all(running, grace, stop)
    if not stop.count:
        view.stop()
        return True
    for run in [*running, *pending, *waiting]:
        run.status = "interrupted"
    for run in running:
        run.wall = time.perf_counter() - (run.started or time.perf_counter())
        if last_round(run.dir) >= run.rounds:
            run.status = "finished"  # it got to its last round before it stopped
    view.stop()
    return False


def _waited(
    run: SweepRun, deadline: float, wait_busy: float, pending: deque[SweepRun], view: PlainView
) -> bool:
    """Whether the wait for ``run``'s folder is over: free (the run is planned again from
    what is there now) or past ``deadline`` (failed, naming the folder's holder)."""
    if FolderLock(run.dir).held_elsewhere():
        if time.monotonic() < deadline:
            return False
        run.status = "failed"
        run.error = (
            f"{run.dir} is still in use by another ppokit run after {wait_busy:.0f} s (an "
            "earlier sweep's run still finishing?); run the command again when it has ended"
        )
        view.event(run, "failed")
        return True
    status, detail = run_status(run.dir, run.rounds)
    if status == "finished":
        run.action, run.status = "skip", "finished"
        view.event(run, "finished already")
    elif status == "blocked":
        run.action, run.status, run.error = "blocked", "failed", detail
        view.event(run, "blocked")
    else:
        run.action = status
        pending.appendleft(run)
    return True


def _finish(run: SweepRun, rc: int) -> None:
    if rc == 0:
        last = last_round(run.dir)
        if last >= run.rounds:
            run.status = "finished"
            return
        run.status = "failed"
        run.error = f"exited after round {last} of {run.rounds} without an error"
    else:
        run.status = "failed"
        run.error = _exit_error(rc, run.log) if run.log else f"exited with status {rc}"
    _write_error(run)
