"""The table of metrics: every list of metric names is read from it, every metric has one
direction, and a component's own diagnostics need no edit to the trainer."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from ppokit import metrics_table as table
from ppokit.catalogue import Component
from ppokit.errors import ComponentError
from ppokit.metrics_table import Metric, best_direction, metric
from ppokit.registry import Registry
from ppokit.trainer import train
from ppokit.trainer.estimation import reported
from ppokit.trainer.metrics import read_metrics
from tests.helpers import Plugin, Scaled
from tests.helpers.trainer import small_spec

ROOT = Path(__file__).resolve().parents[1]


def test_each_metric_is_one_row_and_every_line_starts_with_its_round() -> None:
    names = [m.name for m in table.METRICS]
    assert len(names) == len(set(names))
    assert table.REQUIRED[0] == table.ROUND


def test_directions_come_from_the_rows() -> None:
    assert metric("policy_loss").direction == "none"  # a surrogate's value has no best
    assert best_direction("value_loss") == "min"
    assert best_direction("eval/pass@8") == "max"  # a family
    assert metric("eval/pass@8").label == "fraction of prompts"
    assert best_direction("reward/format") == "max"  # one reward of several
    assert metric("time_round").timing and not metric("reward_mean").timing


def test_a_component_declares_its_metrics_through_its_entry() -> None:
    new = Metric("policy/zclip_frac", "fraction of clipped z-scores", direction="lower")
    registry = Registry()
    entry = Component("advantage", "zclip_test", Scaled, metrics=(new,))
    assert registry.load_plugin("p", Plugin().add(entry)).ok
    assert metric("policy/zclip_frac") == new and best_direction("policy/zclip_frac") == "min"
    undeclared = metric("rollout/never_declared")  # a prefix of components: a default row
    assert (undeclared.label, undeclared.direction) == ("rollout/never_declared", "none")
    assert "rollout/" in table.COMPONENT_PREFIXES


def test_a_component_reports_its_metrics_each_round() -> None:
    class Reporting:
        def metrics(self, batch: object, out: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"advantage/abs_mean": out.abs().mean()}

    out = torch.tensor([[1.0, -3.0]])
    assert reported("advantage (x, plugin p)", Reporting(), None, out) == {
        "advantage/abs_mean": torch.tensor(2.0)
    }
    assert reported("advantage", object(), None, out) == {}  # the member is optional

    class Wrong:
        def metrics(self, batch: object, out: torch.Tensor) -> dict[str, object]:
            return {"advantage/rows": out.abs().mean(1).repeat(2)}

    with pytest.raises(ComponentError, match=r"advantage .* reported metric 'advantage/rows'"):
        reported("advantage (x, plugin p)", Wrong(), None, out)


#: The modules that show metrics (the live line, the summary, curves.png, trackers, compare):
#: they name a metric through the table's constants, never by hand.
VIEWS = (
    "ppokit/trainer/display.py",
    "ppokit/trainer/metrics.py",
    "ppokit/trainer/trackers.py",
    "ppokit/runfolder/metrics.py",
    *(str(p.relative_to(ROOT)) for p in sorted((ROOT / "ppokit" / "compare").glob("*.py"))),
)


def _named_by_hand(path: Path) -> list[tuple[int, str]]:
    """(line, name) of each string that is a metric's name (outside ``__all__``)."""
    names = {m.name for m in table.METRICS} | {table.EVAL_PREFIX}
    tree = ast.parse(path.read_text(encoding="utf-8"))
    exported = {
        id(node)
        for stmt in tree.body
        if isinstance(stmt, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "__all__" for t in stmt.targets)
        for node in ast.walk(stmt)
    }
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and node.value in names
        and id(node) not in exported
    ]


def test_no_view_names_a_metric_by_hand() -> None:
    assert "ppokit/compare/summary.py" in VIEWS
    found = {view: _named_by_hand(ROOT / view) for view in VIEWS}
    assert {view: hits for view, hits in found.items() if hits} == {}


def test_the_check_finds_a_metric_named_by_hand(tmp_path: Path) -> None:
    view = tmp_path / "view.py"
    view.write_text('def last(h):\n    return h["reward_mean"], h.get("eval/")\n')
    assert _named_by_hand(view) == [(2, "reward_mean"), (2, "eval/")]


#: Small runs that between them write every metric of the built-ins: a critic, a KL term,
#: a rollout correction, held-out evaluations; several rewards and a group filter; a
#: multi-turn environment.
RUNS = {
    "critic_kl_eval": [
        "kl.coef=0.05",
        "policy.correction=token_tis",
        "rollout.logp_old=forward",
        "eval.prompts=4",
        "eval.every=1",
        "eval.batch_size=4",
    ],
    "rewards_filter": [
        "reward=[demo, {name: length_penalty, target: 2}]",
        "rollout.filter=informative",
        "rollout.max_generation_batches=2",
        "advantage=grpo",
        "critic=null",
    ],
    "multiturn": [
        "rollout.environment=echo",
        "data.options={turns: 2}",
        "rollout.max_turns=2",
        "reward=[]",
    ],
}


@pytest.mark.parametrize("overrides", RUNS.values(), ids=RUNS.keys())
def test_every_key_a_run_writes_has_a_row_in_the_table(
    tmp_path: Path, overrides: list[str]
) -> None:
    train(small_spec(tmp_path, "train.rounds=2", *overrides))
    keys = {key for record in read_metrics(tmp_path) for key in record}
    assert set(table.REQUIRED) <= keys
    # a key is a row of the table or of a family, a component's declared metric, or one
    # reward of several (reward/<name>); the default row is for a plugin's undeclared keys
    homeless = {key for key in keys if metric(key) == Metric(key, key)}
    assert homeless == set()
