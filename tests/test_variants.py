"""Every paper method in examples/specs: it validates, explains itself, cites its paper, and
trains two smoke rounds through the CLI."""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from ppokit import docgen as GEN_DOCS
from ppokit.cli import app
from ppokit.explain import explain
from ppokit.registry import Registry, get_registry
from ppokit.spec import Spec, SpecError, load_spec

ARXIV = re.compile(r"arXiv:\d{4}\.\d{4,5}")


METHODS = GEN_DOCS.method_paths()


@pytest.fixture(scope="module")
def registry() -> Registry:
    """The built-ins plus the plugins kept in plugins/, loaded from source."""
    reg, failed = GEN_DOCS.method_registry()
    assert not failed, f"in-tree plugins that did not load: {failed}"
    return reg


def test_every_method_has_a_spec() -> None:
    names = [p.stem for p in METHODS]
    assert names[: len(GEN_DOCS.METHODS)] == list(GEN_DOCS.METHODS)  # each listed one, in order
    assert not set(names) & GEN_DOCS.EXAMPLES


@pytest.mark.parametrize("path", METHODS, ids=lambda p: p.stem)
def test_method_validates_explains_and_cites(path: Path, registry: Registry) -> None:
    spec = load_spec(path, registry=registry)
    text = explain(spec, registry=registry, source=path.name)
    assert text.strip()
    for slot, _kind, comp in spec.slots():
        assert re.search(rf"\b{re.escape(comp.name)}\b", text), f"{slot}: {comp.name}"
    header = "\n".join(GEN_DOCS.header_comment(path))
    assert ARXIV.search(header), f"{path.name}: the header comment names no arXiv id"


def _missing_components(spec_path: Path) -> list[str]:
    """Components of the spec that the installed plugins do not provide."""
    try:
        load_spec(spec_path, registry=get_registry())
    except SpecError as exc:
        return exc.errors
    return []


@pytest.mark.slow
@pytest.mark.parametrize("path", METHODS, ids=lambda p: p.stem)
def test_method_smoke_run_through_the_cli(
    path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clean_registry: None
) -> None:
    missing = _missing_components(path)
    if missing:
        pytest.skip(f"needs a plugin that is not installed: {'; '.join(missing)}")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # smoke runs write under tmp_path
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["train", str(path), "--smoke", "--out", str(out)])
    assert result.exit_code == 0, f"{result.output}\n{result.exception!r}"
    metrics = sorted(tmp_path.rglob("metrics.jsonl"))
    assert len(metrics) == 1, metrics
    records = [json.loads(line) for line in metrics[0].read_text().splitlines()]
    assert [r["round"] for r in records] == [1, 2]
    assert all(r["reward_mean"] is not None for r in records)
    ran = Spec.model_validate(yaml.safe_load((metrics[0].parent / "spec.yaml").read_text()))
    assert ran.advantage == load_spec(path).advantage
