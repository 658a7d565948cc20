"""Prompt sources as a component kind: the built-ins through the registry give the rows the
stream classes give, a plugin's source (the one docs/plugins.md shows) works through a spec,
and a bad name or parameter is one line at validation."""

from __future__ import annotations

import json
import re
import types
from pathlib import Path
from typing import Any

import pytest

from ppokit.components.prompt_source import GeneratedSource, PromptSource
from ppokit.data import ArithmeticSource, DemoSource, JsonlSource, make_prompt_source
from ppokit.errors import UserError
from ppokit.registry import Registry, build_registry
from ppokit.spec import DataSpec, SpecError, validate_spec
from tests.helpers.data import assert_resumes

ROOT = Path(__file__).resolve().parents[2]


def _data(data: dict[str, Any], registry: Registry | None = None) -> DataSpec:
    return validate_spec({"data": data, "advantage": "grpo"}, registry).data


def _rows(source: PromptSource, chunks: tuple[int, ...] = (3, 5, 2)) -> list[dict[str, Any]]:
    rows = []
    for n in chunks:
        rows += source.next_rows(n)
    source.put_back(2)
    return rows + source.next_rows(4)


@pytest.fixture
def jsonl(tmp_path: Path) -> Path:
    path = tmp_path / "rows.jsonl"
    lines = [{"q": f"question {i}", "answer": f"#### {i}"} for i in range(7)]
    path.write_text("".join(json.dumps(row) + "\n" for row in lines))
    return path


@pytest.mark.parametrize("seed", [0, 3])
def test_builtins_by_every_form_give_the_stream_classes_rows(seed: int, jsonl: Path) -> None:
    demo = {"symbols": "wxyz", "turns": 2}
    arithmetic = {"ops": "+-*/", "terms": 3, "min_value": -5}
    rows = {"columns": {"prompt": "q"}, "answer_pattern": r"####\s*(.+)$"}
    cases = [
        (
            DemoSource(seed, demo),
            [{"source": "demo", "options": demo}, {"source": {"name": "demo", **demo}}],
        ),
        (
            ArithmeticSource(seed, arithmetic),
            [
                {"source": "arithmetic", "options": arithmetic},
                {"source": {"name": "arithmetic", **arithmetic}},
            ],
        ),
        (
            JsonlSource(seed, jsonl, **rows),
            [
                {"source": str(jsonl), **rows},
                {"source": {"name": "file", "path": str(jsonl), **rows}},
            ],
        ),
    ]
    for expected, forms in cases:
        want, state = _rows(expected), expected.state_dict()
        for form in forms:
            source = make_prompt_source(_data(form), seed)
            assert type(source) is type(expected)
            assert _rows(source) == want, form
            assert source.state_dict() == state
            assert_resumes(_data(form), seed, [3, 4, 6], 2)


def test_the_default_data_section_is_the_demo_source() -> None:
    data = DataSpec()
    assert data.prompt_source().name == "demo"
    assert _rows(make_prompt_source(data, 1)) == _rows(DemoSource(1, {}))


def _plugin_module() -> types.ModuleType:
    """The prompt source plugin of docs/plugins.md, run as written there."""
    text = (ROOT / "docs" / "plugins.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    code = next(b for b in blocks if '"prompt_source"' in b)
    module = types.ModuleType("countdown_plugin")
    exec(compile(code, "docs/plugins.md", "exec"), module.__dict__)
    return module


@pytest.fixture(scope="module")
def registry() -> Registry:
    registry = build_registry(strict=False)
    assert registry.load_plugin("countdown", _plugin_module()).ok
    return registry


def test_a_plugin_source_works_through_a_spec(registry: Registry) -> None:
    for form in (
        {"source": {"name": "countdown", "start": 5}},
        {"source": "countdown", "options": {"start": 5}},
    ):
        data = _data(form, registry)
        source = make_prompt_source(data, 7, registry)
        assert isinstance(source, GeneratedSource)
        rows = source.next_rows(20)
        assert all(re.fullmatch(r"Count down from [1-5]:", r["prompt"]) for r in rows)
        assert rows[0]["answer"].endswith("1")
        state = json.loads(json.dumps(source.state_dict()))
        assert state["source"] == "countdown"
        again = make_prompt_source(data, 99, registry)
        again.load_state_dict(state)
        assert again.next_rows(5) == source.next_rows(5)
        other = make_prompt_source(data, 8, registry).next_rows(20)
        assert other != rows  # the seed decides the rows
    with pytest.raises(UserError, match="the spec's is 'countdown'"):
        make_prompt_source(_data({"source": "countdown"}, registry), 0, registry).load_state_dict(
            make_prompt_source(DataSpec(), 0).state_dict()
        )


@pytest.mark.parametrize(
    ("data", "line"),
    [
        (
            {"source": {"name": "countdwn"}},
            "data.source: unknown prompt_source 'countdwn' (did you mean 'countdown'?)",
        ),
        (
            {"source": {"name": "countdown", "start": 0}},
            "data.source.start: Input should be greater than or equal to 1",
        ),
        (
            {"source": {"name": "countdown", "stat": 3}},
            "data.source.stat: Extra inputs are not permitted (did you mean 'start'?)",
        ),
        (
            {"source": "countdown", "options": {"start": "x"}},
            "data.options.start: Input should be a valid integer, unable to parse string as an integer",
        ),
        ({"source": {"name": "file"}}, "data.source.path: Field required"),
        (
            {"source": {"name": "hf", "dataset": "a b"}},
            "data.source.dataset: String should match pattern",
        ),
        (
            {"source": {"name": "demo"}, "columns": {"prompt": "q"}},
            "data: columns: with source a mapping, the source's parameters go in it (data.source.<parameter>)",
        ),
        (
            {"source": "countdown", "split": "test"},
            "data: split: applies to a data file or dataset, not to the source 'countdown'",
        ),
        (
            {"source": "arithmetc"},
            "data.source: no prompt source nor data file 'arithmetc' (did you mean 'arithmetic'?)",
        ),
        (
            {"source": {"name": "demo"}, "options": {"symbols": "ab"}},
            "data: options: with source a mapping",
        ),
    ],
)
def test_bad_sources_are_one_line_at_validation(registry: Registry, data: dict, line: str) -> None:
    with pytest.raises(SpecError) as caught:
        _data(data, registry)
    assert len(caught.value.errors) == 1, caught.value.errors
    (error,) = caught.value.errors
    assert error.startswith(line) and "\n" not in error, error
    with pytest.raises(UserError):  # and a run refuses it the same way
        make_prompt_source(DataSpec.model_validate(data), 0, registry)


def test_eval_data_is_checked_as_its_own_section(registry: Registry) -> None:
    with pytest.raises(SpecError, match=r"eval\.data\.source\.start: Input should be greater"):
        validate_spec({"eval": {"data": {"source": {"name": "countdown", "start": 0}}}}, registry)


def test_a_mapping_source_round_trips_through_the_spec_file(registry: Registry) -> None:
    spec = validate_spec({"data": {"source": {"name": "countdown", "start": 4}}}, registry)
    again = validate_spec(spec.model_dump(), registry)
    assert again.data.prompt_source(registry).params == {"start": 4}
    assert again.data.label == "countdown"
