"""A run killed with SIGKILL mid-way resumes from its last checkpoint and ends with the same
metrics as a run that was never interrupted. The run has asynchronous rollouts, whose
checkpoint holds more than a synchronous one's: the batch generated ahead of the
checkpoint's round (in flight when the run was killed), trained on after the resume. A
synchronous run killed at the worst point of its save resumes exactly too
(tests/trainer/checkpoint/test_safety.py, in one process)."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ppokit.cli import app
from ppokit.trainer.metrics import read_metrics
from tests.helpers.ranks import killed_mid_run
from tests.helpers.trainer import DEMO, SMALL, untimed

ROUNDS = 6
ARGS = [
    *SMALL,
    f"train.rounds={ROUNDS}",
    "output.save_every=2",
    "rollout.n=4",
    "rollout.max_staleness=1",
]


def _args(out: Path, *extra: str) -> list[str]:
    """``ppokit``'s arguments for the run into ``out``."""
    sets = [a for item in ARGS for a in ("--set", item)]
    return ["train", str(DEMO), *sets, "--out", str(out), *extra]


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")
def test_sigkill_mid_run_then_resume(tmp_path: Path) -> None:
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    uninterrupted = CliRunner().invoke(app, _args(whole))  # in this process: no start-up
    assert uninterrupted.exit_code == 0, uninterrupted.output

    # killed once the round after the first checkpoint is being written (rounds 3..5)
    done = killed_mid_run(_args(killed), killed, 3)
    assert 3 <= done < ROUNDS

    ahead = killed / "checkpoint" / "ahead"
    assert ahead.is_dir()  # the batch of the round after the checkpoint's
    result = CliRunner().invoke(app, _args(killed, "--resume", "--json"))
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["resumed_from"] in (2, 4)
    assert summary["resumed_from"] <= done
    history = read_metrics(killed)
    assert [h["round"] for h in history] == list(range(1, ROUNDS + 1))
    assert untimed(history) == untimed(read_metrics(whole))
    assert [h["rollout/staleness_max"] for h in history] == [0.0] + [1.0] * (ROUNDS - 1)
