"""A run stopped between its checkpoints keeps its last finished round (ppokit.trainer.stopping):
a Ctrl-C while a round generates or scores saves the round before and drops the one in
progress; one during the update is held to the round's end, which is saved; a reward that
fails ends with the summary, the checkpoint and the command that resumes; each resumes to
the metrics of a run never stopped. A SIGTERM from outside (a scheduler's stop) is a Ctrl-C."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

import ppokit.trainer.loop as loop_module
from ppokit.children import child_env
from ppokit.cli import app
from ppokit.trainer.checkpoint import checkpoint_round
from ppokit.trainer.metrics import TIMING, read_metrics
from ppokit.trainer.optim import Optimizers
from tests.helpers import ROOT
from tests.helpers.trainer import DEMO, SMALL

ROUNDS = 5


def _args(out: Path, *extra: str) -> list[str]:
    sets = [a for item in SMALL for a in ("--set", item)]
    more = ["--set", f"train.rounds={ROUNDS}", "--set", "output.save_every=5"]
    return ["train", str(DEMO), *sets, *more, "--threads", "1", "--out", str(out), *extra]


def _untimed(history: list[dict]) -> list[dict]:
    return [{k: v for k, v in h.items() if k not in TIMING} for h in history]


@pytest.fixture(scope="module")
def whole(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """The metrics of the run never stopped."""
    out = tmp_path_factory.mktemp("whole") / "run"
    result = CliRunner().invoke(app, _args(out))
    assert result.exit_code == 0, result.stderr
    return _untimed(read_metrics(out))


def _resume(out: Path, command: str) -> list[dict]:
    argv = shlex.split(command.removeprefix("continue with: "))
    assert argv[:2] == ["ppokit", "train"] and argv[-1] == "--resume"
    resumed = CliRunner().invoke(app, argv[1:])
    assert resumed.exit_code == 0, resumed.stderr
    return _untimed(read_metrics(out))


def test_ctrl_c_while_round_4_generates_saves_round_3(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ctrl_c: None, whole: list[dict]
) -> None:
    out = tmp_path / "run"
    real = loop_module.run_round

    def run_round(setup, state, produced, *, round_no, **kw):  # type: ignore[no-untyped-def]
        if round_no == 4:  # generated and scored: the source and the RNG have moved on
            os.kill(os.getpid(), signal.SIGINT)
        return real(setup, state, produced, round_no=round_no, **kw)

    monkeypatch.setattr(loop_module, "run_round", run_round)
    result = CliRunner().invoke(app, _args(out))
    assert result.exit_code == 130, result.output
    assert "Traceback" not in result.output + result.stderr
    lines = result.stderr.strip().splitlines()
    assert "saved the checkpoint of round 3" in result.stderr
    assert "interrupted during round 4/5; the last checkpoint is round 3" in lines[-2]
    assert checkpoint_round(out) == 3
    monkeypatch.undo()
    assert _resume(out, lines[-1]) == whole


def test_ctrl_c_during_round_4s_update_ends_and_saves_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ctrl_c: None, whole: list[dict]
) -> None:
    out = tmp_path / "run"
    real_round, real_step = loop_module.run_round, Optimizers.step
    now = [0]

    def run_round(setup, state, produced, *, round_no, **kw):  # type: ignore[no-untyped-def]
        now[0] = round_no
        return real_round(setup, state, produced, round_no=round_no, **kw)

    def step(self, models):  # type: ignore[no-untyped-def]
        real_step(self, models)
        if now[0] == 4:  # the weights have moved: the round cannot be dropped
            now[0] = 0  # once
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(loop_module, "run_round", run_round)
    monkeypatch.setattr(Optimizers, "step", step)
    result = CliRunner().invoke(app, _args(out))
    assert result.exit_code == 130, result.output
    assert "stopping after round 4, whose update has begun" in result.stderr
    assert checkpoint_round(out) == 4
    assert [h["round"] for h in read_metrics(out)] == [1, 2, 3, 4]
    monkeypatch.undo()
    assert _resume(out, result.stderr.strip().splitlines()[-1]) == whole


def test_a_reward_that_fails_in_round_3_keeps_round_2(tmp_path: Path) -> None:
    out = tmp_path / "run"
    calls = tmp_path / "calls"
    code = tmp_path / "flaky.py"
    code.write_text(
        "from pathlib import Path\n"
        "from ppokit.components.reward.impl import PythonReward\n"
        "def reward(prompts, responses, **fields):\n"
        f"    calls = Path({str(calls)!r})\n"
        "    n = len(calls.read_text()) if calls.exists() else 0\n"
        "    calls.write_text('x' * (n + 1))\n"
        "    if n == 2:\n"
        "        raise ConnectionError('the reward server went away')\n"
        "    return [float(r[:1] == p[-1:]) for p, r in zip(prompts, responses)]\n"
    )
    reward = ["--set", f"reward={{name: python, function: '{code}:reward'}}"]
    result = CliRunner().invoke(app, _args(out, *reward))
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert "the reward server went away" in lines[-2]  # with what the run keeps, one line
    assert lines[-2].endswith(f"; the last checkpoint is round 2 ({out / 'checkpoint'})")
    assert "reward_mean" in result.stderr  # the summary of the rounds done
    assert checkpoint_round(out) == 2
    calls.write_text("xxxxxxxxxx")  # the server is back
    assert [h["round"] for h in _resume(out, lines[-1])] == [1, 2, 3, 4, 5]


def test_sigterm_while_round_2_scores_saves_round_1(tmp_path: Path) -> None:
    """A scheduler's stop (SIGTERM from outside, to a ``ppokit train`` process) is a Ctrl-C:
    the checkpoint of the last finished round is saved and the last line names the command
    that resumes it."""
    out, started = tmp_path / "run", tmp_path / "round-2-scores"
    code = tmp_path / "waits.py"
    code.write_text(
        "import time\n"
        "from pathlib import Path\n"
        "calls = []\n"
        "def reward(prompts, responses, **fields):\n"
        "    calls.append(1)\n"
        "    if len(calls) == 2:\n"
        f"        Path({str(started)!r}).touch()\n"
        "        time.sleep(120)\n"
        "    return [0.0 for _ in responses]\n"
    )
    reward = ["--set", f"reward={{name: python, function: '{code}:reward'}}"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "ppokit", *_args(out, *reward)],
        cwd=ROOT,
        env=child_env(os.environ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 240
        while not started.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert started.exists(), proc.communicate(timeout=60)[1] if proc.poll() is not None else ""
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert "saved the checkpoint of round 1" in err
    assert "interrupted during round 2/5; the last checkpoint is round 1" in lines[-2]
    assert lines[-1].startswith("continue with: ppokit train") and lines[-1].endswith("--resume")
    assert checkpoint_round(out) == 1
