"""Prompt sources: determinism and resumption, JSONL files, the column map and the data
settings' checks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ppokit.data import (
    make_prompt_source,
)
from ppokit.errors import UserError
from ppokit.spec import DataSpec, SpecError, validate_spec
from ppokit.trainer.prompts import format_prompts
from tests.helpers.data import assert_resumes
from tests.trainer.test_prompts import TEMPLATE, chat_tokenizer


def _jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def jsonl_file(tmp_path: Path) -> Path:
    return _jsonl(
        tmp_path / "rows.jsonl",
        [{"prompt": f"p{i}", "answer": str(i), "meta": {"i": i}} for i in range(7)],
    )


def _specs(jsonl: Path) -> list[DataSpec]:
    return [
        DataSpec(source="arithmetic"),
        DataSpec(source="arithmetic", options={"ops": "+-*/", "terms": 4, "min_value": -9}),
        DataSpec(source="demo", options={"symbols": "abcdefghijklmnop"}),
        DataSpec(source=str(jsonl)),
        DataSpec(source=str(jsonl), shuffle=False),
    ]


# ----------------------------------------------------------------- determinism
def test_same_seed_same_rows_other_seed_other_rows(jsonl_file: Path) -> None:
    for spec in _specs(jsonl_file):
        a = make_prompt_source(spec, seed=3).next_rows(30)
        b = make_prompt_source(spec, seed=3).next_rows(30)
        assert a == b
        for row in a:
            assert isinstance(row["prompt"], str)
        if spec.source != str(jsonl_file) or spec.shuffle:
            assert make_prompt_source(spec, seed=4).next_rows(30) != a


def test_chunking_does_not_change_the_stream(jsonl_file: Path) -> None:
    spec = DataSpec(source=str(jsonl_file))
    whole = make_prompt_source(spec, 0).next_rows(20)
    source = make_prompt_source(spec, 0)
    pieces = source.next_rows(0) + source.next_rows(3) + source.next_rows(11) + source.next_rows(6)
    assert pieces == whole


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32),
    which=st.integers(0, 4),
    chunks=st.lists(st.integers(0, 9), min_size=1, max_size=6),
    split=st.integers(0, 6),
)
def test_resume_draws_the_same_rows(
    tmp_path_factory: pytest.TempPathFactory, seed: int, which: int, chunks: list[int], split: int
) -> None:
    jsonl = _jsonl(
        tmp_path_factory.mktemp("resume") / "rows.jsonl",
        [{"prompt": f"p{i}", "answer": str(i)} for i in range(5)],
    )
    spec = _specs(jsonl)[which]
    if spec.source == "demo":
        spec = DataSpec(source="arithmetic", options={"terms": 3})
    assert_resumes(spec, seed, chunks, split)


def test_demo_source_resumes_and_passes_options() -> None:
    spec = DataSpec(source="demo", options={"symbols": "xyz"})
    source = make_prompt_source(spec, 5)
    rows = source.next_rows(4)
    assert all(r["answer"] in "xyz" and r["prompt"] == f"echo {r['answer']}" for r in rows)
    state = source.state_dict()
    later = source.next_rows(4)
    again = make_prompt_source(spec, 5)
    again.load_state_dict(state)
    assert again.next_rows(4) == later


def test_rows_are_fresh_copies(jsonl_file: Path) -> None:
    source = make_prompt_source(DataSpec(source=str(jsonl_file), shuffle=False), 0)
    row = source.next_rows(1)[0]
    row["prompt"] = "changed"
    source.load_state_dict({**source.state_dict(), "drawn": 0})
    assert source.next_rows(1)[0]["prompt"] == "p0"


def test_state_of_another_source_is_rejected(jsonl_file: Path) -> None:
    arithmetic = make_prompt_source(DataSpec(source="arithmetic"), 0)
    jsonl = make_prompt_source(DataSpec(source=str(jsonl_file)), 0)
    with pytest.raises(UserError, match="prompt source is 'jsonl'"):
        arithmetic.load_state_dict(jsonl.state_dict())


def test_changed_data_file_is_rejected_on_resume(jsonl_file: Path) -> None:
    state = make_prompt_source(DataSpec(source=str(jsonl_file)), 0).state_dict()
    with jsonl_file.open("a") as f:
        f.write(json.dumps({"prompt": "new"}) + "\n")
    with pytest.raises(UserError, match="changed since the checkpoint"):
        make_prompt_source(DataSpec(source=str(jsonl_file)), 0).load_state_dict(state)


# ------------------------------------------------------------------------ JSONL
def test_jsonl_cycles_through_every_row_each_epoch(jsonl_file: Path) -> None:
    rows = [json.loads(line) for line in jsonl_file.read_text().splitlines()]
    ordered = make_prompt_source(DataSpec(source=str(jsonl_file), shuffle=False), 0)
    assert ordered.next_rows(14) == rows + rows
    shuffled = make_prompt_source(DataSpec(source=str(jsonl_file)), 0)
    epochs = [shuffled.next_rows(7) for _ in range(3)]
    key = lambda r: r["prompt"]  # noqa: E731
    for epoch in epochs:
        assert sorted(epoch, key=key) == sorted(rows, key=key)
    assert len({tuple(key(r) for r in e) for e in epochs}) > 1  # reshuffled each epoch


def test_jsonl_missing_file(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"data file not found: .*nope\.jsonl"):
        make_prompt_source(DataSpec(source=str(tmp_path / "nope.jsonl")), 0)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"prompt": "a"}\n\n{"prompt": "b"\n', r":3: invalid JSON"),
        ('{"prompt": "a"}\n{"answer": "1"}\n', r":2: the row has no 'prompt' field"),
        ('{"prompt": "a"}\n[1, 2]\n', r":2: expected a JSON object, got list"),
        ('{"prompt": 5}\n', r":1: 'prompt' must be a string"),
        ("\n  \n", "has no rows"),
    ],
)
def test_jsonl_bad_file(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    with pytest.raises(UserError, match=message) as info:
        make_prompt_source(DataSpec(source=str(path)), 0)
    assert "\n" not in str(info.value)


def test_jsonl_takes_no_options(jsonl_file: Path) -> None:
    with pytest.raises(UserError, match="takes no options"):
        make_prompt_source(DataSpec(source=str(jsonl_file), options={"ops": "+"}), 0)


# ------------------------------------------- column map, messages, answer_pattern
def test_jsonl_column_map_messages_and_answer_pattern(tmp_path: Path) -> None:
    """The JSONL reader (no ``datasets`` needed) maps rows as every data file does."""
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 6 * 7?"},
        {"role": "assistant", "content": "42"},
    ]
    path = _jsonl(
        tmp_path / "rows.jsonl",
        [
            {"question": "What is 1 + 1?", "solution": "1 + 1 = 2\n#### 2", "id": 1},
            {"question": chat, "solution": "#### 42", "id": 2},
        ],
    )
    spec = DataSpec(
        source=str(path),
        columns={"prompt": "question", "answer": "solution"},
        answer_pattern=r"####\s*(.+)$",
        shuffle=False,
    )
    rows = make_prompt_source(spec, 0).next_rows(2)
    assert rows == [
        {"prompt": "What is 1 + 1?", "answer": "2", "id": 1},
        {"prompt": "What is 6 * 7?", "answer": "42", "id": 2, "messages": chat[:2]},
    ]
    tokenizer = chat_tokenizer(TEMPLATE)
    assert format_prompts(rows, tokenizer, DataSpec(chat_template=True, system_prompt="S")) == [
        "<|system|>S\n<|user|>What is 1 + 1?\n<|assistant|>",
        "<|system|>Be brief.\n<|user|>What is 6 * 7?\n<|assistant|>",
    ]


@pytest.mark.parametrize(
    ("rows", "spec", "message"),
    [
        (
            [{"question": "a"}, {"q": "b"}],
            {"columns": {"prompt": "question"}},
            r":2: the row has no 'question' field \(data\.columns\.prompt\); its fields: q$",
        ),
        (
            [{"prompt": "a", "answer": "#### 1"}, {"prompt": "b", "answer": "none"}],
            {"answer_pattern": r"####\s*(.+)$"},
            r":2: data\.answer_pattern '####\\\\s\*\(\.\+\)\$' does not match the answer 'none'",
        ),
        (
            [{"prompt": [{"role": "assistant", "content": "hi"}]}],
            {},
            r":1: the chat messages in 'prompt' have no user message",
        ),
    ],
)
def test_jsonl_bad_rows_name_their_line(
    tmp_path: Path, rows: list[dict], spec: dict, message: str
) -> None:
    path = _jsonl(tmp_path / "rows.jsonl", rows)
    with pytest.raises(UserError, match=message):
        make_prompt_source(DataSpec(source=str(path), **spec), 0)


def test_jsonl_takes_no_split(jsonl_file: Path) -> None:
    with pytest.raises(UserError, match=r"data\.split: a JSONL file is read whole"):
        make_prompt_source(DataSpec(source=str(jsonl_file), split="test"), 0)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"source": "demo", "columns": {"prompt": "q"}}, "data: columns: applies to a data file"),
        (
            {"source": "arithmetic", "answer_pattern": "(x)", "split": "test"},
            "data: answer_pattern, split: apply to a data file or dataset, not to the built-in "
            "'arithmetic' generator",
        ),
        ({"source": "x.parquet", "config": "main"}, "data: config: applies to a Hub dataset"),
        ({"source": "hf:a b"}, "data: source: a Hub dataset is written hf:owner/name"),
        ({"source": "x.parquet", "answer_pattern": "(a"}, "answer_pattern: not a regular expr"),
        ({"source": "x.parquet", "answer_pattern": "#+"}, "exactly one capturing group.*got 0"),
        ({"source": "x.parquet", "answer_pattern": "(a)(b)"}, "exactly one capturing group"),
        ({"source": "x.parquet", "columns": {"prompt": ""}}, "columns: field and column names"),
        ({"source": "x.parquet", "columns": {"prompt": 3}}, r"data\.columns\.prompt"),
        ({"source": "x.parquet", "split": ""}, r"data\.split"),
    ],
)
def test_data_settings_are_checked_by_validate(data: dict, message: str) -> None:
    with pytest.raises(SpecError, match=message):
        validate_spec({"data": data, "advantage": "grpo"})


def test_data_settings_that_validate() -> None:
    for data in (
        {"source": "hf:openai/gsm8k", "config": "main", "split": "test"},
        {"source": "hf:gsm8k", "answer_pattern": r"####\s*(.+)$", "columns": {"prompt": "q"}},
        {"source": "data/rows.parquet", "answer_pattern": r"(?:####|answer:)\s*(?P<a>.+)$"},
        {"source": "arithmetic", "split": "train"},
    ):
        assert validate_spec({"data": data, "advantage": "grpo"}).data.source == data["source"]


def test_which_sources_need_the_datasets_package() -> None:
    needs = {
        "demo": False,
        "arithmetic": False,
        "rows.jsonl": False,
        "data/ROWS.JSONL": False,
        "rows.json": True,
        "rows.jsonl.gz": True,
        "rows.parquet": True,
        "saved_folder": True,
        "hf:openai/gsm8k": True,
    }
    assert {s: DataSpec(source=s).needs_datasets() for s in needs} == needs
