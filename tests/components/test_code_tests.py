"""The ``code_tests`` reward: programs scored by the fraction of their row's tests they pass
(never by an exit status), and hostile programs in its sandbox, each scoring 0 and leaving
the machine as it was: a fork bomb, endless output, a memory bomb, reading a file outside
its folder and the home folder, writing outside it, opening sockets (to this machine and
beyond), sleeping forever; and the sandbox's memory is bounded: its writable places share
``disk_mb``, and it has no memory outside a file system. Without bubblewrap the reward
refuses to start unless the spec and the run both say unsafe. Programs that forge their
score: tests/components/test_code_tests_forgery.py.

These tests need bubblewrap (``apt-get install bubblewrap``; CI installs it): without it
they skip, except where ``PPOKIT_REQUIRE_SANDBOX=1`` (CI sets it): then they fail."""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
import threading
import time
from pathlib import Path

import pytest

from ppokit.components.reward import bubblewrap
from ppokit.components.reward.bubblewrap import sandbox_problem
from ppokit.components.reward.sandbox import UNSAFE_ENV, extract_program
from ppokit.errors import UserError
from tests.helpers.components import make

PROBLEM = sandbox_problem("/usr/bin/python3")
if PROBLEM is not None and os.environ.get("PPOKIT_REQUIRE_SANDBOX") == "1":
    raise RuntimeError(f"PPOKIT_REQUIRE_SANDBOX=1 but {PROBLEM}")
needs_sandbox = pytest.mark.skipif(PROBLEM is not None, reason=str(PROBLEM))

ADD = "def add(a, b):\n    return a + b\n"
TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4"]


def _score(programs: list[str], tests: list[str] = TESTS, **params) -> list[float]:
    reward = make("reward", "code_tests", **{"timeout": 10.0, **params})
    out = reward(["p"] * len(programs), programs, tests=[tests] * len(programs))
    return out.scores


@needs_sandbox
def test_the_fraction_of_tests_passed() -> None:
    programs = [
        ADD,
        "def add(a, b):\n    return 4 if a == 2 else a - b\n",  # passes 1 of 3
        "```python\n" + ADD + "```\nThis adds.",  # a fenced block
        "def add(a, b):\n    raise SystemExit(0)\n",  # every test exits 0: no test passes
        "import sys\nsys.exit(0)\n",  # the program exits 0 before any test
        "import os\nos._exit(0)\n",  # the process ends with status 0, no report
        "def add(a, b:\n",  # a syntax error
        "def add(a, b):\n    return a + b\nprint('ok'); input()\n",  # stdin is empty: EOFError
    ]
    assert _score(programs) == [1.0, 1 / 3, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]


@needs_sandbox
def test_tests_as_json_text_and_a_row_without_tests() -> None:
    reward = make("reward", "code_tests")
    out = reward(["p", "p"], [ADD, ADD], tests=['["assert add(1, 1) == 2"]', []])
    assert out.scores == [1.0, 0.0]
    with pytest.raises(UserError, match="must hold a list of Python statements"):
        reward(["p"], [ADD], tests=[{"a": 1}])
    with pytest.raises(UserError, match="needs the field 'tests'"):
        reward(["p"], [ADD])


def _ours() -> set[int]:
    """Processes of the sandbox's user now (nobody's, when the tests run as root)."""
    uid = 65534 if os.geteuid() == 0 else os.getuid()
    found = set()
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            text = status.read_text()
        except OSError:
            continue
        if f"\nUid:\t{uid}\t" in text:
            found.add(int(status.parent.name))
    return found


@needs_sandbox
def test_hostile_programs_score_zero_and_leave_the_machine_as_it_was(tmp_path: Path) -> None:
    # a folder anyone may read and write: only the sandbox keeps the programs out of it
    shared = tmp_path / "shared"
    shared.mkdir()
    for folder in (shared, *shared.parents):
        if str(folder).startswith(tempfile.gettempdir() + "/"):
            folder.chmod(folder.stat().st_mode | 0o755)
    shared.chmod(0o777)
    secret = shared / "secret.txt"
    secret.write_text("the secret")
    secret.chmod(0o644)
    outside = shared / "pwned"
    with socket.socket() as listener:  # a server on this machine's loopback
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        listener.settimeout(0.1)
        port = listener.getsockname()[1]
        accepted: list[object] = []
        stop = threading.Event()

        def accept() -> None:
            while not stop.is_set():
                with contextlib.suppress(OSError):
                    accepted.append(listener.accept())

        watcher = threading.Thread(target=accept)
        watcher.start()
        hostile = {
            "fork bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
            "endless output": "while True:\n    print('x' * 4096)\n",
            "endless file": "with open('big', 'w') as f:\n    while True:\n        f.write('x' * 65536)\n",
            "memory bomb": "blob = bytearray(1 << 40)\n" + ADD,
            "reads outside": f"SECRET = open({str(secret)!r}).read()\n" + ADD,
            "reads home": "import os\nSECRET = os.listdir(os.path.expanduser('~root'))\n" + ADD,
            "writes outside": f"open({str(outside)!r}, 'w').write('x')\n" + ADD,
            "local socket": f"import socket\nsocket.create_connection(('127.0.0.1', {port}), 2)\n"
            + ADD,
            "remote socket": "import socket\nsocket.create_connection(('1.1.1.1', 53), 2)\n" + ADD,
            "sleeps": "import time\ntime.sleep(10 ** 6)\n" + ADD,
            "forks and sleeps": "import os, time\nif os.fork() == 0:\n    os.setsid()\n"
            "    time.sleep(10 ** 6)\n" + ADD + "add = None\n",
        }
        before = _ours()
        temp_before = set(Path(tempfile.gettempdir()).glob("ppokit-code-*"))
        reward = make(
            "reward", "code_tests", timeout=2.0, processes=8, memory_mb=256, concurrency=4
        )
        out = reward(["p"] * len(hostile), list(hostile.values()), tests=[TESTS] * len(hostile))
        stop.set()
        watcher.join()
    assert dict(zip(hostile, out.scores, strict=True)) == dict.fromkeys(hostile, 0.0)
    stopped = dict(zip(hostile, out.flags["timed_out"], strict=True))
    assert stopped["sleeps"] and stopped["fork bomb"] and not stopped["reads outside"]
    assert not accepted  # no connection reached this machine's server
    assert not outside.exists() and secret.read_text() == "the secret"
    deadline = time.monotonic() + 10  # the kernel ends a namespace's processes at once
    while not _ours() <= before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _ours() <= before  # every process of every sandbox is gone
    assert set(Path(tempfile.gettempdir()).glob("ppokit-code-*")) <= temp_before


@needs_sandbox
@pytest.mark.parametrize("disable_userns", [True, False], ids=["bwrap-0.8", "seccomp-alone"])
def test_writable_places_share_disk_mb(monkeypatch, disable_userns: bool) -> None:
    """Every place the program can write (/work, /tmp, /dev/shm; not /, /dev, /task, /usr)
    is one file system of ``disk_mb``: with ``disk_mb: 4`` each takes 1 MiB, then 6 MiB
    more to each stops at 4 MiB in all (the old sandbox let a program write 900 MB of host
    memory through / and /dev/shm). And no memory outside a file system: no user namespace
    of its own (where it could mount a tmpfs of no bound), no System V shared memory (it
    held 512 MB past ``memory_mb: 128``), no memfd; threads and processes still start.
    Without bubblewrap's --disable-userns (before 0.8) the seccomp filter alone refuses the
    user namespace."""
    if not disable_userns:
        monkeypatch.setattr(bubblewrap, "_disables_userns", lambda bwrap: False)
    program = """
import os
PLACES = ["/dev/shm", "/tmp", "/work", "/", "/dev", "/task", "/usr"]
WRITTEN = dict.fromkeys(PLACES, 0)
def fill(place, size, name):
    try:
        with open(os.path.join(place, name), "wb", buffering=0) as f:
            while WRITTEN[place] < size:
                WRITTEN[place] += f.write(b"x" * (256 << 10))
    except OSError:
        pass
for place in PLACES:
    fill(place, 1 << 20, "first")
FIRST = dict(WRITTEN)
for place in PLACES:
    fill(place, 6 << 20, "more")
def first(place):
    return FIRST[place]
def written(place):
    return WRITTEN[place]
def total():
    return sum(WRITTEN.values())
def new_user_namespace():
    import ctypes
    return ctypes.CDLL(None, use_errno=True).unshare(0x10000000)  # CLONE_NEWUSER
def shared_memory():
    import ctypes
    return ctypes.CDLL(None, use_errno=True).shmget(0, 1 << 20, 0o1600)  # IPC_CREAT | 0600
def memory_file():
    try:
        os.close(os.memfd_create("x"))
    except OSError:
        return False
    return True
def threads_and_processes():
    import concurrent.futures, subprocess
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        squares = list(pool.map(abs, [-1, -2]))
    return squares, subprocess.run(["true"]).returncode, os.waitpid(os.fork() or os._exit(3), 0)[1] >> 8
"""
    tests = [
        "assert first('/dev/shm') == first('/tmp') == first('/work') == 1 << 20",
        "assert written('/') == written('/dev') == 0",
        "assert written('/task') == written('/usr') == 0",
        "assert 3 << 20 < total() <= 4 << 20",
        "assert new_user_namespace() == -1",
        "assert shared_memory() == -1 and memory_file() is False",
        "assert threads_and_processes() == ([1, 2], 0, 3)",
    ]
    reward = make("reward", "code_tests", disk_mb=4, file_mb=16, timeout=20.0)
    out = reward(["p"], [program], tests=[tests])
    assert out.scores == [1.0]


def test_extract_program() -> None:
    assert extract_program("no fence") == "no fence"
    text = "first\n```py\na = 1\n```\nthen\n```python\nb = 2\n```\n"
    assert extract_program(text) == "b = 2\n"


def test_without_isolation_it_refuses_unless_spec_and_run_say_unsafe(monkeypatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")  # no bwrap
    monkeypatch.delenv(UNSAFE_ENV, raising=False)
    with pytest.raises(UserError) as info:
        make("reward", "code_tests")
    text = str(info.value)
    assert "bubblewrap is not installed" in text and "unsafe: true" in text and "\n" not in text
    with pytest.raises(UserError, match=f"no {UNSAFE_ENV}=1"):
        make("reward", "code_tests", unsafe=True)
    monkeypatch.setenv(UNSAFE_ENV, "1")
    reward = make("reward", "code_tests", unsafe=True, timeout=10.0)
    assert not reward.isolated
    assert reward(["p"] * 2, [ADD, "add = None"], tests=[TESTS] * 2).scores == [1.0, 0.0]


#: A solution of each of examples/data/code_tasks.jsonl's functions, in its rows' order.
EXAMPLE_SOLUTIONS = [
    "def square(x):\n    return x * x\n",
    "def add(a, b):\n    return a + b\n",
    "def is_even(n):\n    return n % 2 == 0\n",
    "def reverse_string(s):\n    return s[::-1]\n",
    "def count_vowels(s):\n    return sum(c in 'aeiou' for c in s)\n",
    "import math\ndef factorial(n):\n    return math.factorial(n)\n",
    "def largest(xs):\n    return max(xs)\n",
    "def fizzbuzz(n):\n    return 'Fizz' * (n % 3 == 0) + 'Buzz' * (n % 5 == 0) or str(n)\n",
    "def sum_digits(n):\n    return sum(int(d) for d in str(n))\n",
    "def is_palindrome(s):\n    return s == s[::-1]\n",
    "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
    "import math\ndef gcd(a, b):\n    return math.gcd(a, b)\n",
]


@needs_sandbox
def test_the_example_code_tasks_are_solvable_and_checked_in_ppokit() -> None:
    """examples/data/code_tasks.jsonl (examples/specs/smollm2_code_cpu.yaml's data): each
    row's tests pass a solution, each test is checked in ppokit's process (none forgeable),
    and a response answering every row with another row's solution scores under 1."""
    import json

    path = Path(__file__).resolve().parents[2] / "examples" / "data" / "code_tasks.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == len(EXAMPLE_SOLUTIONS)
    reward = make("reward", "code_tests", timeout=10.0, concurrency=2)
    tests = [row["tests"] for row in rows]
    right = reward([r["prompt"] for r in rows], EXAMPLE_SOLUTIONS, tests=tests)
    assert right.scores == [1.0] * len(rows)
    assert right.flags["forgeable"] == [False] * len(rows)
    shifted = EXAMPLE_SOLUTIONS[1:] + EXAMPLE_SOLUTIONS[:1]
    wrong = reward([r["prompt"] for r in rows], shifted, tests=tests)
    assert max(wrong.scores) < 1.0
