"""The ``code_tests`` reward against programs that forge their score instead of solving
the task: each forgery, written as a policy could emit it against tests such as
``assert square(3) == 9``, scores 0 while a correct solution in the same batch scores 1.
The verdict is computed in ppokit's process from the values the sandbox answers to the
tests' queries: the sandbox never sees an expected value, and only plain data crosses.
Also: what ppokit's process checks behaves as Python would. docs/rewards.md's table of
attacks names these tests.

These tests need bubblewrap as tests/components/test_code_tests.py does (skipped without
it unless ``PPOKIT_REQUIRE_SANDBOX=1``); the tests of the test splitting and of the
encoding run anywhere."""

from __future__ import annotations

import json
import math
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ppokit.components.reward.plans import plan_test
from ppokit.components.reward.sandbox import UNSAFE_ENV, _answers
from ppokit.components.reward.tagged_values import MAX_DEPTH, REPORT_BYTES, decode, encode
from tests.components.test_code_tests import needs_sandbox
from tests.helpers.components import make

SQUARE = "def square(x):\n    return x * x\n"
WRONG = "def square(x):\n    return -1\n"
TESTS = [
    "assert square(3) == 9",
    "assert square(-2) == 4",
    "assert square(5) == 25",
    "assert square(7) == 49",
]

#: Programs that solve nothing (their ``square`` is wrong) and try to pass anyway.
FORGERIES = {
    "exec replaced": """
import builtins
_exec = builtins.exec
def exec(code, *args, **kwargs):
    try:
        return _exec(code, *args, **kwargs)
    except AssertionError:
        return None
builtins.exec = exec
""",
    "compile replaced": """
import builtins
_compile = builtins.compile
def compile(source, name, mode, *args, **kwargs):
    return _compile("True" if mode == "eval" else "pass", name, mode)
builtins.compile = compile
""",
    "eval gives an always-equal object": """
import builtins
class Equal:
    def __eq__(self, other): return True
    def __ne__(self, other): return False
    def __bool__(self): return True
    __hash__ = object.__hash__
builtins.eval = lambda *args, **kwargs: Equal()
""",
    "reports on fds 0-20 and /proc/self/fd": """
import json, os
LINES = b"".join(b"%d 1\\n" % i for i in range(8))  # lines of a report of passes
for t in range(8):
    LINES += json.dumps([t]).encode() + b"\\n"
    for v in range(-100, 100):  # every small answer: only the first counts
        LINES += json.dumps([t, 0, ["i", hex(v)]]).encode() + b"\\n"
for fd in range(21):
    try:
        os.write(fd, LINES)
    except OSError:
        pass
for name in os.listdir("/proc/self/fd"):
    try:
        with open("/proc/self/fd/" + name, "wb") as f:
            f.write(LINES)
    except OSError:
        pass
""",
    "a thread reports while square sleeps": """
import json, os, threading, time
def spam():
    lines = b"".join(b"%d 1\\n" % i for i in range(8))
    lines += b"".join(json.dumps(m).encode() + b"\\n" for t in range(8)
                      for m in ([t, 0, ["b", True]], [t]))
    while True:
        for fd in range(3, 21):
            try:
                os.write(fd, lines)
            except OSError:
                pass
        time.sleep(0.001)
threading.Thread(target=spam, daemon=True).start()
_square = lambda x: -1
def square(x):
    time.sleep(0.2)
    return _square(x)
""",
    "harness patched (__main__, gc, frames)": """
import gc, json, os, sys
main = sys.modules["__main__"]
def _send(fd, message):
    os.write(fd, json.dumps(message).encode() + b"\\n")
def _test(fd, t, items, space):
    for item in items:
        if item[0] == "q":
            _send(fd, [t, item[1], ["b", True]])
    _send(fd, [t])
for name, value in (("_send", _send), ("_test", _test), ("report", lambda fd, b: None),
                    ("encode", lambda value, budget, depth=0: ["b", True])):
    setattr(main, name, value)
for obj in gc.get_objects():  # the tests, wherever they are held
    if isinstance(obj, list):
        for i, item in enumerate(obj):
            if isinstance(item, str) and item.startswith("assert"):
                obj[i] = "pass"
            elif isinstance(item, list) and item[:1] == ["q"]:
                item[2] = "True"
frame = sys._getframe()
while frame is not None:
    for key in ("tests", "request"):
        if key in frame.f_globals and isinstance(frame.f_globals[key], list):
            frame.f_globals[key][:] = ["pass"] * len(frame.f_globals[key])
    frame = frame.f_back
""",
    "always-equal object": """
class Equal:
    def __eq__(self, other): return True
    def __ne__(self, other): return False
    def __bool__(self): return True
    __hash__ = object.__hash__
_square = lambda x: Equal()
""",
    "int subclass with a lying __eq__": """
class Lie(int):
    def __eq__(self, other): return True
    def __ne__(self, other): return False
    __hash__ = int.__hash__
_square = lambda x: Lie(-1)
""",
    "str and list subclasses with a lying __eq__": """
class S(str):
    def __eq__(self, other): return True
class L(list):
    def __eq__(self, other): return True
_square = lambda x: S("x") if x > 0 else L([])
""",
    "answers from the tests it finds (files, /proc, memory)": r"""
import os, re
FOUND = {}
PATTERN = re.compile(rb"square\((-?\d+)\) == (-?\d+)")
def scan(data):
    for a, b in PATTERN.findall(data):
        FOUND[int(a)] = int(b)
def read(path, size=1 << 22):
    try:
        with open(path, "rb") as f:
            return f.read(size)
    except OSError:
        return b""
for root in ("/task", "/work", "/tmp", "/dev/shm"):
    for folder, _, files in os.walk(root):
        for name in files:
            scan(read(os.path.join(folder, name)))
for pid in os.listdir("/proc"):
    if not pid.isdigit():
        continue
    for part in ("cmdline", "environ"):
        scan(read("/proc/%s/%s" % (pid, part)))
    try:
        maps = open("/proc/%s/maps" % pid).read().splitlines()
        mem = open("/proc/%s/mem" % pid, "rb")
    except OSError:
        continue
    for line in maps:
        span, perms = line.split()[:2]
        start, end = (int(x, 16) for x in span.split("-"))
        if "r" in perms and end - start < 1 << 26:
            try:
                mem.seek(start)
                scan(mem.read(end - start))
            except (OSError, ValueError, OverflowError):
                pass
FOUND.pop(None, None)
_square = lambda x: FOUND.get(x, -1)
""",
    "exits 0 at import": "import os\nos._exit(0)\n",
    "sys.exit at import": "import sys\nsys.exit(0)\n",
    "kills its harness": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n",
    "a signal handler reports": """
import json, os, signal
def handler(signum, frame):
    for fd in range(3, 21):
        for t in range(8):
            try:
                os.write(fd, json.dumps([t, 0, ["b", True]]).encode() + b"\\n")
                os.write(fd, json.dumps([t]).encode() + b"\\n")
            except OSError:
                pass
signal.signal(signal.SIGALRM, handler)
signal.setitimer(signal.ITIMER_REAL, 0.01, 0.01)
_square = lambda x: -1
""",
    "malformed and huge answers": """
import os
JUNK = b"[" * 100000 + b"\\n" + b"[" + b"9" * 100000 + b", 0]\\n" + b"[NaN]\\n[1e999]\\n"
JUNK += b'[0, 0, ["i", "' + b"f" * 300000 + b'"]]\\n'
for fd in range(3, 21):
    try:
        os.write(fd, JUNK)
    except OSError:
        pass
nested = []
for _ in range(10000):
    nested = [nested]
_square = lambda x: nested if x > 0 else 10 ** 5000
""",
}
FORGERIES = {
    name: source + ("def square(x):\n    return _square(x)\n" if "_square" in source else WRONG)
    for name, source in FORGERIES.items()
}
#: The forgeries that need the sandbox's isolation (they read every process they can, or
#: signal their harness): the unsafe mode does not promise to stop them.
ISOLATED_ONLY = {"answers from the tests it finds (files, /proc, memory)", "kills its harness"}


def _scores(programs: dict[str, str], tests: list[str] = TESTS, **params) -> dict[str, float]:
    reward = make("reward", "code_tests", **{"timeout": 10.0, "concurrency": 4, **params})
    out = reward(["p"] * len(programs), list(programs.values()), tests=[tests] * len(programs))
    return dict(zip(programs, out.scores, strict=True))


@needs_sandbox
def test_forgeries_score_zero_and_a_solution_one() -> None:
    started = time.monotonic()
    scores = _scores({"a solution": SQUARE, **FORGERIES})
    assert scores == {"a solution": 1.0, **dict.fromkeys(FORGERIES, 0.0)}
    assert time.monotonic() - started < 60  # malformed answers are read in bounded time


def test_forgeries_score_zero_without_isolation_too(monkeypatch) -> None:
    """The unsafe mode runs the same harness: the verdict is still ppokit's."""
    monkeypatch.setenv("PATH", "/nonexistent")  # no bwrap
    monkeypatch.setenv(UNSAFE_ENV, "1")
    programs = {k: v for k, v in FORGERIES.items() if k not in ISOLATED_ONLY}
    scores = _scores({"a solution": SQUARE, **programs}, unsafe=True)
    assert scores == {"a solution": 1.0, **dict.fromkeys(programs, 0.0)}


@needs_sandbox
def test_partial_solutions_and_a_crash_that_costs_one_test() -> None:
    programs = {
        "half": "def square(x):\n    return {3: 9, -2: 4}.get(x, 0)\n",
        "exits in test 2": "import os\ndef square(x):\n    if x == -2:\n        os._exit(0)\n"
        "    return x * x\n",
        "crashes in test 2": "def square(x):\n    return 1 // (x + 2) if x == -2 else x * x\n",
        "kills itself in test 2": "import os, signal\ndef square(x):\n    if x == -2:\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n    return x * x\n",
        "a numpy-like int": "class Int(int):\n    pass\ndef square(x):\n    return Int(x * x)\n",
        "ignores SIGCHLD": "import signal\nsignal.signal(signal.SIGCHLD, signal.SIG_IGN)\n"
        + SQUARE,
    }
    assert _scores(programs) == {
        "half": 0.5,
        "exits in test 2": 0.75,
        "crashes in test 2": 0.75,
        "kills itself in test 2": 0.75,
        "a numpy-like int": 1.0,
        "ignores SIGCHLD": 1.0,
    }


#: Tests of many forms, with the reference solution of ``f`` and ``g`` that passes them all.
FORMS = {
    "assert f(2) == 4": True,
    "assert 4 == f(2)": True,
    "assert not f(2) != 4": True,
    "assert 0 < f(2) < 10 and f(3) >= 9": True,
    "assert abs(g(2) - 1.5) < 1e-9": True,
    "import math\nassert math.isclose(g(3), 1.0, rel_tol=1e-6)": True,
    "assert g(0) == float('inf')": True,
    "assert math.isnan(g(-1))": True,
    "assert isinstance(f(2), int) and type(g(2)) is float": True,
    "assert h(3) == [0, 1, 2] and h(0) == []": True,
    "assert set(h(3)) == {2, 1, 0} and sorted(h(3), reverse=True) == [2, 1, 0]": True,
    "assert len(h(4)) == 4 and sum(h(4)) == 6 and max(h(4)) == 3": True,
    "assert pair(1) == (1, 'x') and pair(1) != [1, 'x']": True,
    "assert table() == {'a': {1, 2}, ('k',): frozenset({b'z'})}": True,
    "assert f(2) is not None and nothing() is None": True,
    "assert boom() == 1 or f(1) == 1": False,  # Python evaluates boom() first: it raises
    "assert f(1) == 1 or boom() == 1": True,  # short-circuit: boom()'s error does not count
    "assert f(1) == 2 and boom() == 1": False,
    "x = f(3)\nassert x == 9": True,
    "expected = 16\nassert f(4) == expected": True,
    "n = 5\nassert f(n) == n * n": True,
    "assert (r := f(3)) == 9 and r + 1 == 10": True,
    "for a, b in [(1, 1), (2, 4), (3, 9)]:\n    assert f(a) == b": True,
    "for i in range(5):\n    assert f(i) == i * i": True,
    "ins = [1, 2, 3]\nouts = [1, 4, 9]\nfor i in range(len(ins)):\n    assert f(ins[i]) == outs[i]": True,
    "table = {2: [4, 'x']}\nassert f(2) == table[2][0] and pair(1)[1:] == ('x',)": True,
    "assert sorted(h(3), reverse=True) == sorted([0, 2, 1])[::-1]": True,
    "def check(candidate):\n    assert candidate(2) == 4\n    for x in [3, 4]:\n"
    "        assert candidate(x) == x * x\ncheck(f)": True,
    "def check(candidate):\n    assert candidate(2) == 5\ncheck(f)": False,
    "assert f(2) == 5": False,
    "assert g(2) == 1.5 + 1e-6": False,
    "assert f(": False,  # a syntax error: the test fails, the others run
    "f(2)": True,  # no assert: passes by running to its end (flagged forgeable)
    "boom()": False,
}
REFERENCE = """
def f(x):
    return x * x
def g(x):
    return 3 / x if x > 0 else (float('inf') if x == 0 else float('nan'))
def h(n):
    return list(range(n))
def pair(x):
    return (x, 'x')
def table():
    return {'a': {1, 2}, ('k',): frozenset({b'z'})}
def nothing():
    return None
def boom():
    raise ValueError('boom')
"""


@needs_sandbox
def test_each_test_form_is_checked_as_python_would() -> None:
    reward = make("reward", "code_tests", timeout=20.0)
    tests = list(FORMS)
    out = reward(["p"] * len(tests), [REFERENCE] * len(tests), tests=[[t] for t in tests])
    assert dict(zip(tests, out.scores, strict=True)) == {t: float(ok) for t, ok in FORMS.items()}
    forgeable = dict(zip(tests, out.flags["forgeable"], strict=True))
    assert forgeable == {t: t in ("f(2)", "boom()") for t in tests}


# --- what crosses and what is sent: no sandbox needed ---------------------------------------

MARK = "Zq8w3x"  # an expected value no test's input contains


@pytest.mark.parametrize(
    "test",
    [
        "assert f(1) == 'M'",
        "assert 'M' == f(1)",
        "assert f(1) in ['M', 'N']",
        "assert f(1) == ('M', 2) and f(2) != {'k': 'M'}",
        "assert set(f(1)) == {'M'}",
        "expected = 'M'\nassert f(1) == expected",
        "pairs = [(1, 'M'), (2, 'M')]\nfor a, b in pairs:\n    assert f(a) == b",
        "def check(candidate):\n    assert candidate(1) == 'M'\ncheck(f)",
        "assert f(1) + 'M' == 'MM'",
        "assert str(f(1)) == 'M' or len(f(1)) == len('M')",
        "assert sorted(f(1)) == sorted(['M', 'N'])",
        "ins = [1, 2]\nouts = ['M', 'N']\nfor i in range(len(ins)):\n    assert f(ins[i]) == outs[i]",
        "table = {'k': 'M'}\nassert f('k') == table['k'] and f(2) == table['k'][::-1]",
    ],
)
def test_expected_values_are_never_sent(test: str) -> None:
    """What goes into the sandbox (the plan's items) holds no literal of a check."""
    plan = plan_test(test.replace("M", MARK))
    assert plan.items is not None and plan.checks and not plan.forgeable
    assert MARK not in json.dumps(plan.items)


def test_forgeable_tests_are_flagged() -> None:
    assert not plan_test("assert f(3) == 9").forgeable
    assert not plan_test("assert f(3)").forgeable  # the program cannot tell `not f(3)` from it
    assert plan_test("assert f(3) == g(3)").forgeable  # the program answers both sides
    assert plan_test("check(f)").forgeable  # no top-level assert: it passes by ending
    assert plan_test("assert f(3) == 9\nif f(4) != 16:\n    raise ValueError").forgeable
    assert plan_test("assert f(").items is None


def test_queries_get_a_test_constant_only_where_they_name_it() -> None:
    plan = plan_test("n = 5\nexpected = 25\nassert f(n) == expected")
    assert plan.items == [["b", "n", ["i", "0x5"]], ["q", 0, "f(n)"]]


PLAIN = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(2**200), max_value=2**200)
    | st.floats(allow_nan=True)
    | st.complex_numbers(allow_nan=False)
    | st.text()
    | st.binary(),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.lists(inner, max_size=4).map(tuple)
        | st.frozensets(st.integers() | st.text(), max_size=4)
        | st.sets(st.integers(), max_size=4)
        | st.dictionaries(st.text() | st.integers(), inner, max_size=4)
    ),
    max_leaves=20,
)


def _same(a, b) -> bool:
    """Equal, of the same type all the way down, nan equal to nan."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or (a == b and str(a) == str(b))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


@settings(max_examples=200, deadline=None)
@given(PLAIN)
def test_plain_values_cross_exactly(value) -> None:
    line = json.dumps([0, 0, encode(value, [REPORT_BYTES])])
    assert _same(decode(json.loads(line)[2]), value)


@settings(max_examples=300, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(), st.lists, max_leaves=30))
def test_any_json_decodes_to_plain_values_or_is_refused(data) -> None:
    try:
        value = decode(data)
    except (ValueError, TypeError, OverflowError):
        return
    encode(value, [REPORT_BYTES])  # it re-encodes: only plain values are ever built


def test_what_cannot_cross() -> None:
    class Other:
        pass

    nested: list = []
    for _ in range(MAX_DEPTH + 2):
        nested = [nested]
    for value in (Other(), [Other()], nested, "x" * (REPORT_BYTES + 1), len, range(3)):
        with pytest.raises(ValueError):
            encode(value, [REPORT_BYTES])


def test_the_first_answer_counts_and_junk_is_skipped() -> None:
    plans = [plan_test("assert f(1) == 1"), plan_test("assert f(2) == 4")]
    lines = [
        b"[" * 5000,
        b'[0, 0, ["i", "0x1"]]',
        b'[0, 0, ["i", "0x2"]]',  # a second answer to the same query: ignored
        b'[1, 0, ["i", "0x4"]]',
        b"[0]",
        b"[1, 0]",
        b"[" + b"9" * 5000 + b"]",
        b"[1]",
        b'[1, 7, ["n"]]',
        b"[0",  # cut off
    ]
    values, done = _answers(b"\n".join(lines), plans)
    assert values == [{0: 1}, {0: 4}] and done == [True, True]
    assert [p.passed(v, d) for p, v, d in zip(plans, values, done, strict=True)] == [True, True]
    assert not plans[0].passed({0: 1}, False)  # the test never reached its end


def test_answers_that_would_make_ppokits_check_slow_are_refused() -> None:
    """A program chooses its answers: ints equal modulo 2**61 - 1 (one hash) in a set, or
    numbers too large to divide or write out, fail the test in bounded time instead of
    holding the trainer's process."""
    prime = 2**61 - 1
    colliding = [k * prime for k in range(1, 30000)]
    started = time.monotonic()
    with pytest.raises(ValueError, match="equal hashes"):
        decode(["S", [["i", hex(v)] for v in colliding]])
    with pytest.raises(ValueError, match="equal hashes"):
        decode(["d", [[["i", hex(v)], ["n"]] for v in colliding]])
    assert not plan_test("assert set(f(1)) == {1}").passed({0: colliding}, True)
    huge = 1 << (REPORT_BYTES * 4 - 8)
    for test in ("assert f(1) % 7 == 1", "assert str(f(1)) == '1'", "assert f(1) * f(1) == 1"):
        assert not plan_test(test).passed({0: huge, 1: huge}, True)
    assert not plan_test("assert 2 ** f(1) == 1").passed({0: 10**9}, True)
    assert not plan_test("assert 'x' * f(1) == 'x'").passed({0: 10**12}, True)
    assert time.monotonic() - started < 5  # unguarded, each takes seconds or all memory
