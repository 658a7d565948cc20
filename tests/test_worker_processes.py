"""What a worker leaves behind: nothing. At its timeout a worker's whole process tree ends (a
helper in its group, one in a session of its own, a double-forked daemon); a worker and the
forkserver end with the process that started them, however it ends (SIGKILL, its main thread
ending with a call in flight, a reward server stopped while a call hangs); a reply larger
than its bound is refused before it is read; what goes wrong in taking a reply names the
reply, never the call's inputs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from subprocess import DEVNULL
from typing import Any

import httpx
import pytest

from ppokit.bounded import TimedOut
from ppokit.children import descendants
from ppokit.errors import ComponentError
from ppokit.trainer.boundary import call_in_worker
from ppokit.trainer.contract import Where
from ppokit.workers import Call, Raised, ReplyRefused, WorkerDied, WorkerPool

ROOT = Path(__file__).resolve().parents[1]
#: Seconds the processes of a worker get to be gone (they took 0.5 s on 2 busy cores).
GONE_WITHIN = 15.0

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


# ---------------------------------------------------------------------- what the workers run
def start_helpers(path: str) -> None:
    """Start three helpers that would run for ever: one in the worker's group, one in a
    session of its own, a daemon (double-forked, a session of its own); write their pids and
    this process's to ``path``; then hang."""
    quiet: dict[str, Any] = {"stdin": DEVNULL, "stdout": DEVNULL, "stderr": DEVNULL}
    pids = [
        subprocess.Popen(["sleep", "1000"], **quiet).pid,
        subprocess.Popen(["sleep", "1001"], start_new_session=True, **quiet).pid,
        _daemon(["sleep", "1002"]),
    ]
    Path(f"{path}.part").write_text(" ".join(map(str, [*pids, os.getpid()])))
    os.replace(f"{path}.part", path)
    while True:
        time.sleep(3600)


def _daemon(argv: list[str]) -> int:
    """A daemon running ``argv`` (fork, setsid, fork, exec): its pid."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        os.setsid()
        grandchild = os.fork()
        if grandchild == 0:
            devnull = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(devnull, fd)
            os.execvp(argv[0], argv)
        os.write(w, str(grandchild).encode())
        os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    with os.fdopen(r) as f:
        return int(f.read())


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a process that runs (not a zombie)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rpartition(b")")[2].split()[0]
    except OSError:
        return False
    return state not in (b"Z", b"X")


def _left(pids: list[int], within: float = GONE_WITHIN) -> list[int]:
    """Those of ``pids`` still running after ``within`` seconds (killed then)."""
    deadline = time.monotonic() + within
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [p for p in pids if _alive(p)]
    for pid in left:  # not to leave them to the next tests
        os.kill(pid, signal.SIGKILL)
    return left


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _pids(path: Path, within: float = 60.0) -> list[int]:
    deadline = time.monotonic() + within
    while not path.exists():
        assert time.monotonic() < deadline, "the helpers were not started"
        time.sleep(0.02)
    return [int(p) for p in path.read_text().split()]


def _tree(pid: int) -> list[int]:
    found = descendants(pid)
    assert found is not None
    return [p for p, zombie in found if not zombie]


# ---------------------------------------------------------------------- the timeout
def test_a_call_stopped_at_its_timeout_leaves_no_process(tmp_path: Path) -> None:
    path = tmp_path / "pids"
    with WorkerPool(start_helpers) as pool:
        pool.start()
        with pytest.raises(TimedOut):
            pool.call(Call(None, (str(path),)), timeout=2)
        started = _pids(path, within=0)  # the helpers and the worker's own process
        assert pool.pids == [None]
        assert _left(started) == []


class Keeps:
    """A helper started at the first call that the next calls find running; a daemon
    that ends at once."""

    def __init__(self) -> None:
        self.helper: subprocess.Popen[bytes] | None = None

    def start(self) -> tuple[int, int]:
        self.helper = subprocess.Popen(["sleep", "1003"])
        return self.helper.pid, _daemon(["true"])

    def running(self) -> bool:
        return self.helper is not None and self.helper.poll() is None


def test_a_helper_lives_as_long_as_its_worker_and_ended_orphans_are_reaped() -> None:
    with WorkerPool(Keeps()) as pool:
        helper, daemon = pool.call(Call("start"), timeout=60)
        assert pool.call(Call("running"), timeout=60)  # between calls, it runs on
        deadline = time.monotonic() + GONE_WITHIN
        while os.path.exists(f"/proc/{daemon}") and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not os.path.exists(f"/proc/{daemon}")  # reaped, not a zombie kept for ever
    assert _left([helper]) == []  # closed: the worker's helper ends with it


def _killed_by_a_signal() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_worker_killed_by_a_signal_is_named_so() -> None:
    killed = "its worker process was killed by signal SIGKILL"
    with WorkerPool(_killed_by_a_signal) as pool, pytest.raises(WorkerDied, match=killed):
        pool.call(Call(None), timeout=60)


# ---------------------------------------------------------------------- the parent's end
#: A process that starts a pool, forks a child of its own (as a data loader does), and waits
#: on a call that hangs, its helpers started.
HANGS = """
import os
import sys
import time
from pathlib import Path
from subprocess import DEVNULL
from typing import Any
from ppokit.workers import Call, WorkerPool
from tests.test_worker_processes import start_helpers

pool = WorkerPool(start_helpers)
forked = os.fork()
if forked == 0:
    time.sleep(120)
    os._exit(0)
Path(sys.argv[1] + ".forked").write_text(str(forked))
pool.call(Call(None, (sys.argv[1],)), timeout=600)
"""


def _python(code: str, *args: str, **kwargs: object) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.Popen([sys.executable, "-c", code, *args], cwd=ROOT, env=env, **kwargs)  # type: ignore[call-overload, no-any-return]


def test_a_worker_and_the_forkserver_end_with_a_process_killed(tmp_path: Path) -> None:
    """SIGKILL to the pool's process while a call hangs: its forkserver, the worker's
    processes and their helpers end too, though a child it forked lives on."""
    path = tmp_path / "pids"
    proc = _python(HANGS, str(path))
    forked, tracker = None, []
    try:
        helpers = _pids(path)
        (forked,) = _pids(tmp_path / "pids.forked")
        # the forkserver, the worker's processes, the helpers; not multiprocessing's resource
        # tracker, which a forked child shares by design (it ends with that child)
        tracker = [p for p in _tree(proc.pid) if b"resource_tracker" in _cmdline(p)]
        started = sorted(set(_tree(proc.pid) + helpers) - {forked, *tracker})
        assert len(started) >= 6
        proc.kill()
        proc.wait(30)
        assert _left(started) == []
        assert _alive(forked)
    finally:
        proc.kill()
        if forked is not None:
            _left([forked], within=0)
            _left(tracker, within=5)


#: A process whose main thread ends while another thread waits on a call that hangs.
THREAD_WAITS = """
import sys
import threading
import time
from pathlib import Path
from subprocess import DEVNULL
from typing import Any
from ppokit.workers import Call, WorkerPool
from tests.test_worker_processes import start_helpers

pool = WorkerPool(start_helpers)
failed = Path(sys.argv[1] + ".failed")
def call():
    try:
        pool.call(Call(None, (sys.argv[1],)), timeout=600)
    except Exception as exc:
        failed.write_text(str(exc))
threading.Thread(target=call).start()
while not Path(sys.argv[1]).exists():
    time.sleep(0.02)
"""


def test_a_process_whose_main_thread_ends_ends_its_workers(tmp_path: Path) -> None:
    """Python waits for a thread that is not a daemon: one that waits on a worker's call
    ends as the pools close at the main thread's end, and the process with it."""
    path = tmp_path / "pids"
    proc = _python(THREAD_WAITS, str(path))
    try:
        helpers = _pids(path)
        assert proc.wait(GONE_WITHIN) == 0  # without it: the call's 600 s
        assert (
            tmp_path / "pids.failed"
        ).read_text() == "its worker process was stopped: its pool closed"
        assert _left(helpers) == []
    finally:
        proc.kill()


#: A served reward whose call starts helpers and hangs.
SERVED = """
from tests.test_worker_processes import start_helpers

def reward(prompts, responses):
    start_helpers(prompts[0])
"""


def test_a_reward_server_stopped_while_a_call_hangs_leaves_no_process(tmp_path: Path) -> None:
    """``ppokit reward-server`` stopped (SIGTERM, then Ctrl-C: stop now) while its reward's
    call hangs in a worker: the server ends, and every process it started with it."""
    code, path = tmp_path / "served.py", tmp_path / "pids"
    code.write_text(SERVED)
    argv = ["reward-server", "python", "-p", f"function={code}:reward", "--port", "0"]
    proc = _python(
        "from ppokit.cli import main; main()",
        *argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert " on http://" in line, proc.stderr.read()
        url = line.split(" on ")[1].split()[0]
        body = {"prompts": [str(path)], "responses": ["r"]}
        asking = threading.Thread(
            target=lambda: httpx.post(f"{url}/score", json=body, timeout=120), daemon=True
        )
        asking.start()
        helpers = _pids(path)
        started = sorted(set(_tree(proc.pid) + helpers))
        assert len(started) >= 6
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)
        assert _left(started) == []
    finally:
        proc.kill()


# ---------------------------------------------------------------------- the reply
def large(size: int, unannounced: bool = False) -> bytes | None:
    """``size`` bytes; ``unannounced``: written straight to the pool's pipe, past the
    worker's own measure (as code that found the pipe would), and None returned."""
    data = b"x" * size
    if not unannounced:
        return data
    import gc
    import pickle
    from multiprocessing.connection import Connection

    (conn,) = [c for c in gc.get_objects() if type(c) is Connection and not c.closed]
    conn.send_bytes(pickle.dumps(("ok", data)))
    return None


#: A process (torch-free) that asks for replies of 50 MB, as a reward's 100 million floats
#: would be, and prints the errors and how much its peak memory grew (KiB).
ASKS_LARGE = """
import resource
from ppokit.workers import Call, ReplyRefused, WorkerPool
from tests.test_worker_processes import large

with WorkerPool(large) as pool:
    pool.call(Call(None, (1000,)), 60)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for unannounced in (False, True):
        try:
            pool.call(Call(None, (50 * 2**20, unannounced)), 60)
        except ReplyRefused as exc:
            print(exc)
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
    assert pool.call(Call(None, (1000,)), 60) == b"x" * 1000
"""


def test_a_reply_larger_than_its_bound_is_refused_before_it_is_read() -> None:
    proc = _python(ASKS_LARGE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    measured, unannounced, grown = out.strip().splitlines()
    bound = "its worker's result was more than the 16.0 MiB a result of this call may be"
    assert measured == bound
    assert unannounced == f"{bound}; it was not read, and the worker was stopped"
    assert int(grown) < 16 * 1024  # KiB: neither was received (50 MB, twice, were it read)


def _raises_a_long_message(size: int) -> None:
    raise ValueError("x" * size)


def test_a_calls_own_bound_holds_and_its_worker_goes_on() -> None:
    with WorkerPool(large) as pool:
        pool.start()
        with pytest.raises(ReplyRefused, match=r"more than the 97\.7 KiB a result of this call"):
            pool.call(Call(None, (200_000,), reply_bytes=100_000), timeout=60)
        before = pool.pids
        assert pool.call(Call(None, (90_000,), reply_bytes=100_000), timeout=60) == b"x" * 90_000
        assert pool.pids == before  # the refused reply was never sent: the worker goes on


def test_an_error_whose_text_passes_the_bound_comes_back_cut() -> None:
    with WorkerPool(_raises_a_long_message) as pool, pytest.raises(Raised) as info:
        pool.call(Call(None, (2**20,), reply_bytes=100_000), timeout=60)
    raised = info.value
    assert raised.kind == "ValueError" and raised.message.startswith("ValueError: xxx")
    assert len(raised.message) < 5000 and len(raised.remote_traceback) < 5000
    assert raised.location is not None and raised.location.endswith(
        f":{_raises_a_long_message.__code__.co_firstlineno + 1}"
    )


class _Unreadable:
    """A result that cannot be unpickled in the pool's process (a MemoryError there)."""

    def __init__(self, reader: int) -> None:
        self.reader = reader

    def __reduce__(self) -> tuple[object, tuple[int]]:
        return (_read_unless_in, (self.reader,))


def _read_unless_in(reader: int) -> object:
    if os.getpid() == reader:
        raise MemoryError("no memory left to read it")
    return object()


def test_a_reply_that_cannot_be_read_is_named_a_reply() -> None:
    where = Where("reward", "unreadable", "tests")
    with WorkerPool(_Unreadable) as pool:
        with pytest.raises(ComponentError) as info:
            call_in_worker(where, pool, [Call(None, (os.getpid(),))], 60, "train.reward_timeout")
        assert pool.call(Call(None, (0,)), timeout=60) is not None  # the worker goes on
    message = str(info.value)
    assert "cannot send its inputs" not in message
    assert message.startswith("reward (unreadable, plugin tests) failed: its worker's result (")
    assert message.endswith("could not be read here: MemoryError: no memory left to read it")


#: A process under a memory cap that asks for a reply within its bound (12 MB) that does
#: not fit what is left of the cap.
CAPPED = """
import resource
from ppokit.trainer.boundary import call_in_worker
from ppokit.trainer.contract import Where
from ppokit.workers import Call, WorkerPool
from tests.test_worker_processes import large

with WorkerPool(large) as pool:
    pool.call(Call(None, (1000,)), 60)
    with open("/proc/self/statm") as f:
        size = int(f.read().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (size + 8 * 2**20, resource.RLIM_INFINITY))
    try:
        call_in_worker(Where("reward", "large", "tests"), pool, [Call(None, (12 * 2**20,))], 60, "s")
    except Exception as exc:
        print(exc)
"""


def test_under_a_memory_cap_a_reply_not_received_is_named_a_reply() -> None:
    proc = _python(CAPPED, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    assert out.strip() == (
        "reward (large, plugin tests) failed: its worker's result could not be received here "
        "(MemoryError); the worker was stopped"
    )


def _hangs() -> None:
    time.sleep(3600)


def test_a_call_in_flight_when_its_pool_closes_says_so() -> None:
    pool = WorkerPool(_hangs)
    pool.start()
    got: list[BaseException] = []

    def call() -> None:
        try:
            pool.call(Call(None), timeout=600)
        except BaseException as exc:
            got.append(exc)

    thread = threading.Thread(target=call)
    thread.start()
    time.sleep(0.5)  # the call sent
    pool.close()
    thread.join(GONE_WITHIN)
    assert not thread.is_alive()
    assert [type(e) for e in got] == [WorkerDied]
    assert str(got[0]) == "its worker process was stopped: its pool closed"


# ------------------------------------------------------------- the working directory
#: A process that starts a pool from a working directory someone else wrote, as ``ppokit``
#: runs (its script's folder first on ``sys.path``, not the working directory).
FROM_THEIR_FOLDER = """
import sys
del sys.path[0]
from ppokit.workers import Call, WorkerPool
with WorkerPool(int) as pool:
    print(pool.call(Call(None, ("7",)), timeout=120))
"""


def test_nothing_planted_in_the_working_directory_runs_in_the_forkserver(tmp_path: Path) -> None:
    """A ``torch.py`` planted where a run starts is not what the forkserver imports (it
    preloads torch), nor a ``multiprocessing`` package: the worker answers, nothing planted ran."""
    ran = tmp_path / "planted-ran"
    plant = f"from pathlib import Path\nPath({str(ran)!r}).write_text(__name__)\n"
    (tmp_path / "torch.py").write_text(plant)
    (tmp_path / "multiprocessing").mkdir()
    (tmp_path / "multiprocessing" / "__init__.py").write_text(plant)
    paths = [str(ROOT), *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    done = subprocess.run(
        [sys.executable, "-c", FROM_THEIR_FOLDER],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["7"]
    assert not ran.exists(), f"{ran.read_text()} planted in the working directory ran"
