"""The ``code_tests`` reward (catalogue: :mod:`ppokit.components.reward`): each response's
Python program run against its row's tests in a sandbox, scored by the fraction of the
tests it passes.

The sandbox is bubblewrap's (``bwrap``): new user, PID, network, IPC, UTS and cgroup
namespaces (no network but its own loopback; no process outside it visible or
signalled; no further user namespace), a read-only root holding only ``/usr`` (the
interpreter), ``/proc``, a few devices and the task's files; its one writable file system
is ``/work``, of ``disk_mb`` (``/tmp`` and ``/dev/shm`` are folders in it), and System V
shared memory and memfds are refused (seccomp). It ends with the process that started it.
Run by root, it runs as ``nobody``.
Inside, :data:`HARNESS` sets the resource limits (CPU seconds, address space, processes,
file size, open files; counted in the sandbox's own namespace), runs the program, then each test (a
Python statement, e.g. an ``assert``) in the program's namespace, and reports each test's
outcome on its own pipe as it ends. The score is the tests reported passed over the row's
tests: a program that exits (whatever its status), crashes, hangs or breaks a limit before
a test ends gets no credit for that test. A wall-clock timeout kills the whole sandbox.

Where bubblewrap is missing (or cannot make namespaces here) the reward refuses to start,
unless the spec sets ``unsafe: true`` and the environment ``PPOKIT_UNSAFE_CODE=1``: then the
program runs with the resource limits in a fresh folder and its own process group, without
OS isolation.

The harness runs the program in its own process, so a program written to forge the report
could; the sandbox protects the machine, not the score from a model that learns to attack
its harness.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import resource
import shutil
import signal
import struct
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ppokit.bounded import in_threads
from ppokit.components.reward import CODE_TESTS, Scored
from ppokit.errors import UserError, one_line

__all__ = ["HARNESS", "UNSAFE_ENV", "CodeTestsReward", "extract_program", "sandbox_problem"]

#: The environment variable a run sets to let ``unsafe: true`` run programs unisolated.
UNSAFE_ENV = "PPOKIT_UNSAFE_CODE"
#: The user a sandbox runs as when ppokit runs as root.
NOBODY = 65534
#: The most bytes of test reports read from one sandbox.
REPORT_BYTES = 1 << 16
#: The most files a sandboxed process may hold open (RLIMIT_NOFILE).
OPEN_FILES = 256

#: What runs inside the sandbox: ``harness.py FD LIMITS``; the program in
#: ``task/program.py``, the tests (a JSON list of statements) in ``task/tests.json``.
HARNESS = """\
import json, os, resource, sys
fd, limits, task = int(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
for name, value in limits.items():
    resource.setrlimit(getattr(resource, name), (value, value))
with open(os.path.join(task, "program.py"), encoding="utf-8") as f:
    program = f.read()
with open(os.path.join(task, "tests.json"), encoding="utf-8") as f:
    tests = json.load(f)
report = os.write
space = {"__name__": "solution"}
try:
    exec(compile(program, "program.py", "exec"), space)
except BaseException:
    report(fd, b"program failed\\n")
    os._exit(0)
for i, test in enumerate(tests):
    try:
        exec(compile(test, "test_%d" % i, "exec"), space)
        ok = 1
    except BaseException:
        ok = 0
    report(fd, b"%d %d\\n" % (i, ok))
os._exit(0)
"""

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
_REPORT = re.compile(rb"(\d+) ([01])")


def extract_program(response: str) -> str:
    """The last fenced code block of ``response`` (```python, ```py or bare), or all of it."""
    blocks = _FENCE.findall(response)
    return blocks[-1] if blocks else response


#: Per machine: its seccomp architecture, the system calls refused in the sandbox
#: (``shmget``, ``msgget``, ``memfd_create``, ``memfd_secret``: memory no file system bounds),
#: and whether the x32 numbers (``nr | 0x40000000``) are to be refused too.
_REFUSED_CALLS = {
    "x86_64": (0xC000003E, (29, 68, 319, 447), True),
    "aarch64": (0xC00000B7, (194, 186, 279, 447), False),
}


def _seccomp_filter() -> bytes | None:
    """A classic BPF program for bubblewrap's ``--seccomp``: the refused system calls fail
    with EPERM, as does any call of another architecture (a 32-bit call from a 64-bit
    process); None on a machine not in _REFUSED_CALLS."""
    known = _REFUSED_CALLS.get(os.uname().machine)
    if known is None:
        return None
    arch, refused, x32 = known
    load, equal, at_least, answer = 0x20, 0x15, 0x35, 0x06  # BPF_LD|W|ABS, JEQ, JGE, RET

    def op(code: int, k: int, to_refuse: int = 0) -> bytes:  # jump: true -> the refusal
        return struct.pack("=HBBI", code, to_refuse, 0, k)

    tests = ([(at_least, 0x40000000)] if x32 else []) + [(equal, nr) for nr in refused]
    body = [op(load, 0)]  # the call's number
    body += [op(code, k, len(tests) - i) for i, (code, k) in enumerate(tests)]
    body += [op(answer, 0x7FFF0000), op(answer, 0x00050000 | errno.EPERM)]  # allow, refuse
    head = [op(load, 4), struct.pack("=HBBI", equal, 0, len(body) - 1, arch)]  # arch
    return b"".join(head + body)


def _bwrap_args(python: Path, task: Path, disk_mb: int, seccomp: int | None) -> list[str]:
    """bubblewrap's arguments: the namespaces (no further user namespace inside), /usr
    read-only (and the interpreter's prefix when it lives elsewhere), /bin, /lib, ... as
    this machine has them, /proc, a few devices, one tmpfs of ``disk_mb`` at /work (the
    working folder) holding /tmp and /dev/shm, the task read-only at /task; then the root
    and /dev read-only: /work is the one writable place. ``seccomp``: the fd of
    :func:`_seccomp_filter`'s program."""
    args = ["--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent"]
    args += ["--new-session", "--cap-drop", "ALL", "--ro-bind", "/usr", "/usr"]
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
def _filter_fd() -> Iterator[int | None]:
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


def _as_nobody() -> dict[str, Any]:
    """Popen's arguments that drop root to ``nobody`` (none for another user)."""
    if os.geteuid() != 0:
        return {}
    return {"user": NOBODY, "group": NOBODY, "extra_groups": []}


def sandbox_problem(python: str) -> str | None:
    """Why no sandbox can be made here (one line), or None: bwrap missing, or failing to
    make its namespaces (a kernel without unprivileged user namespaces, a bubblewrap older
    than 0.8 without --disable-userns), or no interpreter."""
    if not Path(python).is_file() or not os.access(python, os.X_OK):
        return f"the interpreter {python} is not there"
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return "bubblewrap is not installed (apt-get install bubblewrap)"
    with tempfile.TemporaryDirectory(prefix="ppokit-sandbox-") as task, _filter_fd() as fd:
        os.chmod(task, 0o755)
        args = _bwrap_args(Path(python), Path(task), 1, fd)
        cmd = [bwrap, *args, python, "-I", "-c", "pass"]
        try:
            done = subprocess.run(
                cmd,
                capture_output=True,
                text=True,
                timeout=60,
                pass_fds=() if fd is None else (fd,),
                **_as_nobody(),
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"bubblewrap failed to start ({one_line(exc)})"
    if done.returncode != 0:
        return f"bubblewrap cannot make its sandbox here ({one_line(done.stderr.strip())})"
    return None


@CODE_TESTS.implementation
class CodeTestsReward:
    """The program is the response's last fenced code block (``extract``) or the whole
    response; its module name is ``solution`` (an ``if __name__ == "__main__"`` block does
    not run). A row's tests are a list of Python statements (or a JSON text of one). Each
    response gets a fresh folder; nothing it writes outlives its sandbox. Flags
    ``timed_out`` (reward/code_tests/timed_out_frac) on responses the timeout stopped."""

    blocking = True  # its calls wait on a server or a sandbox

    def __init__(
        self,
        *,
        field: str,
        timeout: float,
        cpu_seconds: int,
        memory_mb: int,
        processes: int,
        file_mb: int,
        disk_mb: int,
        concurrency: int,
        python: str,
        extract: bool,
        unsafe: bool,
    ) -> None:
        self.field, self.timeout, self.extract = field, timeout, extract
        self.python, self.disk_mb, self.concurrency = python, disk_mb, concurrency
        problem = sandbox_problem(python)
        self.isolated = problem is None
        if problem is not None and not (unsafe and os.environ.get(UNSAFE_ENV) == "1"):
            how = (
                f"the spec sets unsafe: true but the environment has no {UNSAFE_ENV}=1"
                if unsafe
                else f"set unsafe: true and {UNSAFE_ENV}=1 to run them without it"
            )
            raise UserError(
                f"the code_tests reward runs programs in a sandbox: {problem}; it refuses to "
                f"run them unisolated ({how})"
            )
        hard_files = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        # processes: the sandbox's own init and the harness count too
        self.limits = {
            "RLIMIT_CPU": cpu_seconds,
            "RLIMIT_AS": memory_mb << 20,
            "RLIMIT_NPROC": processes + 2,
            "RLIMIT_FSIZE": file_mb << 20,
            "RLIMIT_CORE": 0,
            "RLIMIT_NOFILE": OPEN_FILES if hard_files < 0 else min(OPEN_FILES, hard_files),
        }
        if not self.isolated and os.geteuid() != 0:  # counted over the user's processes
            self.limits["RLIMIT_NPROC"] += _processes_of(os.getuid())

    def _tests(self, value: Any) -> list[str]:
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                value = [value]
        if hasattr(value, "tolist"):
            value = value.tolist()
        if not isinstance(value, (list, tuple)) or not all(isinstance(t, str) for t in value):
            raise UserError(
                f"the code_tests reward: the field {self.field!r} must hold a list of Python "
                f"statements, got {type(value).__name__}"
            )
        return list(value)

    def _command(self, task: Path, fd: int, seccomp: int | None) -> list[str]:
        limits = json.dumps(self.limits)
        if self.isolated:
            inside = [self.python, "-I", "/task/harness.py", str(fd), limits, "/task"]
            args = _bwrap_args(Path(self.python), task, self.disk_mb, seccomp)
            return ["bwrap", *args, *inside]
        return [self.python, "-I", str(task / "harness.py"), str(fd), limits, str(task)]

    def run(self, program: str, tests: list[str]) -> tuple[float, bool]:
        """(the fraction of ``tests`` passed, whether the timeout stopped it)."""
        if not tests:
            return 0.0, False
        with tempfile.TemporaryDirectory(prefix="ppokit-code-") as folder:
            task = Path(folder)
            (task / "program.py").write_text(program, encoding="utf-8")
            (task / "tests.json").write_text(json.dumps(tests), encoding="utf-8")
            (task / "harness.py").write_text(HARNESS, encoding="utf-8")
            for path in (task, *task.iterdir()):
                os.chmod(path, 0o755 if path.is_dir() else 0o644)
            if os.geteuid() == 0 and not self.isolated:  # nobody's folder to write in
                os.chown(task, NOBODY, NOBODY)
            read, write = os.pipe()
            try:
                timed_out = self._wait(task, write)
            finally:
                os.close(write)
                report = _drain(read)
        passed = {int(i) for i, ok in _REPORT.findall(report) if ok == b"1"}
        return len(passed & set(range(len(tests)))) / len(tests), timed_out

    def _wait(self, task: Path, fd: int) -> bool:
        cwd = None if self.isolated else str(task)
        env = {"PATH": "/usr/bin:/bin", "HOME": str(task), "LANG": "C.UTF-8"}
        with _filter_fd() if self.isolated else contextlib.nullcontext() as seccomp:
            proc = subprocess.Popen(
                self._command(task, fd, seccomp),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                pass_fds=(fd,) if seccomp is None else (fd, seccomp),
                start_new_session=True,
                cwd=cwd,
                env=env,
                **_as_nobody(),
            )
        try:
            proc.wait(self.timeout)
            return False
        except subprocess.TimeoutExpired:
            return True
        finally:  # the whole group: the sandbox goes with bwrap (--die-with-parent)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def __call__(self, prompts: list[str], responses: list[str], **fields: Any) -> Scored:
        from ppokit.components.reward.impl import require_field

        rows = require_field(fields, self.field, "code_tests", len(responses))
        tests = [self._tests(value) for value in rows]
        programs = [extract_program(r) if self.extract else r for r in responses]
        jobs = list(zip(programs, tests, strict=True))
        done = in_threads(lambda job: self.run(*job), jobs, self.concurrency, "ppokit-sandbox")
        for result in done:
            if isinstance(result, Exception):  # the sandbox itself failed: one line
                raise UserError(f"the code_tests reward: {one_line(result)}")
        scores = [r[0] for r in done if not isinstance(r, Exception)]
        timed_out = [r[1] for r in done if not isinstance(r, Exception)]
        return Scored(scores, {"timed_out": timed_out})


def _drain(fd: int) -> bytes:
    """What is in the pipe ``fd`` now, at most REPORT_BYTES, without waiting; then closed."""
    os.set_blocking(fd, False)
    chunks, size = [], 0
    try:
        while size < REPORT_BYTES:
            try:
                chunk = os.read(fd, REPORT_BYTES - size)
            except BlockingIOError:
                break
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks)


def _processes_of(uid: int) -> int:
    """How many processes ``uid`` runs now (/proc)."""
    count = 0
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            text = status.read_text()
        except OSError:
            continue
        match = re.search(r"^Uid:\s+(\d+)", text, re.MULTILINE)
        count += bool(match and int(match.group(1)) == uid)
    return count
