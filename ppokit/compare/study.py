"""Studies: a paper's finding rerun as a committed comparison with its verdict rule stated
before it runs (docs/findings.md).

A study file names the claim and its paper, the task, the seeds (at least 5), the arms
(each a variant with its own settings), the metric that tests the claim and the rule:
``holds_when: {arm: A, is: higher, than: B}``. ``ppokit compare STUDY.yaml --out DIR`` writes
each arm's spec (``DIR/arms/ARM.yaml``, composed: every value written out), runs the arms
over the seeds as any sweep (summary.md, summary.json, compare.png), then ``study.md`` and
``study.json``: each arm's metric (the mean over a run's last rounds, as the final reward)
with its 95 % interval over seeds, the paired difference A − B over the seeds both arms
finished, and the verdict:

- **reproduced**: the 95 % interval of the paired difference lies on the claim's side of 0;
- **not reproduced**: it lies on the other side (the study's ``why_not`` gives the likely
  reason at this scale);
- **inconclusive**: it contains 0.

Torch-free.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ppokit.compare.runs import FINAL_WINDOW, parse_seeds
from ppokit.compare.summary import RunRecord, final_value, interval
from ppokit.errors import UserError
from ppokit.metrics_table import known
from ppokit.registry import get_registry
from ppokit.runfolder import write_atomic
from ppokit.spec import SpecError, compose, validate_spec
from ppokit.spec.files import read_spec_file

__all__ = ["MIN_SEEDS", "Study", "is_study", "read_study", "run_study", "verdict", "write_arms"]

#: The fewest seeds a study runs: an interval over fewer says little.
MIN_SEEDS = 5
STUDY_MD, STUDY_JSON, STUDY_PNG = "study.md", "study.json", "study.png"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Arm(_Strict):
    """One arm: a variant (and a task, else the study's) with its own settings."""

    variant: str | None = Field(None, description="the variant the arm runs")
    task: str | None = Field(None, description="its task (default: the study's)")
    set: list[str] = Field(default_factory=list, description="path=value settings of the arm")


class Rule(_Strict):
    """The claim holds when ``arm``'s metric is ``is`` (higher or lower) than ``than``'s."""

    arm: str
    is_: Literal["higher", "lower"] = Field(alias="is")
    than: str


class Study(_Strict):
    """A study file: the claim, its paper, the arms, the seeds, the metric and the rule."""

    study: str = Field(min_length=1, description="the study's name")
    claim: str = Field(min_length=1, description="the claim, in one sentence")
    paper: str = Field(min_length=1, description="the paper it comes from")
    task: str | None = Field(None, description="the task of every arm that names none")
    seeds: str = Field("0-4", description=f"seeds: at least {MIN_SEEDS}")
    set: list[str] = Field(default_factory=list, description="settings of every arm")
    arms: dict[str, Arm] = Field(min_length=2, description="the arms, by name")
    metric: str = Field(description="the metrics.jsonl key that tests the claim")
    holds_when: Rule
    why_not: str = Field("", description="the likely reason, where it does not reproduce")

    @model_validator(mode="after")
    def _consistent(self) -> Study:
        if len(parse_seeds(self.seeds)) < MIN_SEEDS:
            raise ValueError(f"seeds: a study runs at least {MIN_SEEDS} seeds, got {self.seeds!r}")
        for name in (self.holds_when.arm, self.holds_when.than):
            if name not in self.arms:
                raise ValueError(f"holds_when: no arm {name!r} (arms: {', '.join(self.arms)})")
        if self.holds_when.arm == self.holds_when.than:
            raise ValueError("holds_when: compares an arm with itself")
        get_registry()  # the components' metrics are declared as they register
        if not known(self.metric):
            raise ValueError(
                f"metric: {self.metric!r} is not a metric a run logs (docs/design.md: Metrics)"
            )
        return self


def is_study(path: Path) -> bool:
    """Whether ``path`` is a study file (a YAML mapping with a ``study`` key)."""
    if not path.is_file():
        return False
    try:
        data = read_spec_file(path)
    except SpecError:
        return False
    return "study" in data


def read_study(path: Path) -> Study:
    """The validated study of ``path``; UserError with one line per problem."""
    data = read_spec_file(path)
    try:
        return Study.model_validate(data)
    except ValidationError as exc:
        lines = [
            f"{'.'.join(map(str, e['loc'])) or 'study'}: {e['msg'].removeprefix('Value error, ')}"
            for e in exc.errors()
        ]
        raise UserError(f"{path}: " + "; ".join(lines)) from None


def write_arms(study: Study, out: Path) -> list[Path]:
    """Each arm's spec, composed (variant, task, the study's and the arm's settings), written
    to ``out/arms/ARM.yaml``; SpecError naming the arm for one that does not validate."""
    paths = []
    for name, arm in study.arms.items():
        data: dict[str, Any] = {}
        if arm.variant is not None:
            data["variant"] = arm.variant
        task = arm.task or study.task
        if task is not None:
            data["task"] = task
        try:
            composed = compose(data, [*study.set, *arm.set]).data
            validate_spec(composed)
        except SpecError as exc:
            raise SpecError([f"arm {name}: {line}" for line in exc.errors]) from None
        path = out / "arms" / f"{name}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, yaml.safe_dump(composed, sort_keys=False))
        paths.append(path)
    return paths


def verdict(study: Study, records: Sequence[RunRecord]) -> dict[str, Any]:
    """Each arm's metric over its finished seeds, the paired difference the rule reads and
    the verdict (module docstring)."""
    per_arm: dict[str, dict[int, float]] = {name: {} for name in study.arms}
    for r in records:
        value = final_value(r.history, study.metric) if r.status == "finished" else None
        if r.group in per_arm and value is not None and r.seed is not None:
            per_arm[r.group][r.seed] = value
    rule = study.holds_when
    sign = 1.0 if rule.is_ == "higher" else -1.0
    paired = sorted(set(per_arm[rule.arm]) & set(per_arm[rule.than]))
    diffs = [per_arm[rule.arm][s] - per_arm[rule.than][s] for s in paired]
    diff = interval(diffs)
    if len(diffs) < 2 or diff["ci95"] is None:
        outcome = "inconclusive"
    elif sign * diff["mean"] - diff["ci95"] > 0:
        outcome = "reproduced"
    elif sign * diff["mean"] + diff["ci95"] < 0:
        outcome = "not reproduced"
    else:
        outcome = "inconclusive"
    return {
        "study": study.study,
        "claim": study.claim,
        "paper": study.paper,
        "metric": study.metric,
        "rule": f"{rule.arm} is {rule.is_} than {rule.than}",
        "arms": {name: interval(list(v.values())) for name, v in per_arm.items()},
        "difference": {**diff, "seeds": paired, "of": f"{rule.arm} - {rule.than}"},
        "verdict": outcome,
        "why_not": study.why_not if outcome != "reproduced" else "",
    }


def _fmt(stat: Mapping[str, Any]) -> str:
    if stat["mean"] is None:
        return "-"
    half = stat["ci95"]
    return (
        f"{stat['mean']:.4g} ± {half:.2g} (n={stat['n']})"
        if half is not None
        else (f"{stat['mean']:.4g} (n={stat['n']})")
    )


def render(result: Mapping[str, Any]) -> str:
    """study.md: the claim, the arms' metric, the paired difference and the verdict."""
    lines = [
        f"# {result['study']}",
        "",
        f"**Claim.** {result['claim']} ({result['paper']})",
        "",
        f"**Rule, stated before running.** The claim holds when {result['rule']}, in "
        f"`{result['metric']}` (each run's mean over its last {FINAL_WINDOW} rounds): when the "
        "95 % interval of the paired difference over seeds lies on that side of 0.",
        "",
        f"| arm | {result['metric']} (mean ± 95 % CI over seeds) |",
        "|---|---|",
        *(f"| {name} | {_fmt(stat)} |" for name, stat in result["arms"].items()),
        f"| {result['difference']['of']} (paired) | {_fmt(result['difference'])} |",
        "",
        f"**Verdict: {result['verdict']}.**"
        + (f" {result['why_not']}" if result["why_not"] else ""),
    ]
    return "\n".join(lines) + "\n"


def write_study(out: Path, study: Study, records: Sequence[RunRecord]) -> dict[str, Any]:
    """study.json, study.md and study.png (the metric per arm) in ``out``; the result."""
    import json

    from ppokit.compare.render import plot
    from ppokit.compare.summary import summarize

    result = verdict(study, records)
    write_atomic(out / STUDY_JSON, json.dumps(result, indent=2) + "\n")
    write_atomic(out / STUDY_MD, render(result))
    summary = summarize(records, order=list(study.arms))
    plot(records, summary, out / STUDY_PNG, title=study.study, keys=[study.metric])
    return result


def run_study(
    path: Path, out: Path, sweep: Callable[..., tuple[dict[str, Any], list[Any], bool]]
) -> tuple[dict[str, Any], dict[str, Any], list[Any], bool]:
    """Run the study of ``path`` into ``out``: its arms' specs, then ``sweep(arm_paths,
    seeds, out)`` (the sweep of ``ppokit compare``, with its options), then its verdict.
    Returns (the sweep's summary, the study's result, the runs, whether it completed)."""
    study = read_study(path)
    arms = write_arms(study, out)
    summary, runs, completed = sweep(arms, parse_seeds(study.seeds), out)
    records = [RunRecord.of(r, spec=False) for r in runs]
    return summary, write_study(out, study, records), runs, completed
