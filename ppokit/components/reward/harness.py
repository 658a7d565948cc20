"""The program that runs inside the ``code_tests`` sandbox
(:mod:`ppokit.components.reward.sandbox`), as text: :data:`HARNESS`.

It is made of the tagged encoding's functions (:mod:`~ppokit.components.reward.tagged_values`,
its one import from ppokit) and its own main; what it runs is the sandbox's, never a verdict:
it must not import what checks a test (:mod:`~ppokit.components.reward.checks`,
:mod:`~ppokit.components.reward.plans`) or starts a sandbox.
"""

from __future__ import annotations

import inspect

from ppokit.components.reward.tagged_values import (
    MAX_DEPTH,
    REPORT_BYTES,
    decode,
    encode,
    refuse_shared_hashes,
)

_HARNESS_MAIN = """\
import json, os, resource


def _send(fd, message):
    data = json.dumps(message, separators=(",", ":")).encode() + b"\\n"
    if len(data) > REPORT_BYTES:  # it could not be read: its number alone
        data = json.dumps(message[:2]).encode() + b"\\n"
    while data:
        data = data[os.write(fd, data):]


def _test(fd, t, items, space):
    name = "test_%d" % t
    for item in items:
        if item[0] == "x":  # setup: an exception ends the test (no "done")
            exec(compile(item[1], name, "exec"), space)
        elif item[0] == "b":  # a constant the test's code names
            space[item[1]] = decode(item[2])
        else:  # a query: its value, or only its number when it raised or cannot cross
            try:
                value = eval(compile(item[2], name, "eval"), space)
                message = [t, item[1], encode(value, [REPORT_BYTES])]
            except BaseException:
                message = [t, item[1]]
            _send(fd, message)
    _send(fd, [t])


def _main():
    chunks = []
    while True:
        chunk = os.read(0, 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
    request = json.loads(b"".join(chunks))
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for name, value in request["limits"].items():
        resource.setrlimit(getattr(resource, name), (value, value))
    fd, tests = request["fd"], request["tests"]
    space = {"__name__": "solution"}
    try:
        exec(compile(request["program"], "program.py", "exec"), space)
    except BaseException:
        return
    for t, items in enumerate(tests):
        if items is None:
            continue
        try:
            pid = os.fork()
        except OSError:  # the program holds every process it may have
            continue
        if pid == 0:
            try:
                _test(fd, t, items, space)
            finally:
                os._exit(0)
        try:
            os.waitpid(pid, 0)
        except OSError:  # reaped already (the program ignores SIGCHLD)
            pass


_main()
os._exit(0)
"""

#: What runs inside the sandbox (``python -I harness.py``): it reads
#: ``{"limits", "fd", "program", "tests"}`` as JSON on its stdin, each test a list of items
#: ``["x", setup source]``, ``["b", name, encoded value]``, ``["q", k, query source]``, and
#: writes one JSON line per answer on the pipe ``fd``: ``[test, k, encoded value]``,
#: ``[test, k]`` (the query raised or its value cannot cross), ``[test]`` (the test's end).
HARNESS = "\n\n".join(
    [
        "from __future__ import annotations",
        f"MAX_DEPTH = {MAX_DEPTH}\nREPORT_BYTES = {REPORT_BYTES}",
        inspect.getsource(encode),
        inspect.getsource(decode),
        inspect.getsource(refuse_shared_hashes),
        _HARNESS_MAIN,
    ]
)
