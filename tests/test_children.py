"""Processes ppokit starts: a child (a sweep's run, a process of ``train --nproc``) imports
nothing from the working directory, and a command ends when its work is done even if a
plugin left a thread running that is not a daemon."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from ppokit.children import child_env, python_command
from ppokit.compare import SweepRun, train_command
from ppokit.launcher import launch_args
from tests.helpers import ROOT, path_plugin

#: A module named as one ppokit imports, planted in the working directory.
PLANTED = """\
from pathlib import Path
Path(__file__).with_name("planted-ran").touch()
raise SystemExit("the planted module ran")
"""


def test_a_child_imports_nothing_from_the_working_directory(tmp_path: Path) -> None:
    (tmp_path / "typer.py").write_text(PLANTED)
    (tmp_path / "rich.py").write_text(PLANTED)
    done = subprocess.run(
        python_command(["--version"]),
        cwd=tmp_path,
        env=child_env(os.environ),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and done.stdout.startswith("ppokit "), done.stderr
    assert not (tmp_path / "planted-ran").exists()


def test_the_sweeps_and_the_launchers_children_are_started_so(tmp_path: Path) -> None:
    run = SweepRun("a", 0, tmp_path / "run", tmp_path / "a.yaml", rounds=1, action="new")
    argv = train_command(run, [])
    assert argv[:3] == python_command([]) and "-m" not in argv
    args = launch_args(2, ["train", "spec.yaml"])
    assert args[args.index("--no-python") + 1 :] == python_command(["train", "spec.yaml"])


#: A plugin whose import starts a thread that is not a daemon and never ends.
LINGERS = """\
import threading
import time

import ppokit

threading.Thread(target=time.sleep, args=(3600,), name="plugin-poller").start()


@ppokit.hookimpl
def ppokit_register(register):
    register(ppokit.Component("advantage", "lingering", "ppokit_lingers", summary="lingers"))
"""


def _list_with(tmp_path: Path, name: str, code: str) -> subprocess.CompletedProcess[str]:
    """``ppokit list advantage --json`` in a child process that finds the plugin
    ``ppokit-<name>`` (module ``ppokit_<name>``, ``code``) on its path."""
    site = path_plugin(tmp_path / "site", f"ppokit-{name}", f"ppokit_{name}", code, name)
    env = child_env(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(site), env["PYTHONPATH"]])
    return subprocess.run(
        [sys.executable, "-m", "ppokit", "list", "advantage", "--json"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_command_ends_when_a_plugin_left_a_thread_running(tmp_path: Path) -> None:
    # without the fix: Python waits for the thread for an hour (the child's timeout: 120 s)
    done = _list_with(tmp_path, "lingers", LINGERS)
    assert done.returncode == 0, done.stderr
    assert "lingering" in {row["name"] for row in json.loads(done.stdout)}
    assert "waiting up to 5 s for threads to end: plugin-poller" in done.stderr


#: A plugin whose module is slow to tear down, and leaves a file open with unflushed text.
SLOW_TEARDOWN = """\
import time

import ppokit


class Slow:
    def __del__(self, sleep=time.sleep):  # the module's globals may be gone by then
        sleep(60)


slow = Slow()
unclosed = open({written!r}, "w")
unclosed.write("written")


@ppokit.hookimpl
def ppokit_register(register):
    register(ppokit.Component("advantage", "slow", "ppokit_slow", summary="slow"))
"""


def test_a_command_ends_without_the_teardown_of_its_modules(tmp_path: Path) -> None:
    """torch and transformers make Python's teardown of the modules seconds long; the
    command ends once its exit functions ran and its open files are flushed."""
    written = tmp_path / "written.txt"
    code = SLOW_TEARDOWN.format(written=str(written))
    began = time.monotonic()
    done = _list_with(tmp_path, "slow", code)
    assert done.returncode == 0, done.stderr
    assert "slow" in {row["name"] for row in json.loads(done.stdout)}
    assert time.monotonic() - began < 40  # the teardown would take 60 s
    assert written.read_text() == "written"
