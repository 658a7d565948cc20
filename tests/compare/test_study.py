"""Studies: the file, the arms' specs, the verdict rule, and the committed findings."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from ppokit.compare.study import Study, is_study, read_study, render, verdict, write_arms
from ppokit.compare.summary import RunRecord
from ppokit.errors import UserError
from ppokit.spec import load_spec
from tests.helpers import ROOT

BASE: dict[str, Any] = {
    "study": "s",
    "claim": "A beats B.",
    "paper": "Someone (2025), arXiv:2501.00001",
    "task": "demo",
    "seeds": "0-4",
    "arms": {
        "a": {"variant": "dapo"},
        "b": {"variant": "dapo", "set": ["policy.loss.clip_high=0.2"]},
    },
    "metric": "entropy",
    "holds_when": {"arm": "a", "is": "higher", "than": "b"},
}


def _records(values: dict[str, list[float]]) -> list[RunRecord]:
    return [
        RunRecord(
            arm,
            seed,
            Path(f"runs/{arm}/seed-{seed}"),
            "finished",
            6,
            history=[{"round": r, "entropy": v} for r in range(1, 7)],
        )
        for arm, per_seed in values.items()
        for seed, v in enumerate(per_seed)
    ]


def test_a_study_file_is_read_and_its_arms_are_composed_specs(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(BASE))
    assert is_study(path) and not is_study(ROOT / "examples" / "specs" / "dapo.yaml")
    study = read_study(path)
    a, b = write_arms(study, tmp_path / "out")
    assert [p.name for p in (a, b)] == ["a.yaml", "b.yaml"]
    spec_a, spec_b = load_spec(a), load_spec(b)
    assert (spec_a.variant, spec_a.task) == ("dapo", "demo")
    assert spec_a.policy.loss.params["clip_high"] == 0.28
    assert spec_b.policy.loss.params == {**spec_a.policy.loss.params, "clip_high": 0.2}


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"seeds": "0-3"}, "at least 5 seeds"),
        ({"holds_when": {"arm": "a", "is": "higher", "than": "c"}}, "no arm 'c'"),
        ({"metric": "entropyy"}, "metric"),
        ({"arms": {"a": {"variant": "dapo"}}}, "arms"),
        ({"claim": ""}, "claim"),
    ],
)
def test_a_bad_study_is_one_line(tmp_path: Path, change: dict[str, Any], problem: str) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({**BASE, **change}))
    with pytest.raises(UserError) as err:
        read_study(path)
    assert problem in str(err.value) and "\n" not in str(err.value)


def test_the_verdict_by_hand() -> None:
    study = Study.model_validate(BASE)
    higher = verdict(
        study, _records({"a": [1.0, 1.1, 1.2, 1.3, 1.4], "b": [0.5, 0.6, 0.7, 0.8, 0.9]})
    )
    assert higher["verdict"] == "reproduced"
    assert higher["difference"]["mean"] == pytest.approx(0.5)
    assert higher["difference"]["ci95"] == pytest.approx(0.0, abs=1e-9)
    lower = verdict(
        study, _records({"a": [0.5, 0.6, 0.7, 0.8, 0.9], "b": [1.0, 1.1, 1.2, 1.3, 1.5]})
    )
    assert lower["verdict"] == "not reproduced"
    mixed = verdict(study, _records({"a": [1.0, 0.0, 1.0, 0.0, 1.0], "b": [0.5] * 5}))
    assert mixed["verdict"] == "inconclusive"
    assert "**Verdict: reproduced.**" in render(higher)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.floats(-10, 10, allow_nan=False), min_size=5, max_size=5),
    st.lists(st.floats(-10, 10, allow_nan=False), min_size=5, max_size=5),
)
def test_swapping_the_arms_and_the_direction_gives_the_same_verdict(
    a: list[float], b: list[float]
) -> None:
    """'a higher than b' and 'b lower than a' are one claim: one verdict."""
    records = _records({"a": a, "b": b})
    one = verdict(Study.model_validate(BASE), records)
    other = Study.model_validate({**BASE, "holds_when": {"arm": "b", "is": "lower", "than": "a"}})
    assert verdict(other, records)["verdict"] == one["verdict"]


def test_the_findings_page_shows_each_committed_study_as_it_was_written() -> None:
    """docs/findings.md holds each committed study's table and verdict as ``ppokit compare``
    rendered them from its study.json, and each study file is there with its command."""
    page = (ROOT / "docs" / "findings.md").read_text()
    results = sorted((ROOT / "studies" / "results").glob("*/study.json"))
    assert results
    for path in results:
        result = json.loads(path.read_text())
        name = path.parent.name
        assert (ROOT / "studies" / f"{name}.yaml").is_file()
        assert read_study(ROOT / "studies" / f"{name}.yaml").study == name == result["study"]
        assert f"## {name}\n" in page
        assert f"ppokit compare studies/{name}.yaml" in page
        table = render(result).split("\n", 2)[2]  # without its title
        assert table in page
        assert (ROOT / "docs" / "findings" / f"{name}.png").is_file()
