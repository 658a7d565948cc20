"""The ``code_tests`` reward's OS isolation (:mod:`ppokit.components.reward.sandbox`):
bubblewrap's arguments (:func:`bwrap_args`: namespaces, a read-only root, one writable file
system of ``disk_mb``), the seccomp filter it installs (refusing memory no file system
bounds), running as ``nobody`` when ppokit runs as root, and why no sandbox can be made here
(:func:`sandbox_problem`).

It knows nothing of tests, checks or the harness, and imports nothing of ppokit but
:mod:`ppokit.errors`.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import shutil
import struct
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ppokit.errors import one_line

#: The user a sandbox runs as when ppokit runs as root.
NOBODY = 65534


#: Per machine: its seccomp architecture, whether the x32 numbers (``nr | 0x40000000``) are
#: to be refused, and the numbers of the system calls the filter refuses (``shmget``,
#: ``msgget``, ``memfd_create``, ``memfd_secret``: memory no file system bounds;
#: ``unshare``: a user namespace, where a tmpfs of no bound could be mounted), of
#: ``clone`` (refused with CLONE_NEWUSER) and of ``clone3`` (ENOSYS: its flags cannot be
#: read, and the C library then falls back to ``clone``).
_SYSCALLS = {
    "x86_64": (0xC000003E, True, (29, 68, 319, 447, 272), 56, 435),
    "aarch64": (0xC00000B7, False, (194, 186, 279, 447, 97), 220, 435),
}


def _seccomp_filter() -> bytes | None:
    """A classic BPF program for bubblewrap's ``--seccomp`` (see _SYSCALLS): the refused
    calls fail with EPERM, as does any call of another architecture (a 32-bit call from a
    64-bit process); None on a machine not in _SYSCALLS."""
    known = _SYSCALLS.get(os.uname().machine)
    if known is None:
        return None
    arch, x32, refused, clone, clone3 = known
    load, equal, at_least, has_bits, answer = 0x20, 0x15, 0x35, 0x45, 0x06
    code: list[tuple[int, int, str | None, str | None]] = []  # (op, k, if true, if false)
    code += [(load, 4, None, None), (equal, arch, None, "refuse")]  # its architecture
    code += [(load, 0, None, None)]  # its number
    code += [(at_least, 0x40000000, "refuse", None)] if x32 else []
    code += [(equal, nr, "refuse", None) for nr in refused]
    code += [(equal, clone3, "nosys", None), (equal, clone, None, "allow")]
    code += [(load, 16, None, None), (has_bits, 0x10000000, "refuse", None)]  # CLONE_NEWUSER
    results = {
        "allow": 0x7FFF0000,
        "refuse": 0x50000 | errno.EPERM,
        "nosys": 0x50000 | errno.ENOSYS,
    }
    at = {label: len(code) + n for n, label in enumerate(results)}
    code += [(answer, k, None, None) for k in results.values()]

    def jump(label: str | None, i: int) -> int:
        return 0 if label is None else at[label] - i - 1

    return b"".join(
        struct.pack("=HBBI", op, jump(yes, i), jump(no, i), k)
        for i, (op, k, yes, no) in enumerate(code)
    )


@functools.cache
def _disables_userns(bwrap: str) -> bool:
    """Whether this bubblewrap has ``--disable-userns`` (0.8 and later)."""
    try:
        done = subprocess.run([bwrap, "--help"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "--disable-userns" in done.stdout + done.stderr


def bwrap_args(python: Path, task: Path, disk_mb: int, seccomp: int | None) -> list[str]:
    """bubblewrap's arguments: the namespaces (``--disable-userns`` where this bubblewrap
    has it; the seccomp filter refuses a user namespace anyway), /usr
    read-only (and the interpreter's prefix when it lives elsewhere), /bin, /lib, ... as
    this machine has them, /proc, a few devices, one tmpfs of ``disk_mb`` at /work (the
    working folder) holding /tmp and /dev/shm, the task read-only at /task; then the root
    and /dev read-only: /work is the one writable place. ``seccomp``: the fd of
    :func:`_seccomp_filter`'s program."""
    args = ["--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL"]
    bwrap = shutil.which("bwrap")
    if bwrap is not None and _disables_userns(bwrap):  # else the seccomp filter's unshare
        args += ["--unshare-user", "--disable-userns"]
    args += ["--ro-bind", "/usr", "/usr"]
    prefix = python.resolve().parent.parent
    if not str(prefix).startswith("/usr"):
        args += ["--ro-bind", str(prefix), str(prefix)]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    args += ["--proc", "/proc", "--tmpfs", "/dev"]
    for device in ("null", "zero", "full", "random", "urandom"):
        args += ["--dev-bind", f"/dev/{device}", f"/dev/{device}"]
    for name, target in (("fd", ""), ("stdin", "/0"), ("stdout", "/1"), ("stderr", "/2")):
        args += ["--symlink", f"/proc/self/fd{target}", f"/dev/{name}"]
    args += ["--size", str(disk_mb << 20), "--tmpfs", "/work"]
    args += ["--dir", "/work/.tmp", "--dir", "/work/.shm"]
    args += ["--symlink", "/work/.tmp", "/tmp", "--symlink", "/work/.shm", "/dev/shm"]
    args += ["--ro-bind", str(task), "/task", "--remount-ro", "/dev", "--remount-ro", "/"]
    if seccomp is not None:
        args += ["--seccomp", str(seccomp)]
    args += ["--chdir", "/work", "--clearenv"]
    for key, value in (("PATH", "/usr/bin:/bin"), ("HOME", "/work"), ("LANG", "C.UTF-8")):
        args += ["--setenv", key, value]
    return args


@contextlib.contextmanager
def filter_fd() -> Iterator[int | None]:
    """The read end of a pipe holding :func:`_seccomp_filter`'s program (None where there
    is none), closed on leaving."""
    program = _seccomp_filter()
    if program is None:
        yield None
        return
    read, write = os.pipe()
    try:
        os.write(write, program)  # a few hundred bytes: the pipe holds them
    finally:
        os.close(write)
    try:
        yield read
    finally:
        os.close(read)


def as_nobody() -> dict[str, Any]:
    """Popen's arguments that drop root to ``nobody`` (none for another user)."""
    if os.geteuid() != 0:
        return {}
    return {"user": NOBODY, "group": NOBODY, "extra_groups": []}


def sandbox_problem(python: str) -> str | None:
    """Why no sandbox can be made here (one line), or None: bwrap missing, or failing to
    make its namespaces (a kernel without unprivileged user namespaces), or no
    interpreter."""
    if not Path(python).is_file() or not os.access(python, os.X_OK):
        return f"the interpreter {python} is not there"
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return "bubblewrap is not installed (apt-get install bubblewrap)"
    with tempfile.TemporaryDirectory(prefix="ppokit-sandbox-") as task, filter_fd() as fd:
        os.chmod(task, 0o755)
        args = bwrap_args(Path(python), Path(task), 1, fd)
        cmd = [bwrap, *args, python, "-I", "-c", "pass"]
        try:
            done = subprocess.run(
                cmd,
                capture_output=True,
                text=True,
                timeout=60,
                pass_fds=() if fd is None else (fd,),
                **as_nobody(),
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"bubblewrap failed to start ({one_line(exc)})"
    if done.returncode != 0:
        return f"bubblewrap cannot make its sandbox here ({one_line(done.stderr.strip())})"
    return None
