"""The Python examples of docs/api.md run as printed (a run's folder moved to a temporary
directory, fewer rounds)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from ppokit.trainer.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]
BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "api.md").read_text(), re.S)


@pytest.mark.slow
def test_the_first_example_learns_as_printed(tmp_path, monkeypatch, capsys) -> None:
    """The first example is the whole demo at seed 0 (the suite's one run of it): it learns
    as printed, and as benchmarks/demo.py holds every seed to (its table over ten seeds is in
    docs/results.md)."""
    from benchmarks.demo import EACH_AT_LEAST, LAST, MEAN_AT_LEAST

    code = BLOCKS[0].replace("output.dir=runs/api", f"output.dir={tmp_path / 'api'}")
    monkeypatch.chdir(ROOT)
    scope: dict[str, object] = {"__name__": "__api_example__"}
    exec(compile(code, "docs/api.md block 0", "exec"), scope)
    summary = scope["summary"]
    assert summary["rounds"] == 100 and summary["reward_first"] < 0.1  # type: ignore[index]
    assert summary["reward_last"] > 0.99, summary  # type: ignore[index]
    rewards = [h["reward_mean"] for h in read_metrics(tmp_path / "api")]
    assert rewards[0] <= 0.25  # the most a policy that ignores the prompt scores
    assert sum(rewards[-LAST:]) / LAST >= MEAN_AT_LEAST and min(rewards[-LAST:]) >= EACH_AT_LEAST


def test_the_api_page_has_its_three_examples() -> None:
    assert len(BLOCKS) == 3
    assert "ppokit.train(spec)" in BLOCKS[0]
    assert "run_round(" in BLOCKS[1]
    assert "registry.create(" in BLOCKS[2]


@pytest.mark.parametrize("index", range(3))
def test_an_api_example_runs(index: int, tmp_path, monkeypatch, capsys) -> None:
    code = BLOCKS[index]
    code = code.replace("output.dir=runs/api", f"output.dir={tmp_path / 'api'}")
    code = code.replace('"output.dir=', '"train.rounds=2", "output.dir=')
    code = code.replace('"train.rounds=5"', '"train.rounds=5", "output.progress=false"')
    monkeypatch.chdir(ROOT)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # torch's default on a 2-core machine
    scope: dict[str, object] = {"__name__": "__api_example__"}
    try:
        exec(compile(code, f"docs/api.md block {index}", "exec"), scope)
        after = torch.get_num_threads()
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    if index == 1:  # the step-by-step loop runs on ppokit train's threads: one, the demo small
        assert after == 1 and out.startswith("1 CPU thread (automatic: "), out
    if index == 0:
        assert scope["summary"]["rounds"] == 2  # type: ignore[index]
        assert scope["summary"]["threads"] == 1  # type: ignore[index]
    if index < 2:
        assert out.strip(), "the example prints its result"
    else:  # the component example's objective reached the policy's log-probs
        assert scope["logp"].grad is not None  # type: ignore[attr-defined]
        assert scope["logp"].grad.abs().sum() > 0  # type: ignore[attr-defined]
