"""The statistics of a sweep: the components each spec differs in, its label, and per spec
the mean and 95% Student-t interval of each run's final numbers. Torch-free."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ppokit.compare.runs import (
    FINAL_WINDOW,
    SECTION_NAME_SLOT,
    SweepRun,
    read_history,
    read_run_spec,
)
from ppokit.metrics_table import ACCURACY, EVAL_PREFIX, REWARD, ROUND, ROUND_TIME, THROUGHPUT
from ppokit.slots import SLOTS
from ppokit.stats import mean_ci95
from ppokit.trainer.health import PREFIX as HEALTH


# ---------------------------------------------------------------------- components, labels
def _name_of(value: Any, default: str) -> str:
    if value is None:
        return default
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        return str(value.get("name", default))
    if isinstance(value, list):
        return "+".join(_name_of(v, default) for v in value) or default
    return str(value)


def component_names(data: Mapping[str, Any]) -> dict[str, str | None]:
    """The component of every slot of a (resolved) spec mapping, by slot path.

    Paths come from :data:`ppokit.slots.SLOTS` (``advantage``, ``critic.loss``, ...), plus one
    key per optional section (``critic``, ``kl``): ``None`` when the section is absent (its
    slots are then ``None`` too), else the section's naming slot (``critic.loss``,
    ``kl.estimator``). Several rewards are joined with ``+``. A slot the mapping leaves out
    holds its default.
    """
    names: dict[str, str | None] = {}
    for s in SLOTS:
        if s.section is None:
            names[s.path] = _name_of(data.get(s.path), s.default)
            continue
        section = data.get(s.section, {} if s.section not in SECTION_NAME_SLOT else None)
        names[s.path] = (
            _name_of(section.get(s.key), s.default) if isinstance(section, dict) else None
        )
    for sec, slot_path in SECTION_NAME_SLOT.items():
        names[sec] = names.get(slot_path)
    return names


def differing_components(
    components: Mapping[str, Mapping[str, str | None]],
) -> dict[str, list[tuple[str, str]]]:
    """Per group, the ``(slot, component)`` pairs in which the groups differ.

    A section present in some groups only (``critic``, ``kl``) shows as ``critic=none`` where
    absent and ``critic=<its loss>`` (``kl=<its estimator>``) where present; the slots inside
    it are compared among the groups that have it. Other slots show where any two groups
    hold different components.
    """
    groups = list(components)
    items: dict[str, list[tuple[str, str]]] = {g: [] for g in groups}
    if len(groups) < 2:
        return items
    shown: set[str] = set()
    for s in SLOTS:
        sec = s.section if s.section in SECTION_NAME_SLOT else None
        if sec is not None:
            present = [g for g in groups if components[g].get(sec) is not None]
            if 0 < len(present) < len(groups):
                if sec not in shown:
                    shown.add(sec)
                    for g in groups:
                        items[g].append((sec, components[g].get(sec) or "none"))
                if s.path == SECTION_NAME_SLOT[sec]:
                    continue
                if len({components[g].get(s.path) for g in present}) > 1:
                    for g in present:
                        items[g].append((s.path, str(components[g].get(s.path))))
                continue
        if len({components[g].get(s.path) for g in groups}) > 1:
            for g in groups:
                items[g].append((s.path, components[g].get(s.path) or "none"))
    return items


def spec_labels(components: Mapping[str, Mapping[str, str | None]]) -> dict[str, str]:
    """``"grpo (advantage=grpo, critic=none)"``: each group's name and what sets it apart.

    With three or more groups, a slot whose component is the one most groups share (a
    single most common value) is left out of the groups that hold it, so that each label
    names what is particular to its spec.
    """
    diff = differing_components(components)
    counts: dict[str, Counter[str]] = {}
    for items in diff.values():
        for key, value in items:
            counts.setdefault(key, Counter())[value] += 1

    def common(key: str, value: str) -> bool:
        ranked = counts[key].most_common(2)
        top, n = ranked[0]
        unique = len(ranked) == 1 or ranked[1][1] < n
        return len(diff) > 2 and n > 1 and unique and value == top

    labels = {}
    for g, items in diff.items():
        own = [(k, v) for k, v in items if not common(k, v)]
        labels[g] = g + (f" ({', '.join(f'{k}={v}' for k, v in own)})" if own else "")
    return labels


# ---------------------------------------------------------------------- summary
@dataclass
class RunRecord:
    """A run as the summary sees it."""

    group: str
    seed: int | None
    dir: Path
    #: finished, failed, interrupted or incomplete
    status: str
    rounds: int | None
    error: str | None = None
    history: list[dict[str, Any]] = field(default_factory=list)
    spec: dict[str, Any] | None = None

    @classmethod
    def of(cls, run: SweepRun, spec: bool = True) -> RunRecord:
        """A sweep's run read back from its folder: a finished run's metrics (and, with
        ``spec``, its spec.yaml)."""
        done = run.status == "finished"
        return cls(
            run.name,
            run.seed,
            run.dir,
            run.status,
            run.rounds,
            run.error,
            read_history(run.dir) if done else [],
            read_run_spec(run.dir) if done and spec else None,
        )


def final_value(history: Sequence[Mapping[str, Any]], key: str) -> float | None:
    """Mean of ``key`` over the last FINAL_WINDOW rounds; a metric logged in none of them
    (an evaluation every k > FINAL_WINDOW rounds) takes its last logged value."""
    if not history:
        return None
    last = history[-1][ROUND]
    window = [h[key] for h in history if h[ROUND] > last - FINAL_WINDOW and is_number(h.get(key))]
    if window:
        return math.fsum(window) / len(window)
    logged = [h[key] for h in history if is_number(h.get(key))]
    return logged[-1] if logged else None


def is_number(value: Any) -> bool:
    """Whether ``value`` is a finite real number (a bool is not)."""
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(float(value))
    )


def _eval_keys(records: Sequence[RunRecord]) -> list[str]:
    keys = {
        k
        for r in records
        for h in r.history
        for k, v in h.items()
        if k.startswith(EVAL_PREFIX) and is_number(v)
    }
    return sorted(keys, key=lambda k: (k != ACCURACY, k))


def interval(values: Sequence[float]) -> dict[str, Any]:
    """``{mean, ci95, n, values}``: the mean and the half-width of its 95% interval (None
    with one value or none)."""
    if not values:
        return {"mean": None, "ci95": None, "n": 0, "values": []}
    mean, half = mean_ci95(values)
    return {
        "mean": mean,
        "ci95": half if math.isfinite(half) else None,
        "n": len(values),
        "values": list(values),
    }


def run_metrics(history: Sequence[Mapping[str, Any]], threshold: float) -> dict[str, Any]:
    """One run's numbers: final reward and eval metrics, rounds to the threshold, wall time
    (Σ time_round), mean tokens/s."""
    hist = sorted(history, key=lambda h: h[ROUND])
    reached = next(
        (h[ROUND] for h in hist if is_number(h.get(REWARD)) and h[REWARD] >= threshold),
        None,
    )
    tps = [h[THROUGHPUT] for h in hist if is_number(h.get(THROUGHPUT))]
    evals = sorted(
        {k for h in hist for k, v in h.items() if k.startswith(EVAL_PREFIX) and is_number(v)}
    )
    return {
        "signs": fired(hist),
        "rounds": hist[-1][ROUND] if hist else 0,
        "final_reward": final_value(hist, REWARD),
        "eval": {k: final_value(hist, k) for k in evals},
        "rounds_to_threshold": reached,
        "wall_time_s": math.fsum(h[ROUND_TIME] for h in hist if is_number(h.get(ROUND_TIME))),
        THROUGHPUT: math.fsum(tps) / len(tps) if tps else None,
    }


def fired(history: Sequence[Mapping[str, Any]]) -> list[str]:
    """The health signs (docs/health.md) that fired in any round of a run, sorted: the
    ``health/<sign>`` keys its records hold with a true value."""
    return sorted(
        {k[len(HEALTH) :] for h in history for k, v in h.items() if k.startswith(HEALTH) and v}
    )


def signs_text(signs: Mapping[str, int], runs: int) -> str:
    """``constant_reward (2/5), entropy (1/5)``: each sign and in how many runs it fired."""
    return ", ".join(f"{s} ({n}/{runs})" for s, n in signs.items()) or "-"


def trim(history: Sequence[dict[str, Any]], rounds: int | None) -> list[dict[str, Any]]:
    """The records of ``history`` up to round ``rounds`` (None: all)."""
    return [h for h in history if rounds is None or h[ROUND] <= rounds]


def summarize(
    records: Sequence[RunRecord],
    threshold: float = 0.9,
    order: Sequence[str] | None = None,
    specs: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """The content of summary.json: per group (spec) the statistics over its finished runs.

    ``order`` fixes the order of the groups it names (the others follow, first seen first);
    ``specs`` gives a group's
    spec mapping when none of its runs has a spec.yaml.
    """
    present = {r.group for r in records}
    groups: dict[str, list[RunRecord]] = {g: [] for g in order or () if g in present}
    for r in records:
        groups.setdefault(r.group, []).append(r)
    evals = _eval_keys(records)
    components = {}
    for g, runs in groups.items():
        found: Mapping[str, Any] | None = next(
            (r.spec for r in runs if r.status == "finished" and r.spec), None
        )
        found = found or next((r.spec for r in runs if r.spec), None)
        found = found or (specs or {}).get(g)
        if found:  # a group whose spec is unknown (no spec.yaml) is labelled by its name
            components[g] = component_names(found)
    labels = {g: g for g in groups} | spec_labels(components)
    diff: dict[str, list[tuple[str, str]]] = {g: [] for g in groups}
    diff.update(differing_components(components))
    out_groups = []
    for g, runs in groups.items():
        per_run = []
        for r in sorted(runs, key=lambda r: (r.seed is None, r.seed or 0, str(r.dir))):
            m = run_metrics(trim(r.history, r.rounds), threshold) if r.history else None
            per_run.append(
                {
                    "seed": r.seed,
                    "dir": str(r.dir),
                    "status": r.status,
                    "error": r.error,
                    **(m or {"rounds": 0}),
                }
            )
        done = [p for p in per_run if p["status"] == "finished"]
        reached = [p["rounds_to_threshold"] for p in done if p["rounds_to_threshold"] is not None]
        out_groups.append(
            {
                "name": g,
                "label": labels[g],
                "differs": dict(diff[g]),
                "components": components.get(g),
                "runs_total": len(per_run),
                "finished": len(done),
                "failed": sum(p["status"] == "failed" for p in per_run),
                "other": sum(p["status"] not in ("finished", "failed") for p in per_run),
                "final_reward": interval(
                    [p["final_reward"] for p in done if p["final_reward"] is not None]
                ),
                "eval": {
                    k: interval([p["eval"][k] for p in done if p["eval"].get(k) is not None])
                    for k in evals
                },
                "rounds_to_threshold": {
                    "mean": math.fsum(reached) / len(reached) if reached else None,
                    "reached": len(reached),
                    "of": len(done),
                    "values": reached,
                },
                "wall_time_s": interval([p["wall_time_s"] for p in done]),
                # each health sign that fired, and in how many of the finished runs
                "signs": {
                    s: sum(s in p["signs"] for p in done)
                    for s in sorted({s for p in done for s in p["signs"]})
                },
                THROUGHPUT: interval([p[THROUGHPUT] for p in done if p[THROUGHPUT] is not None]),
                "runs": per_run,
            }
        )
    return {
        "threshold": threshold,
        "final_window": FINAL_WINDOW,
        "eval_metrics": evals,
        "specs": out_groups,
    }
