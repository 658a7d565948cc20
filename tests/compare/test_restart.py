"""``ppokit compare`` stopped and started again: the runs of a stopped sweep end with it
(SIGINT, SIGTERM, SIGHUP), a restarted sweep waits (a bounded time) for a run another
process still holds and then plans it from what it left, a failed run's recorded error is its
``error:`` line (not the last line of its log), and a second sweep on one folder refuses."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ppokit.compare import COMPARE_LOCK, SweepRun, last_line, run_sweep
from ppokit.errors import UserError
from ppokit.runfolder import LOCK, FolderLock
from ppokit.spec import load_spec
from tests.compare.test_compare import (
    FAKE_TRAIN,
    assert_user_error,
    fake_command,
    invoke,
    write_spec,
)
from tests.helpers import ROOT

pytestmark = [
    pytest.mark.usefixtures("clean_registry"),
    pytest.mark.skipif(os.name != "posix", reason="process groups and POSIX signals"),
]

SWEEP = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from ppokit.compare import run_sweep
    from tests.compare.test_compare import fake_command
    spec, out, script = map(Path, sys.argv[1:4])
    run_sweep([spec], [0, 1], out, jobs=2, live=False, command=fake_command(script, "sleep"),
              grace=5.0)
    """
)

#: Holds a run folder's lock as ppokit train does, then finishes the run and lets go.
HOLDER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from ppokit.runfolder import FolderLock
    run, spec_text, seconds, rounds = Path(sys.argv[1]), sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
    run.mkdir(parents=True, exist_ok=True)
    lock = FolderLock(run)
    lock.acquire()
    print("locked", flush=True)
    time.sleep(seconds)
    (run / "spec.yaml").write_text(spec_text)
    (run / "metrics.jsonl").write_text(
        "".join('{"round": %d, "reward_mean": 0.5}\\n' % r for r in range(1, rounds + 1)))
    lock.release()
    """
)


@pytest.fixture
def fake_script(tmp_path: Path) -> Path:
    path = tmp_path / "fake_train.py"
    path.write_text(FAKE_TRAIN)
    return path


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def all_end(pids: list[int], seconds: float) -> bool:
    """Whether every process of ``pids`` has ended within ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(alive(pid) for pid in pids):
        time.sleep(0.05)
    return not any(alive(pid) for pid in pids)


def wait_for(paths: list[Path], seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not all(p.exists() for p in paths):
        time.sleep(0.05)
    assert all(p.exists() for p in paths), paths


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM", "SIGHUP"])
def test_the_runs_of_a_stopped_sweep_end_with_it(
    tmp_path: Path, fake_script: Path, sig: str
) -> None:
    spec = write_spec(tmp_path, "a")
    out = tmp_path / "sweep"
    sweep = subprocess.Popen(
        [sys.executable, "-c", SWEEP, str(spec), str(out), str(fake_script)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        # as from a terminal, whatever this process inherited: a shell's background job
        # ignores SIGINT, and a sweep started that way keeps ignoring it (by design)
        preexec_fn=_default_sigint,
    )
    env_files = [out / "runs" / "a" / f"seed-{s}.env" for s in (0, 1)]
    try:
        wait_for(env_files)
        time.sleep(0.3)  # the env file is written first thing: let the runs settle
        pids = [json.loads(p.read_text())["pid"] for p in env_files]
        assert all(alive(pid) for pid in pids)
        sweep.send_signal(getattr(signal, sig))
        sweep.wait(timeout=30)
    finally:
        if sweep.poll() is None:
            sweep.kill()
            sweep.wait()
    assert all_end(pids, 10)
    # started again, it finishes every run
    _, runs, completed = run_sweep(
        [spec],
        [0, 1],
        out,
        live=False,
        command=fake_command(fake_script, "ok"),
        stream=io.StringIO(),
    )
    assert completed and [r.status for r in runs] == ["finished", "finished"]


def hold(run: Path, spec: Path, seconds: float, seed: int = 0) -> subprocess.Popen[str]:
    text = load_spec(spec, [f"seed={seed}"]).to_yaml()
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(run), text, str(seconds), "3"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
    return proc


def test_a_restart_waits_for_a_run_still_finishing(tmp_path: Path, fake_script: Path) -> None:
    spec = write_spec(tmp_path, "a")
    out = tmp_path / "sweep"
    run = out / "runs" / "a" / "seed-0"
    holder = hold(run, spec, 2.0)
    try:
        stream = io.StringIO()
        _, runs, completed = run_sweep(
            [spec], [0], out, live=False, command=fake_command(fake_script, "ok"), stream=stream
        )
    finally:
        holder.wait(timeout=30)
    assert completed
    (only,) = runs
    assert (only.status, only.action, only.error) == ("finished", "skip", None)
    assert "waiting" in stream.getvalue() and "finished already" in stream.getvalue()
    assert not (run / "seed-0.env").exists() and not (run.parent / "seed-0.env").exists()


def test_the_wait_is_bounded_and_the_holder_left_alone(tmp_path: Path, fake_script: Path) -> None:
    spec = write_spec(tmp_path, "a")
    out = tmp_path / "sweep"
    run = out / "runs" / "a" / "seed-0"
    holder = hold(run, spec, 60.0)
    try:
        t0 = time.monotonic()
        _, runs, _ = run_sweep(
            [spec],
            [0],
            out,
            live=False,
            command=fake_command(fake_script, "ok"),
            stream=io.StringIO(),
            wait_busy=1.0,
        )
        assert time.monotonic() - t0 < 20
        (only,) = runs
        assert only.status == "failed" and "still in use by another ppokit run" in (
            only.error or ""
        )
        assert sorted(p.name for p in run.iterdir()) == [LOCK]  # no error.txt in its folder
        assert holder.poll() is None  # never signalled
    finally:
        holder.kill()
        holder.wait()


FAILING = """
import sys
sys.stderr.write("ppokit: 1 round(s) on cpu\\n")
sys.stderr.write("error: checkpoint run/checkpoint cannot be used: the real problem\\n")
sys.stderr.write("\\u250f\\u2501\\u2501\\u2501\\u2513\\n\\u2517\\u2501\\u2501\\u2501\\u251b\\n")
sys.stderr.write("+-----+\\n\\n")
sys.exit(1)
"""


def test_the_recorded_error_is_the_error_line(tmp_path: Path) -> None:
    script = tmp_path / "failing.py"
    script.write_text(FAILING)
    spec = write_spec(tmp_path, "a")

    def command(run: SweepRun, overrides: object) -> list[str]:
        return [sys.executable, str(script)]

    out = tmp_path / "sweep"
    _, runs, _ = run_sweep([spec], [0], out, live=False, command=command, stream=io.StringIO())
    (only,) = runs
    expected = "error: checkpoint run/checkpoint cannot be used: the real problem"
    assert only.status == "failed" and only.error == expected
    assert (out / "runs" / "a" / "seed-0" / "error.txt").read_text() == expected + "\n"


def test_the_error_line_of_a_traceback_and_of_a_plain_log(tmp_path: Path) -> None:
    log = tmp_path / "log"
    log.write_text("Traceback (most recent call last):\n  ...\nValueError: bad\n\n")
    assert last_line(log) == "ValueError: bad"
    log.write_text("working\nstopped here\n───────\n")
    assert last_line(log) == "stopped here"


def test_a_second_sweep_on_one_folder_refuses(tmp_path: Path, fake_script: Path) -> None:
    spec = write_spec(tmp_path, "a")
    out = tmp_path / "sweep"
    out.mkdir()
    first = FolderLock(out, COMPARE_LOCK)
    first.acquire()
    try:
        with pytest.raises(UserError, match="in use by another ppokit compare"):
            run_sweep([spec], [0], out, live=False, command=fake_command(fake_script, "ok"))
        assert_user_error(
            invoke(str(spec), "--seeds", "0", "--out", str(out)), "in use by another ppokit compare"
        )
        assert not (out / "runs").exists()
    finally:
        first.release()
    _, runs, completed = run_sweep(
        [spec], [0], out, live=False, command=fake_command(fake_script, "ok"), stream=io.StringIO()
    )
    assert completed and runs[0].status == "finished"


#: A run as ppokit train starts it: tied to the sweep (ppokit.children), its folder locked.
LOCKING_TRAIN = """
import json, os, sys, time
from pathlib import Path
from ppokit.children import tie_to_parent
tie_to_parent()
from ppokit.runfolder import FolderLock
out, seed, rounds, action, mode = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
out.mkdir(parents=True, exist_ok=True)
lock = FolderLock(out)
lock.acquire()
(out.parent / f"seed-{seed}.env").write_text(json.dumps({"pid": os.getpid()}))
if mode == "sleep":
    time.sleep(60)
(out / "spec.yaml").write_text(Path(sys.argv[6]).read_text())
(out / "metrics.jsonl").write_text("".join(json.dumps({"round": r}) + "\\n" for r in range(1, rounds + 1)))
lock.release()
"""

SWEEP_LOCKING = SWEEP.replace("grace=5.0", "grace=5.0, wait_busy=5.0")


def test_the_runs_of_a_killed_sweep_end_with_it_and_a_restart_completes(tmp_path: Path) -> None:
    """SIGKILL (the OOM killer) leaves the sweep no chance to stop its runs: they end with
    it all the same, and a restart of the sweep finishes every run."""
    script = tmp_path / "locking_train.py"
    script.write_text(LOCKING_TRAIN)
    spec = write_spec(tmp_path, "a")
    out = tmp_path / "sweep"
    sweep = subprocess.Popen(
        [sys.executable, "-c", SWEEP_LOCKING, str(spec), str(out), str(script)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    env_files = [out / "runs" / "a" / f"seed-{s}.env" for s in (0, 1)]
    try:
        wait_for(env_files)
        pids = [json.loads(p.read_text())["pid"] for p in env_files]
        assert all(alive(pid) for pid in pids)
        sweep.kill()
        sweep.wait(timeout=30)
    finally:
        if sweep.poll() is None:
            sweep.kill()
            sweep.wait()
    assert all_end(pids, 15)
    _, runs, completed = run_sweep(
        [spec],
        [0, 1],
        out,
        live=False,
        command=fake_command(script, "ok"),
        stream=io.StringIO(),
        wait_busy=5.0,
    )
    assert completed and [r.status for r in runs] == ["finished", "finished"]
