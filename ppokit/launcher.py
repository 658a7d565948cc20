"""``ppokit train --nproc N``: the run on N local processes through torch's launcher, and
what it says when a process ends badly (how each ended, and how to continue the run).

Torch is imported when :func:`launch` is called, not before.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from ppokit import runfolder
from ppokit.children import child_env, python_command

__all__ = [
    "SIGNAL_CAUSES",
    "ended_lines",
    "how_to_continue",
    "launch",
    "launch_args",
    "smoke_temp",
]


@contextlib.contextmanager
def smoke_temp(on: bool) -> Iterator[None]:
    """When ``on``, the processes' temporary directory (``TMPDIR``) is a new one, removed
    with what they left in it (their smoke folder, if a process was stopped before it
    removed it)."""
    if not on:
        yield
        return
    import shutil
    import tempfile

    folder = tempfile.mkdtemp(prefix="ppokit-processes-")
    before = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = folder
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = before
        shutil.rmtree(folder, ignore_errors=True)


def launch_args(nproc: int, argv: list[str]) -> list[str]:
    """torch's launcher's arguments for ``ppokit ARGV`` on ``nproc`` local processes, each
    started by :func:`ppokit.children.python_command` (not ``python -m``: nothing is imported
    from the working directory)."""
    return ["--standalone", "--nproc-per-node", str(nproc), "--no-python", *python_command(argv)]


def launch(nproc: int, argv: list[str]) -> tuple[int, list[str]]:
    """Run ``ppokit ARGV`` on ``nproc`` local processes through torch's launcher
    (``torch.distributed.run``, the code behind ``torchrun``). Returns the exit status of
    the run and, when processes failed, one line for each saying how it ended
    (:func:`ended_lines`; a process that raised has printed its error itself, one killed by
    a signal could not); the launcher stops the others."""
    import logging

    os.environ.setdefault("OMP_NUM_THREADS", "1")  # ppokit sets torch's threads itself
    os.environ.setdefault("PYTHONUNBUFFERED", "1")  # as torch's own python -u would
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # c10d's warnings on Ctrl-C
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    for name in list(logging.root.manager.loggerDict):  # the launcher's own log lines
        if name.startswith("torch.distributed"):
            logging.getLogger(name).setLevel(logging.CRITICAL)

    args = get_args_parser().parse_args(launch_args(nproc, argv))
    os.environ.update(child_env(os.environ))  # the processes import ppokit as this one did
    try:
        run(args)
    except (KeyboardInterrupt, SignalException):  # the processes got it too; the first one
        return 130, []  # said what to do
    except ChildFailedError as exc:
        import signal

        # the first to fail first; the launcher stops the others with SIGTERM
        order = sorted(
            exc.failures.items(),
            key=lambda kv: (kv[1].timestamp, kv[1].exitcode == -signal.SIGTERM, kv[0]),
        )
        return ended_lines({rank: (f.pid, f.exitcode) for rank, f in order})
    return 0, []


#: What a signal that ends a process usually means.
SIGNAL_CAUSES = {
    "SIGKILL": "sent from outside the run (the kernel's out-of-memory killer, a job "
    "scheduler's limit, kill -9), so it could say nothing",
    "SIGSEGV": "a crash in native code (torch, a C extension)",
    "SIGBUS": "a crash in native code (torch, a C extension), or a file it mapped changed",
    "SIGABRT": "a crash in native code (torch, a C extension)",
    "SIGTERM": "stopped by the launcher once another process failed, or from outside the "
    "run (a job scheduler, kill)",
}


def ended_lines(ends: dict[int, tuple[int, int]]) -> tuple[int, list[str]]:
    """The exit status of a run whose processes ``ends`` (rank -> (pid, exit code; minus
    the signal's number for one killed by a signal)), the first to fail first, failed, and
    one line per process: ``process 1 (pid 4242) was killed by signal SIGKILL: ...``. The
    status is that of the first process killed by a signal, 128 plus its signal's number
    (as a shell reports it): the others exit when they find it gone, sometimes before the
    launcher has seen it die; else the first process's non-zero exit status."""
    import signal

    lines, statuses, killed = [], [], []
    for rank, (pid, code) in ends.items():
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"number {-code}"
            cause = SIGNAL_CAUSES.get(name)
            lines.append(
                f"error: process {rank} (pid {pid}) was killed by signal {name}"
                + (f": {cause}" if cause else "")
            )
            killed.append(128 - code)
        else:
            lines.append(f"error: process {rank} (pid {pid}) exited with status {code}")
            statuses.append(code)
    return next(iter(killed), next((c for c in statuses if c > 0), 1)), lines


def how_to_continue(out: Path, command: list[str]) -> list[str]:
    """What the stopped run left in ``out`` (its last checkpoint, read from the folder) and
    the command that continues it (:func:`ppokit.runfolder.how_to_continue`)."""
    from ppokit.trainer.checkpoint import checkpoint_round

    return list(runfolder.how_to_continue(out, command, checkpoint_round(out)))
