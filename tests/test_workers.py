"""Bounds that hold whatever the code does: a worker process's call that holds the
interpreter in C code is stopped at its timeout (the process killed, a fresh one at the next
call), what the code raises (``SystemExit`` and ``KeyboardInterrupt`` included) comes back as
a description naming where, a process that dies is named, and each worker works on its own
copies; in the caller's process a deadline interrupts a block at its bound, the earliest of
nested ones holding."""

from __future__ import annotations

import os
import re
import threading
import time

import pytest

from ppokit.bounded import TimedOut, counting_interrupts, deadline, interrupts
from ppokit.workers import Call, Raised, WorkerDied, WorkerPool, describe_exit

#: A match that backtracks exponentially inside the C matcher, holding the GIL for minutes.
CATASTROPHIC = (r"(a+)+$", "a" * 40 + "b")


class Target:
    """What the tests' workers hold: a counter on ``self`` and calls gone wrong."""

    def __init__(self) -> None:
        self.calls = 0

    def count(self) -> tuple[int, int]:
        self.calls += 1
        return os.getpid(), self.calls

    def append(self, items: list[int]) -> list[int]:
        items.append(len(items))
        return items

    def spin(self) -> bool:
        return re.fullmatch(*CATASTROPHIC) is not None

    def exit(self, code: int) -> None:
        raise SystemExit(code)

    def interrupt(self) -> None:
        raise KeyboardInterrupt

    def die(self) -> None:
        os._exit(7)

    def unpicklable(self) -> object:
        return threading.Lock()


@pytest.fixture(scope="module")
def pool() -> WorkerPool:
    with WorkerPool(Target()) as pool:
        pool.start()
        yield pool


def test_a_call_that_holds_the_interpreter_in_c_is_stopped_at_its_timeout(pool) -> None:
    (pid,) = pool.pids
    with pytest.raises(TimedOut, match=r"did not finish within 0\.5 s"):
        pool.call(Call("spin"), timeout=0.5)
    assert pool.pids == [None]  # killed; a fresh worker answers the next call
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    fresh, calls = pool.call(Call("count"), timeout=30)
    assert fresh not in (pid, os.getpid()) and calls == 1  # the object as first sent


def test_what_the_code_raises_comes_back_with_where(pool) -> None:
    with pytest.raises(Raised) as info:
        pool.call(Call("exit", (3,)), timeout=30)
    raised = info.value
    assert (raised.kind, raised.message, raised.fatal) == ("SystemExit", "SystemExit: 3", True)
    line = Target.exit.__code__.co_firstlineno + 1
    assert raised.location == f"tests/test_workers.py:{line}"
    assert isinstance(raised.original, SystemExit) and "raise SystemExit" in raised.remote_traceback
    with pytest.raises(Raised) as info:  # the worker ignores Ctrl-C; code may still raise it
        pool.call(Call("interrupt"), timeout=30)
    assert info.value.kind == "KeyboardInterrupt" and info.value.fatal
    with pytest.raises(Raised, match="its result cannot be sent back"):
        pool.call(Call("unpicklable"), timeout=30)
    assert pool.call(Call("count"), timeout=30)[1] > 0  # the same worker goes on


def test_a_worker_that_dies_is_named(pool) -> None:
    with pytest.raises(WorkerDied, match="its worker process ended with status 7"):
        pool.call(Call("die"), timeout=30)
    assert pool.call(Call("count"), timeout=30)[1] == 1
    assert describe_exit(-9) == "was killed by signal SIGKILL"


def test_a_worker_works_on_copies_and_keeps_its_own_state(pool) -> None:
    items = [1]
    assert pool.call(Call("append", (items,)), timeout=30) == [1, 1]
    assert items == [1]  # the caller's list is not the worker's
    before = pool.call(Call("count"), timeout=30)[1]
    results = pool.map([Call("count")] * 3, timeout=30)
    assert [c for _, c in results] == [before + 1, before + 2, before + 3]  # in order


def test_calls_spread_over_the_workers_in_order() -> None:
    with WorkerPool(Target(), size=2) as two:
        results = two.map([Call("append", ([i],)) for i in range(6)], timeout=30)
        assert results == [[i, 1] for i in range(6)]
        assert len({pid for pid in two.pids}) == 2


def test_what_cannot_be_pickled_is_refused_at_once() -> None:
    with pytest.raises(Exception, match="pickle"):
        WorkerPool(threading.Lock())


# ---------------------------------------------------------------------- deadline
def test_a_deadline_interrupts_python_code_at_its_bound() -> None:
    done = []
    with (
        pytest.raises(TimedOut, match=r"a loop did not finish within 0\.2 s"),
        deadline(0.2, "a loop"),
    ):
        while True:
            done.append(1)
    with deadline(5, "quick"):
        done.clear()
    time.sleep(0.3)  # the timer was cleared: nothing fires after the block


def test_the_earliest_of_nested_deadlines_holds() -> None:
    with (
        pytest.raises(TimedOut, match="inner did not"),
        deadline(30, "outer"),
        deadline(0.2, "inner"),
    ):
        time.sleep(10)
    with (
        pytest.raises(TimedOut, match="outer did not"),
        deadline(0.2, "outer"),
        deadline(30, "inner"),
    ):
        time.sleep(10)
    with deadline(None, "unbounded"):
        time.sleep(0.01)


def test_off_the_main_thread_a_deadline_bounds_nothing() -> None:
    seen: list[str] = []

    def run() -> None:
        with deadline(0.05, "elsewhere"):
            time.sleep(0.2)
        seen.append("done")

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert seen == ["done"]


@pytest.mark.usefixtures("ctrl_c")
def test_a_ctrl_c_is_told_from_a_keyboard_interrupt_raised_by_code() -> None:
    import signal

    with counting_interrupts():
        before = interrupts()
        with pytest.raises(KeyboardInterrupt):
            raise KeyboardInterrupt
        assert interrupts() == before
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        assert interrupts() == before + 1


def test_a_module_the_worker_cannot_import_crosses_by_value(tmp_path, monkeypatch) -> None:
    """A class from a module made here from a file (not on ``sys.path``): the worker cannot
    import it by name, so the module is pickled by value and the worker started again."""
    import importlib.util
    import sys

    path = tmp_path / "ppokit_made_here.py"
    path.write_text("class Made:\n    def answer(self):\n        return 42\n")
    spec = importlib.util.spec_from_file_location("ppokit_made_here", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setitem(sys.modules, "ppokit_made_here", module)
    with WorkerPool(module.Made()) as made:
        assert made.call(Call("answer"), timeout=30) == 42


def test_a_script_that_starts_a_pool_at_its_top_level_is_not_run_again(tmp_path) -> None:
    """A worker does not import the parent's main module: a script with no ``__main__``
    guard starts its pool once and its workers answer (each would otherwise run the script
    again, and fail to start a process while starting)."""
    import subprocess
    import sys

    marks = tmp_path / "runs.txt"
    script = tmp_path / "script.py"
    script.write_text(
        "from pathlib import Path\n"
        "from ppokit.workers import Call, WorkerPool\n"
        f"with Path({str(marks)!r}).open('a') as f:\n"
        "    f.write('ran\\n')\n"
        "def twice(x):\n"
        "    return 2 * x\n"
        "with WorkerPool(twice, size=2) as pool:\n"
        "    print(pool.map([Call(None, (i,), {}) for i in range(4)], 60))\n"
    )
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[0, 2, 4, 6]"
    assert marks.read_text() == "ran\n"


def test_a_pool_starts_under_a_long_temporary_folder(tmp_path) -> None:
    """Under a TMPDIR too long for a socket's path (107 bytes) the pool still starts and
    answers: multiprocessing's sockets go to a folder under /tmp."""
    import subprocess
    import sys

    long = tmp_path / ("t" * 60) / ("u" * 60)
    long.mkdir(parents=True)
    code = (
        "from ppokit.workers import Call, WorkerPool\n"
        "def twice(x):\n"
        "    return 2 * x\n"
        "with WorkerPool(twice) as pool:\n"
        "    print(pool.call(Call(None, (21,), {}), 60))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "TMPDIR": str(long)},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "42"
