"""The ``code_tests`` reward (catalogue: :mod:`ppokit.components.reward`): each response's
Python program run against its row's tests in a sandbox, scored by the fraction of the
tests it passes.

The verdict is never the sandbox's. Each test (a Python statement or several) is parsed
here, in ppokit's own process, which never runs the program: every top-level ``assert`` is
split into its *check* (comparisons, ``and``/``or``/``not``, arithmetic, the test's
constants and their items, a few pure built-ins such as ``abs``, ``len``, ``sorted``,
``math.isclose``) with its literal operands, kept here, and its *queries*, the other
operands (``square(3)``), whose source alone goes into the sandbox
(:mod:`~ppokit.components.reward.plans`). A test's other statements go in as setup. The
sandbox's harness (:mod:`~ppokit.components.reward.harness`) answers each query with its
value in a tagged encoding of plain built-in values
(:mod:`~ppokit.components.reward.tagged_values`); ppokit decodes them and evaluates each
check itself (:mod:`~ppokit.components.reward.checks`). A program that subverts the harness, writes
on its channel or returns an object equal to everything can only ever answer the questions:
it never sees an expected value (no test, file or process in the sandbox holds one), and
only plain data crosses. What this does not cover (a test with no top-level ``assert``, a
check that compares queries only with each other) is flagged ``forgeable``; docs/rewards.md
has the table of attacks tried.

The sandbox is bubblewrap's (``bwrap``): new user, PID, network, IPC, UTS and cgroup
namespaces (no network but its own loopback; no process outside it visible or signalled),
a read-only root holding only ``/usr`` (the interpreter), ``/proc``, a few devices and the
harness at ``/task``; its one writable file system is ``/work``, of ``disk_mb`` (``/tmp``
and ``/dev/shm`` are folders in it), and a seccomp filter refuses memory no file system
bounds (a user namespace of its own, System V shared memory, memfds): both are
:mod:`~ppokit.components.reward.bubblewrap`'s. It ends with the process that started it.
Run by root, it runs as ``nobody``. Inside, the harness sets the resource limits (CPU
seconds and address space per process, processes, file size, open files; counted in the
sandbox's namespace), reads the program and the questions from its stdin (then empty),
runs the program once, then each test in a fresh fork of it (a crash or exit costs that
test alone), which sends its answers on a pipe as it goes. A wall-clock timeout kills the
whole sandbox; the tests answered before it still count.

Where bubblewrap is missing (or cannot make namespaces here) the reward refuses to start,
unless the spec sets ``unsafe: true`` and the environment ``PPOKIT_UNSAFE_CODE=1``: then the
same harness runs with the resource limits in a fresh folder and its own process group,
without OS isolation; the verdict is still ppokit's, but a program run as ppokit's own user
could read the expected values from ppokit's memory.

This module is the reward and its run loop: one sandbox per response, the request on its
stdin, the answers read from its pipe (bounded) and the tests checked on them. The modules
it uses import none of it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import resource
import selectors
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from ppokit.bounded import in_threads
from ppokit.components.reward import CODE_TESTS, Scored
from ppokit.components.reward.bubblewrap import (
    NOBODY,
    as_nobody,
    bwrap_args,
    filter_fd,
    sandbox_problem,
)
from ppokit.components.reward.checks import NO_VALUE
from ppokit.components.reward.harness import HARNESS
from ppokit.components.reward.plans import Plan, plan_test
from ppokit.components.reward.tagged_values import REPORT_BYTES, decode
from ppokit.errors import UserError, one_line

__all__ = ["UNSAFE_ENV", "CodeTestsReward", "extract_program"]

#: The environment variable a run sets to let ``unsafe: true`` run programs unisolated.
UNSAFE_ENV = "PPOKIT_UNSAFE_CODE"
#: The most files a sandboxed process may hold open (RLIMIT_NOFILE).
OPEN_FILES = 256

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_program(response: str) -> str:
    """The last fenced code block of ``response`` (```python, ```py or bare), or all of it."""
    blocks = _FENCE.findall(response)
    return blocks[-1] if blocks else response


# --- the answers: read here, bounded, decoded without running code ---------------------------


def _index(text: str) -> int:
    if len(text) > 18:
        raise ValueError("not an index")
    return int(text)


def _refuse(text: str) -> Any:
    raise ValueError(f"unexpected {text}")


def _answers(report: bytes, plans: list[Plan]) -> tuple[list[dict[int, Any]], list[bool]]:
    """Each test's query values (the first answer to each query) and whether it ended."""
    values: list[dict[int, Any]] = [{} for _ in plans]
    done = [False] * len(plans)
    for line in report.split(b"\n")[:-1]:  # the last piece is empty or was cut off
        try:
            message = json.loads(
                line, parse_int=_index, parse_float=_refuse, parse_constant=_refuse
            )
        except (ValueError, RecursionError):
            continue
        if type(message) is not list or not 1 <= len(message) <= 3:
            continue
        t = message[0]
        if type(t) is not int or not 0 <= t < len(plans):
            continue
        if len(message) == 1:
            done[t] = True
            continue
        k = message[1]
        if type(k) is not int or not 0 <= k < plans[t].queries or k in values[t]:
            continue
        try:
            values[t][k] = decode(message[2]) if len(message) == 3 else NO_VALUE
        except (ValueError, TypeError, OverflowError, RecursionError):
            values[t][k] = NO_VALUE
    return values, done


@CODE_TESTS.implementation
class CodeTestsReward:
    """The program is the response's last fenced code block (``extract``) or the whole
    response; its module name is ``solution`` (an ``if __name__ == "__main__"`` block does
    not run). A row's tests are a list of Python statements (or a JSON text of one). Each
    response gets a fresh folder; nothing it writes outlives its sandbox. Flags
    ``timed_out`` (reward/code_tests/timed_out_frac) on responses the timeout stopped, and
    ``forgeable`` (reward/code_tests/forgeable_frac) on responses whose row has a test
    whose verdict the program could forge (the module docstring)."""

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
        # processes: the sandbox's own init, the harness and a test's fork count too
        self.limits = {
            "RLIMIT_CPU": cpu_seconds,
            "RLIMIT_AS": memory_mb << 20,
            "RLIMIT_NPROC": processes + 3,
            "RLIMIT_FSIZE": file_mb << 20,
            "RLIMIT_CORE": 0,
            "RLIMIT_NOFILE": OPEN_FILES if hard_files < 0 else min(OPEN_FILES, hard_files),
        }

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

    def _command(self, task: Path, seccomp: int | None) -> list[str]:
        if self.isolated:
            args = bwrap_args(Path(self.python), task, self.disk_mb, seccomp)
            return ["bwrap", *args, self.python, "-I", "/task/harness.py"]
        return [self.python, "-I", str(task / "harness.py")]

    def run(self, program: str, tests: list[str]) -> tuple[float, bool]:
        """(the fraction of ``tests`` passed, whether the timeout stopped it)."""
        score, timed_out, _ = self._run(program, [plan_test(t) for t in tests])
        return score, timed_out

    def _run(self, program: str, plans: list[Plan]) -> tuple[float, bool, bool]:
        """(the fraction of the tests passed, timed out, forgeable)."""
        if not plans:
            return 0.0, False, False
        forgeable = any(p.forgeable for p in plans)
        with tempfile.TemporaryDirectory(prefix="ppokit-code-") as folder:
            task = Path(folder)
            (task / "harness.py").write_text(HARNESS, encoding="utf-8")
            os.chmod(task, 0o755)
            os.chmod(task / "harness.py", 0o644)
            if os.geteuid() == 0 and not self.isolated:  # nobody's folder to write in
                os.chown(task, NOBODY, NOBODY)
            limits = dict(self.limits)
            if not self.isolated:  # counted over all the user's processes: those now too
                limits["RLIMIT_NPROC"] += _processes_of(
                    NOBODY if os.geteuid() == 0 else os.getuid()
                )
            read, write = os.pipe()
            request = {
                "limits": limits,
                "fd": write,
                "program": program,
                "tests": [p.items for p in plans],
            }
            try:
                report, timed_out = self._exchange(task, json.dumps(request).encode(), read, write)
            finally:
                os.close(read)
        values, done = _answers(report, plans)
        passed = sum(p.passed(v, d) for p, v, d in zip(plans, values, done, strict=True))
        return passed / len(plans), timed_out, forgeable

    def _exchange(self, task: Path, request: bytes, read: int, write: int) -> tuple[bytes, bool]:
        """Start the sandbox, give it ``request`` on its stdin, read its answers from
        ``read`` (at most REPORT_BYTES) until it ends or the timeout; then kill it whole.
        (the answers, whether the timeout stopped it)."""
        cwd = None if self.isolated else str(task)
        env = {"PATH": "/usr/bin:/bin", "HOME": str(task), "LANG": "C.UTF-8"}
        stdin, feed = os.pipe()
        try:
            with filter_fd() if self.isolated else contextlib.nullcontext() as seccomp:
                proc = subprocess.Popen(
                    self._command(task, seccomp),
                    stdin=stdin,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    pass_fds=(write,) if seccomp is None else (write, seccomp),
                    start_new_session=True,
                    cwd=cwd,
                    env=env,
                    **as_nobody(),
                )
        except BaseException:
            os.close(feed)
            raise
        finally:
            os.close(stdin)
            os.close(write)
        try:
            return _converse(proc, feed, request, read, time.monotonic() + self.timeout)
        finally:  # the whole group: the sandbox goes with bwrap (--die-with-parent)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def __call__(self, prompts: list[str], responses: list[str], **fields: Any) -> Scored:
        from ppokit.components.reward.impl import require_field

        rows = require_field(fields, self.field, "code_tests", len(responses))
        plans: dict[str, Plan] = {}  # a group's responses share their row's tests
        tests = [
            [plans.get(t) or plans.setdefault(t, plan_test(t)) for t in self._tests(v)]
            for v in rows
        ]
        programs = [extract_program(r) if self.extract else r for r in responses]
        jobs = list(zip(programs, tests, strict=True))
        done = in_threads(lambda job: self._run(*job), jobs, self.concurrency, "ppokit-sandbox")
        for result in done:
            if isinstance(result, Exception):  # the sandbox itself failed: one line
                raise UserError(f"the code_tests reward: {one_line(result)}")
        ok = [r for r in done if not isinstance(r, Exception)]
        flags = {"timed_out": [r[1] for r in ok], "forgeable": [r[2] for r in ok]}
        return Scored([r[0] for r in ok], flags)


def _converse(
    proc: subprocess.Popen[bytes], feed: int, request: bytes, read: int, deadline: float
) -> tuple[bytes, bool]:
    """Write ``request`` to ``feed`` (closed then, or on return) and read ``read`` until its
    end, the process's end or ``deadline``: (what was read, at most REPORT_BYTES; whether
    the deadline came first)."""
    chunks: list[bytes] = []
    size = 0
    pending = memoryview(request)
    os.set_blocking(feed, False)
    os.set_blocking(read, False)
    try:
        exited: int | None = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):  # no pidfd: look at the process now and then
        exited = None
    selector = selectors.DefaultSelector()
    selector.register(read, selectors.EVENT_READ)
    selector.register(feed, selectors.EVENT_WRITE)
    if exited is not None:
        selector.register(exited, selectors.EVENT_READ)
    try:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return b"".join(chunks), True
            events = selector.select(remaining if exited is not None else min(remaining, 0.05))
            ended = exited is None and proc.poll() is not None
            for key, _ in events:
                if key.fd == feed and pending:
                    try:
                        pending = pending[os.write(feed, pending[: 1 << 16]) :]
                    except BlockingIOError:
                        continue
                    except OSError:  # the harness is gone
                        pending = pending[:0]
                    if not pending:
                        selector.unregister(feed)
                        os.close(feed)
                elif key.fd == read:
                    chunk = _read(read)
                    if chunk == b"":  # every process that held the pipe has ended
                        return b"".join(chunks), False
                    if chunk:
                        chunks.append(chunk[: REPORT_BYTES - size])
                        size += len(chunks[-1])
                    if size >= REPORT_BYTES:  # its writers wait now, until the end
                        selector.unregister(read)
                elif key.fd == exited:
                    ended = True
            if ended:  # what its processes wrote before they ended is in the pipe now
                while size < REPORT_BYTES and (chunk := _read(read)):
                    chunks.append(chunk[: REPORT_BYTES - size])
                    size += len(chunks[-1])
                return b"".join(chunks), False
    finally:
        selector.close()
        if pending:
            os.close(feed)
        if exited is not None:
            os.close(exited)


def _read(fd: int) -> bytes | None:
    """What the non-blocking pipe ``fd`` holds now (b"" at its end, None when empty)."""
    try:
        return os.read(fd, 1 << 16)
    except BlockingIOError:
        return None


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
