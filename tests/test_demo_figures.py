"""The figures stated about the packaged demo are the ones ``benchmarks/demo.py`` recorded
(benchmarks/demo.json): docs/results.md's table, the range the spec's comment and the README
give, and the criterion the recorded run meets."""

from __future__ import annotations

import json
import re
from pathlib import Path

from benchmarks.demo import LAST, holds

ROOT = Path(__file__).resolve().parents[1]
ROWS = json.loads((ROOT / "benchmarks" / "demo.json").read_text())
#: How the spec's comment and the README state the range over seeds.
RANGE = re.compile(r"average (\d\.\d{3})-(\d\.\d{3}) over seeds (\d+)-(\d+)")


def _stated_range(text: str) -> tuple[str, str, int, int]:
    found = RANGE.findall(" ".join(text.split()))
    assert len(found) == 1, found
    lo, hi, first, last = found[0]
    return lo, hi, int(first), int(last)


def _recorded_range() -> tuple[str, str, int, int]:
    means = [r["last10_mean"] for r in ROWS]
    seeds = [r["seed"] for r in ROWS]
    return f"{min(means):.3f}", f"{max(means):.3f}", min(seeds), max(seeds)


def test_the_packaged_demo_still_starts_where_the_recorded_run_did(tmp_path: Path) -> None:
    """The recorded runs meet the criterion, and the packaged demo, run now, samples its
    first round exactly as the recorded seed-0 run did (its reward to the recorded digits):
    the demo spec, its variant and task, the model's init and the sampling are unchanged."""
    from ppokit.spec import load_spec
    from ppokit.trainer import train
    from ppokit.trainer.metrics import read_metrics

    assert [r["seed"] for r in ROWS] == list(range(10))
    assert all(r["rounds"] >= LAST for r in ROWS) and holds(ROWS)
    spec = load_spec(
        ROOT / "ppokit" / "specs" / "demo.yaml",
        ["train.rounds=1", f"output.dir={tmp_path / 'run'}", "output.progress=false"],
    )
    train(spec)
    (first,) = read_metrics(tmp_path / "run")
    assert round(first["reward_mean"], 3) == ROWS[0]["reward_first"]


def test_results_md_shows_the_recorded_table() -> None:
    text = (ROOT / "docs" / "results.md").read_text()
    section = text.split("## The embedded demo", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(
        r"^\| (\d+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|$", section, re.M
    )
    assert [(int(s), float(w), float(f), float(m), float(lo)) for s, w, f, m, lo in rows] == [
        (r["seed"], r["wall_s"], r["reward_first"], r["last10_mean"], r["last10_min"]) for r in ROWS
    ]


def test_the_spec_and_the_readme_state_the_recorded_range() -> None:
    spec = (ROOT / "ppokit" / "specs" / "demo.yaml").read_text()
    comment = " ".join(line.lstrip("# ") for line in spec.splitlines() if line.startswith("#"))
    assert _stated_range(comment) == _recorded_range()
    assert _stated_range((ROOT / "README.md").read_text()) == _recorded_range()
