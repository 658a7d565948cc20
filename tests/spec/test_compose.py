"""Composing a spec: defaults <- variant <- task <- the file <- --set, each value's origin,
${...} references, names on the command line, variants and tasks of plugins."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from ppokit.catalogue import Task, Variant
from ppokit.cli import app
from ppokit.spec import DEFAULT_TASK, SpecError, compose, load_spec, validate_spec
from tests.helpers import Plugin

pytestmark = pytest.mark.usefixtures("clean_registry")
runner = CliRunner()

BASE = Variant(
    "base_v",
    "A base variant",
    {
        "advantage": {"name": "gae", "lam": 0.9},
        "policy": {"loss": {"name": "ppo_clip", "clip_high": 0.3}, "entropy_coef": 0.01},
        "kl": {"estimator": "k3", "coef": 0.02},
        "train": {"rounds": 7},
    },
    papers=("A paper (Someone, 2025), arXiv:2501.00001",),
)
CHILD = Variant("child_v", "A child", {"train": {"rounds": 9}}, base="base_v")
CLASH = Variant("clash_v", "Sets the generation budget", {"rollout": {"n": 2}, "train": {}})
TASK = Task("my_task", "A task", {"rollout": {"n": 3, "max_new_tokens": 8}, "reward": "demo"})


def _plugin(*entries: Any) -> Plugin:
    plugin = Plugin()
    for entry in entries:
        plugin.add(entry)
    return plugin


def test_the_merge_rule_by_hand(use_registry: Any) -> None:
    registry = use_registry(_plugin(BASE, CHILD))
    file = {
        "variant": "child_v",
        "task": "demo",
        "advantage": {"lam": 0.5},  # no name: the variant's component, one parameter changed
        "policy": {"loss": "cispo"},  # another name: the component and its parameters replaced
        "kl": None,  # null replaces a section
    }
    composed = compose(file, ["train.rounds=11"], registry, label="s.yaml")
    data = composed.data
    assert data["advantage"] == {"name": "gae", "lam": 0.5}
    assert data["policy"] == {"loss": "cispo", "entropy_coef": 0.01}
    assert data["kl"] is None
    assert data["train"] == {"rounds": 11}
    assert data["rollout"] == {"max_new_tokens": 4} and data["reward"] == "demo"
    origin = composed.origin
    assert origin("advantage") == "s.yaml" and origin("policy.entropy_coef") == "variant base_v"
    assert origin("train.rounds") == "--set" and origin("rollout.max_new_tokens") == "task demo"
    assert origin("seed") == "default"
    # without --set, the child's rounds win over its base's
    assert compose({"variant": "child_v"}, (), registry).data["train"]["rounds"] == 9


def test_a_value_set_by_the_variant_and_the_task_is_an_error_naming_both(
    use_registry: Any,
) -> None:
    registry = use_registry(_plugin(CLASH, TASK))
    with pytest.raises(SpecError) as err:
        compose({"variant": "clash_v", "task": "my_task"}, (), registry)
    assert err.value.errors == [
        "rollout.n: set by both variant clash_v and task my_task: set it in the spec to choose"
    ]
    # the file chooses: still an error (the rule says which layers clash, not which wins)
    spec = validate_spec(compose({"variant": "clash_v"}, ["rollout.n=5"], registry).data)
    assert spec.rollout.n == 5


def test_unknown_names_are_one_line_each_with_close_names() -> None:
    with pytest.raises(SpecError) as err:
        compose({"variant": "dapoo", "task": "demmo"}, ())
    first, second = err.value.errors
    assert first.startswith("variant: unknown variant 'dapoo' (did you mean 'dapo'")
    assert second == "task: unknown task 'demmo' (did you mean 'demo'?)"


@settings(max_examples=25, deadline=None)
@given(budget=st.integers(5, 4096), extra=st.integers(0, 3))
def test_references_follow_the_budget_wherever_it_is_set(budget: int, extra: int) -> None:
    """DAPO's overlong window and Dr. GRPO's normaliser follow rollout.max_new_tokens."""
    spec = load_spec(None, [f"rollout.max_new_tokens={budget}"], base={"variant": "dapo"})
    assert spec.truncation.params["max_length"] == budget
    assert spec.truncation.params["buffer"] == (budget + 4) // 5
    dr = load_spec(None, [f"rollout.max_new_tokens={budget + extra}"], base={"variant": "dr_grpo"})
    assert dr.policy.aggregation.params["norm"] == budget + extra


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("${train.rounds / 8 + seed}", 0.5),
        ("${train.nothing}", "train.nothing is not a value of the spec"),
        ("${__import__('os')}", "only spec paths, numbers and + - * / // are allowed"),
        ("${train.rounds ** 99}", "only spec paths, numbers and + - * / // are allowed"),
        ("${-train.critic_lr * -1000}", 0.01),  # a default, read through the defaults
        ("${train.rounds // 0}", "division by zero"),
        ("${data.source + 1}", "not a number"),
        ("${train.vf_coef}", "refers to itself"),
    ],
)
def test_references_compute_paths_and_arithmetic_only(value: str, problem: Any) -> None:
    data = {"train": {"rounds": 4, "vf_coef": value}}
    if not isinstance(problem, str):
        assert validate_spec(data).train.vf_coef == pytest.approx(problem)
        return
    with pytest.raises(SpecError) as err:
        validate_spec(data)
    assert len(err.value.errors) == 1 and err.value.errors[0].startswith("train.vf_coef: ")
    assert problem in err.value.errors[0]


def _by_path(text: str) -> dict[str, str]:
    """Each line of a printed spec by its value's path (``train.rounds``)."""
    out, stack = {}, []
    for line in text.splitlines():
        if line.startswith("#") or ":" not in line:
            continue
        depth = (len(line) - len(line.lstrip())) // 2
        stack = [*stack[:depth], line.split(":")[0].strip()]
        out[".".join(stack)] = line
    return out


def test_print_spec_says_where_each_value_comes_from_and_reads_back(tmp_path: Path) -> None:
    spec_file = tmp_path / "s.yaml"
    spec_file.write_text("variant: dapo\ntask: demo\ntrain: {rounds: 3}\n")
    for smoke in ([], ["--smoke"]):
        result = runner.invoke(
            app, ["train", str(spec_file), "--print-spec", "--set", "rollout.n=4", *smoke]
        )
        assert result.exit_code == 0, result.output
        lines = _by_path(result.output)
        assert lines["rollout.filter"].endswith("# variant dapo")
        assert lines["rollout.n"].endswith("# --set") and lines["seed"].endswith("# default")
        assert lines["train.rounds"].endswith("# --smoke" if smoke else f"# {spec_file}")
        assert lines["rollout.max_new_tokens"].endswith("# --smoke" if smoke else "# task demo")
        printed = yaml.safe_load(result.output)
        assert validate_spec(printed).rollout.n == 4


def test_names_stand_for_specs_on_the_command_line(tmp_path: Path) -> None:
    assert runner.invoke(app, ["validate", "dapo", "arithmetic", "ppo_demo"]).exit_code == 0
    result = runner.invoke(app, ["explain", "gspo"])
    assert result.exit_code == 0 and "variant gspo: GSPO" in result.output
    assert "task demo: " in result.output
    result = runner.invoke(app, ["validate", "grpoo"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "no spec file, variant or task of that name (did you mean 'grpo'" in result.stderr
    # a file of that name wins over the variant
    (tmp_path / "dapo").write_text("advantage: rloo\nrollout: {n: 2}\n")
    spec = load_spec(tmp_path / "dapo")
    assert spec.variant is None and spec.advantage.name == "rloo"


def test_new_spec_writes_a_commented_spec_that_trains_as_the_variant(tmp_path: Path) -> None:
    out = tmp_path / "s.yaml"
    result = runner.invoke(app, ["new-spec", "dapo", "--task", "arithmetic", "--out", str(out)])
    assert result.exit_code == 0, result.output
    text = out.read_text()
    assert text.startswith("# DAPO") and "arXiv:2503.14476" in text
    spec = load_spec(out)
    assert (spec.variant, spec.task, spec.model.actor) == ("dapo", "arithmetic", "tiny")
    assert spec.rollout.filter.name == "informative" and spec.reward[0].name == "math_verify"
    again = runner.invoke(app, ["new-spec", "dapo", "--out", str(out)])
    assert again.exit_code == 1 and "already exists" in again.stderr
    assert out.read_text() == text  # nothing overwritten
    stdout = runner.invoke(app, ["new-spec", "grpo"])
    assert stdout.exit_code == 0 and f"task: {DEFAULT_TASK}" in stdout.output


def test_variants_and_tasks_list_and_show(use_registry: Any) -> None:
    use_registry(_plugin(BASE, CHILD, TASK))
    result = runner.invoke(app, ["variants", "--json"])
    rows = {row["name"]: row for row in __import__("json").loads(result.output)}
    assert rows["dapo"]["papers"] == "Yu et al., 2025" and rows["dapo"]["plugin"] == "ppokit"
    assert rows["child_v"]["base"] == "base_v" and rows["child_v"]["plugin"] == "test0"
    assert rows["base_v"]["papers"] == "Someone, 2025"
    tasks = runner.invoke(app, ["tasks"])
    assert tasks.exit_code == 0 and "my_task" in tasks.output and "arithmetic" in tasks.output
    shown = runner.invoke(app, ["show", "variant", "dapo"])
    assert shown.exit_code == 0
    assert "filter: informative" in shown.output and "soft_overlong" in shown.output
    assert "clip-higher" in shown.output  # the choices, and the objective it assembles
    missing = runner.invoke(app, ["show", "variant", "dapoo"])
    assert missing.exit_code == 1 and "did you mean 'dapo'" in missing.stderr


def test_two_plugins_with_one_variant_name_conflict_in_one_line(use_registry: Any) -> None:
    registry = use_registry(_plugin(BASE), _plugin(BASE))
    assert any(
        "variant 'base_v' is registered by more than one plugin" in line
        for line in registry.conflict_errors()
    )
    with pytest.raises(SpecError) as err:
        load_spec(None, base={"variant": "base_v"})
    assert "more than one plugin (test0, test1)" in err.value.errors[0]


@pytest.mark.parametrize(
    ("entry", "problem"),
    [
        (Variant("v", "t", {"data": {"source": "demo"}}), "settings set 'data'"),
        (Variant("v", "t", {"rollout": {"max_new_tokens": 9}}), "'rollout.max_new_tokens'"),
        (Task("t", "t", {"advantage": "grpo"}), "a task sets only data, reward, eval"),
        (Variant("v-1", "t", {}), "variant name 'v-1' is not an ASCII identifier"),
        (Variant("v", "t", [1, 2]), "settings must be a mapping"),  # type: ignore[arg-type]
    ],
)
def test_a_bad_variant_or_task_fails_its_plugin_in_one_line(
    use_registry: Any, entry: Any, problem: str
) -> None:
    registry = use_registry(_plugin(entry))
    (failed,) = registry.failed
    assert problem in (failed.error or "")
    assert registry.has_entry("variant", "dapo")  # the others load
