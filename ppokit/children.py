"""How ppokit starts processes of its own (a sweep's runs, the processes of ``train --nproc``,
the worker processes of :mod:`ppokit.workers`) and ties their lives to their parent's.

- :func:`python_command`: a child imports ppokit from where its parent did and nothing from
  the working directory (``python -m`` would put the working directory first on
  ``sys.path``, so that a ``typer.py`` planted there would run in every child).
- :func:`die_with_parent`: on Linux, the kernel signals the child when its parent ends
  (``PR_SET_PDEATHSIG``), even when the parent is killed with SIGKILL.
- :data:`PARENT`: a child started with this environment variable set to its parent's
  process id ties itself to it as it starts (:func:`tie_to_parent`, called by the command
  line), and ends at once if the parent is already gone.

Torch-free; imports nothing of ppokit.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Mapping
from pathlib import Path

__all__ = ["PARENT", "child_env", "die_with_parent", "python_command", "tie_to_parent"]

#: The environment variable that names the process a child must end with.
PARENT = "PPOKIT_PARENT_PID"
#: linux/prctl.h: PR_SET_PDEATHSIG.
_PR_SET_PDEATHSIG = 1

#: What a child's Python runs first: the working directory off ``sys.path`` (``-c`` put it
#: there as ''), then ppokit's command line on the arguments that follow.
_MAIN = (
    "import sys\n"
    "if sys.path and sys.path[0] == '':\n"
    "    del sys.path[0]\n"
    "from ppokit.cli import main\n"
    "main(sys.argv[1:])\n"
)


def python_command(args: list[str]) -> list[str]:
    """The command line of a child ``ppokit ARGS``: this Python, ppokit's command line, the
    working directory not on its ``sys.path`` (run it with :func:`child_env`)."""
    return [sys.executable, "-c", _MAIN, *args]


def child_env(env: Mapping[str, str], parent: int | None = None) -> dict[str, str]:
    """``env`` for a child of :func:`python_command`: ``PYTHONPATH`` begins with the folder
    ppokit was imported from (so the child finds the same ppokit without the working
    directory); with ``parent``, the child ends when that process ends (:data:`PARENT`)."""
    out = dict(env)
    root = str(Path(__file__).resolve().parent.parent)
    paths = [p for p in out.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in paths:
        out["PYTHONPATH"] = os.pathsep.join([root, *paths])
    if parent is not None:
        out[PARENT] = str(parent)
    else:
        out.pop(PARENT, None)
    return out


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Linux: this process gets ``sig`` when its parent ends; False where that cannot be
    asked for (elsewhere), True otherwise."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0)
    except Exception:
        return False


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
