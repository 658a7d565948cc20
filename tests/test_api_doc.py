"""The Python examples of docs/api.md run as printed (a run's folder moved to a temporary
directory, fewer rounds)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "api.md").read_text(), re.S)


def test_the_api_page_has_its_three_examples() -> None:
    assert len(BLOCKS) == 3
    assert "ppokit.train(spec)" in BLOCKS[0]
    assert "run_round(" in BLOCKS[1]
    assert "registry.create(" in BLOCKS[2]


@pytest.mark.parametrize("index", range(3))
def test_an_api_example_runs(index: int, tmp_path, monkeypatch, capsys) -> None:
    code = BLOCKS[index]
    code = code.replace("output.dir=runs/api", f"output.dir={tmp_path / 'api'}")
    code = code.replace("train.rounds=20", "train.rounds=2")
    code = code.replace('"train.rounds=5"', '"train.rounds=5", "output.progress=false"')
    monkeypatch.chdir(ROOT)
    scope: dict[str, object] = {"__name__": "__api_example__"}
    exec(compile(code, f"docs/api.md block {index}", "exec"), scope)
    out = capsys.readouterr().out
    if index == 0:
        assert scope["summary"]["rounds"] == 2  # type: ignore[index]
    if index < 2:
        assert out.strip(), "the example prints its result"
    else:  # the component example's objective reached the policy's log-probs
        assert scope["logp"].grad is not None  # type: ignore[attr-defined]
        assert scope["logp"].grad.abs().sum() > 0  # type: ignore[attr-defined]
