"""The table of metrics: every list of metric names is read from it, every metric has one
direction, and a component's own diagnostics need no edit to the trainer."""

from __future__ import annotations

import pytest
import torch

from ppokit import metrics_table as table
from ppokit.catalogue import Component
from ppokit.errors import ComponentError
from ppokit.metrics_table import Metric, best_direction, metric
from ppokit.registry import Registry
from ppokit.trainer import display, metrics
from ppokit.trainer.estimation import reported
from tests.helpers import Plugin, Scaled


def test_every_reader_derives_its_list_from_the_table() -> None:
    assert metrics.REQUIRED is table.REQUIRED and metrics.TIMING is table.TIMING
    assert metrics.CURVES is table.CURVES and metrics.EVAL_CURVES is table.EVAL_CURVES
    assert display.SHOWN is table.SHOWN and display.SUMMARY is table.SUMMARY
    assert display.best_direction is table.best_direction
    names = [m.name for m in table.METRICS]
    assert len(names) == len(set(names))  # each metric once
    for name in (*table.REQUIRED, *table.TIMING, *table.CURVES, *table.SUMMARY):
        assert name in names
    assert table.REQUIRED[0] == "round"


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
