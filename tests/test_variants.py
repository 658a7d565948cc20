"""Every registered variant (the built-ins and the plugins kept in plugins/): it validates on
every task it fits, explains itself, cites its paper, and trains two smoke rounds through
the CLI by its name; the example specs name their variant and restate none of it."""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from ppokit import docgen as GEN_DOCS
from ppokit.catalogue import Variant
from ppokit.cli import app
from ppokit.explain import explain
from ppokit.registry import Registry, get_registry
from ppokit.spec import DEFAULT_TASK, Spec, SpecError, compose, leaf_values, validate_spec
from ppokit.spec.files import read_spec_file
from tests.helpers import ROOT

MISSING = object()
ARXIV = re.compile(r"arXiv:\d{4}\.\d{4,5}")
REGISTRY, FAILED = GEN_DOCS.method_registry(ROOT)
VARIANTS = [info.name for info in REGISTRY.entries("variant")]
TASKS = [info.name for info in REGISTRY.entries("task")]
#: Every paper method of the package, in the order docs/variants.md lists them.
BUILTIN_METHODS = ["ppo_demo", "ppo", "vc_ppo", "vapo", "grpo", "grpo_tis", "dr_grpo", "dapo"]
BUILTIN_METHODS += ["rloo", "reinforce_pp", "reinforce_pp_baseline", "remax", "opo", "gspo"]
BUILTIN_METHODS += ["cispo", "gdpo"]
SPECS = sorted([*ROOT.glob("examples/specs/*.yaml"), ROOT / "ppokit" / "specs" / "demo.yaml"])


def _spec(variant: str, task: str = DEFAULT_TASK) -> Spec:
    return validate_spec(compose({"variant": variant, "task": task}, (), REGISTRY).data, REGISTRY)


def test_the_builtin_variants_and_the_in_tree_plugins_variants() -> None:
    assert not FAILED
    builtins = [i.name for i in REGISTRY.entries("variant") if i.plugin == "ppokit"]
    assert builtins == BUILTIN_METHODS
    assert "ppo_hlgauss" in VARIANTS


@pytest.mark.parametrize("name", VARIANTS)
def test_variant_validates_explains_and_cites(name: str) -> None:
    spec = _spec(name)
    text = explain(spec, registry=REGISTRY, source=name)
    assert f"variant {name}: " in text
    for _slot, _kind, comp in spec.slots():
        assert re.search(rf"\b{re.escape(comp.name)}\b", text)
    entry = REGISTRY.entry("variant", name).entry
    assert isinstance(entry, Variant)
    assert any(ARXIV.search(str(p)) for p in entry.papers), f"{name}: no arXiv id"
    assert entry.choices and entry.scaled


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("name", VARIANTS)
def test_every_variant_composes_with_every_task_or_says_why(name: str, task: str) -> None:
    """A variant on a task validates, or the one line says which value does not fit."""
    try:
        spec = _spec(name, task)
    except SpecError as exc:
        assert exc.errors and all(": " in line for line in exc.errors)
        return
    assert (spec.variant, spec.task) == (name, task)
    # the resolved spec, composed again as a file, is the same spec (nothing applied twice)
    again = validate_spec(compose(spec.model_dump(), (), REGISTRY).data, REGISTRY)
    assert again == spec


def _settings(word: str, name: str) -> dict[str, Any]:
    """The values a variant (with its bases) or a task sets, by path."""
    data = compose({word: name}, (), REGISTRY).data
    data.pop(word)
    return leaf_values(data)


def _file_values(path: Path) -> dict[str, Any]:
    return leaf_values(read_spec_file(path))


def _chain(name: str | None) -> set[str]:
    names = set()
    while name:
        names.add(name)
        entry = REGISTRY.entry("variant", name).entry
        assert isinstance(entry, Variant)
        name = entry.base
    return names


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.stem)
def test_no_spec_restates_a_variant_or_a_task(path: Path) -> None:
    """A spec names its variant and task and sets only what differs: no value equal to the
    one its variant or task sets, and no variant it does not name written out in full."""
    values = _file_values(path)
    named = _chain(values.get("variant"))
    for word, names in (("variant", VARIANTS), ("task", TASKS)):
        for name in names:
            sets = _settings(word, name)
            if name in named or values.get(word) == name:
                same = sorted(p for p, v in sets.items() if values.get(p, MISSING) == v)
                assert not same, f"{path.name} restates {word} {name}: {same}"
            else:
                missing = [p for p, v in sets.items() if values.get(p, MISSING) != v]
                assert missing, f"{path.name} writes out {word} {name}: name it instead"


@pytest.mark.slow
@pytest.mark.parametrize("name", VARIANTS)
def test_variant_smoke_run_through_the_cli_by_its_name(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clean_registry: None
) -> None:
    if not get_registry().has_entry("variant", name):
        pytest.skip(f"variant {name} comes with a plugin that is not installed")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # smoke runs write under tmp_path
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["train", name, "--smoke", "--out", str(out)])
    assert result.exit_code == 0, f"{result.output}\n{result.exception!r}"
    metrics = sorted(tmp_path.rglob("metrics.jsonl"))
    assert len(metrics) == 1, metrics
    records = [json.loads(line) for line in metrics[0].read_text().splitlines()]
    assert [r["round"] for r in records] == [1, 2]
    assert all(r["reward_mean"] is not None for r in records)
    ran = Spec.model_validate(yaml.safe_load((metrics[0].parent / "spec.yaml").read_text()))
    assert (ran.variant, ran.task) == (name, DEFAULT_TASK)
    assert ran.advantage == _spec(name).advantage


def test_the_example_specs_resolve_to_what_they_trained_before(registry: Registry) -> None:
    """The paper methods' example specs, composed, are the specs they were written out as."""
    spec = validate_spec(
        compose(read_spec_file(ROOT / "examples/specs/dapo.yaml"), (), registry).data, registry
    )
    assert spec.truncation.params == {"max_length": 320, "buffer": 64, "factor": 1.0}
    assert spec.rollout.filter.name == "informative" and spec.model.actor == "smollm2-135m-instruct"
    dr = validate_spec(
        compose(read_spec_file(ROOT / "examples/specs/dr_grpo.yaml"), (), registry).data, registry
    )
    assert dr.policy.aggregation.params == {"norm": 256}


@pytest.fixture(scope="module")
def registry() -> Registry:
    return REGISTRY
