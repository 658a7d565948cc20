"""A process of ``ppokit train --nproc 2`` killed by a signal: the launcher says which
process ended how (``process 1 (pid N) was killed by signal SIGKILL``), where the last
checkpoint is and the command that resumes the run, and exits non-zero (128 + the signal's
number, as a shell reports it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ppokit.launcher import ended_lines
from tests.helpers import path_plugin

#: A reward whose process 1 kills itself with SIGKILL in round 2 (its second call).
DIES = """\
import os
import signal

import ppokit

calls = 0


def score(prompts, responses, **fields):
    global calls
    calls += 1
    if os.environ.get("RANK") == "1" and calls == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    return [0.0] * len(responses)


def make():
    return score


@ppokit.hookimpl
def ppokit_register(register):
    register(ppokit.Component("reward", "dies_in_round_2", make, summary="dies"))
"""


def test_the_lines_say_which_process_ended_how() -> None:
    status, lines = ended_lines({1: (4242, -signal.SIGKILL), 0: (4241, 1)})
    assert status == 128 + signal.SIGKILL  # the first to fail
    assert lines[0].startswith("error: process 1 (pid 4242) was killed by signal SIGKILL: ")
    assert "out-of-memory" in lines[0]
    assert lines[1] == "error: process 0 (pid 4241) exited with status 1"
    assert ended_lines({0: (1, 3), 1: (2, 4)}) == (
        3,
        [
            "error: process 0 (pid 1) exited with status 3",
            "error: process 1 (pid 2) exited with status 4",
        ],
    )
    status, lines = ended_lines({1: (7, -signal.SIGSEGV)})
    assert status == 128 + signal.SIGSEGV and "SIGSEGV: a crash in native code" in lines[0]
    # the process the signal killed gives the status, whichever the launcher saw end first
    assert ended_lines({0: (7, 1), 1: (8, -signal.SIGKILL)})[0] == 128 + signal.SIGKILL
    assert ended_lines({0: (7, -200)})[1] == [
        "error: process 0 (pid 7) was killed by signal number 200"
    ]


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")
def test_a_worker_killed_by_sigkill_is_named(tmp_path: Path) -> None:
    site = path_plugin(tmp_path / "site", "ppokit-dies", "ppokit_dies", DIES, "dies")
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    run = tmp_path / "run"
    sets = [
        "rollout.prompts_per_round=4",
        "rollout.n=2",
        "rollout.max_new_tokens=4",
        "train.minibatch_size=null",
        "train.rounds=4",
        "output.save_every=1",
        "output.progress=false",
        "reward=dies_in_round_2",
        "train.reward_timeout=null",  # in the trainer's process: the reward kills that one
        "model.tiny.hidden_size=32",
        "model.tiny.intermediate_size=64",
    ]
    args = ["train", "--nproc", "2", "--out", str(run)]
    args += [a for item in sets for a in ("--set", item)]
    began = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "ppokit", *args],
        capture_output=True,
        text=True,
        timeout=400,
        env=env,
        check=False,
    )
    assert time.perf_counter() - began < 300
    assert done.returncode == 128 + signal.SIGKILL, done.stderr[-3000:]
    err = done.stderr
    assert "process 1 (pid " in err and ") was killed by signal SIGKILL" in err, err[-3000:]
    assert f"the last checkpoint is round 1 ({run / 'checkpoint'})" in err
    resume = next(line for line in err.splitlines() if line.startswith("continue with: "))
    assert "--nproc 2" in resume and resume.endswith(f"--out {run} --resume")
    assert "reward=dies_in_round_2" in resume
    assert "Traceback" not in err
