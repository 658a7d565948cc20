"""Prompt sources and prompt formatting."""

from __future__ import annotations

import json
import random
import re
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ppokit.data import (
    ArithmeticSource,
    JsonlSource,
    PromptSource,
    _evaluate,
    format_prompts,
    make_arithmetic_row,
    make_prompt_source,
)
from ppokit.errors import UserError
from ppokit.spec import DataSpec, SpecError, validate_spec

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "data" / "arithmetic_sample.jsonl"


def _exact(expression: str) -> Fraction:
    """The exact value of an arithmetic expression, evaluated by Python over Fractions."""
    code = re.sub(r"\d+", lambda m: f"Fraction({m.group()})", expression)
    return eval(code, {"Fraction": Fraction, "__builtins__": {}})


def _answer(text: str) -> Fraction:
    return Fraction(text)


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
    uninterrupted = make_prompt_source(spec, seed)
    expected = [uninterrupted.next_rows(n) for n in chunks]

    first = make_prompt_source(spec, seed)
    got = [first.next_rows(n) for n in chunks[:split]]
    state = json.loads(json.dumps(first.state_dict()))
    resumed = make_prompt_source(spec, seed + 1)  # the state carries the seed
    resumed.load_state_dict(state)
    got += [resumed.next_rows(n) for n in chunks[split:]]
    assert got == expected
    assert resumed.state_dict() == uninterrupted.state_dict()


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


# ------------------------------------------------------------------- arithmetic
@pytest.mark.parametrize(
    ("numbers", "ops", "value"),
    [
        ([23, 45], ["+"], Fraction(68)),
        ([2, 3, 4], ["+", "*"], Fraction(14)),
        ([2, 3, 4], ["*", "-"], Fraction(2)),
        ([1, 2, 3], ["-", "-"], Fraction(-4)),
        ([8, 2, 2], ["/", "/"], Fraction(2)),
        ([7, 2], ["/"], Fraction(7, 2)),
        ([5, -3, 2, 4], ["-", "*", "/"], Fraction(13, 2)),
    ],
)
def test_evaluate_by_hand(numbers: list[int], ops: list[str], value: Fraction) -> None:
    assert _evaluate(numbers, ops) == value


class Scripted(random.Random):
    """An rng returning given operands and always choosing ``op``."""

    def __init__(self, values: list[int], op: str) -> None:
        super().__init__(0)
        self.values = iter(values)
        self.op = op

    def randint(self, a: int, b: int) -> int:
        return next(self.values)

    def choice(self, seq: Any) -> Any:
        return self.op


def test_arithmetic_rows_by_hand() -> None:
    assert make_arithmetic_row(Scripted([23, 45], "+")) == {
        "prompt": "What is 23 + 45? Put the final answer in \\boxed{}.",
        "answer": "68",
        "expression": "23 + 45",
    }
    row = make_arithmetic_row(Scripted([-7, -2, 4], "-"), terms=3, min_value=-9)
    assert (row["expression"], row["answer"]) == ("(-7) - (-2) - 4", "-9")
    row = make_arithmetic_row(Scripted([3, 0, 6, 0, 0, 2], "/"), ops="/", terms=3)
    assert (row["expression"], row["answer"]) == ("3 / 6 / 2", "1/4")  # zero divisors redrawn


@settings(max_examples=80, deadline=None)
@given(
    seed=st.integers(0, 2**32),
    ops=st.sets(st.sampled_from("+-*/"), min_size=1).map("".join),
    low=st.integers(-20, 20),
    width=st.integers(0, 50),
    terms=st.integers(2, 5),
)
def test_arithmetic_answers_are_correct(
    seed: int, ops: str, low: int, width: int, terms: int
) -> None:
    if "/" in ops and low == 0 and width == 0:
        width = 1
    options = {"ops": ops, "min_value": low, "max_value": low + width, "terms": terms}
    source = make_prompt_source(DataSpec(source="arithmetic", options=options), seed)
    for row in source.next_rows(5):
        expression = row["expression"]
        assert row["prompt"] == f"What is {expression}? Put the final answer in \\boxed{{}}."
        assert _exact(expression) == _answer(row["answer"])
        numbers = [int(n) for n in re.findall(r"-?\d+", expression)]
        assert len(numbers) == terms
        assert all(low <= n <= low + width for n in numbers)
        assert set(re.findall(r" ([-+*/]) ", expression)) <= set(ops)


def test_arithmetic_answers_pass_math_verify() -> None:
    from ppokit.registry import get_registry

    reward = get_registry().create("reward", "math_verify")
    rows = ArithmeticSource(0, {"ops": "+-*/", "min_value": -9, "max_value": 30}).next_rows(12)
    responses = [f"\\boxed{{{r['answer']}}}" for r in rows]
    prompts = [r["prompt"] for r in rows]
    answers = [r["answer"] for r in rows]
    assert reward(prompts, responses, answer=answers).tolist() == [1.0] * 12
    wrong = [f"\\boxed{{{_answer(a) + 1}}}" for a in answers]
    assert reward(prompts, wrong, answer=answers).tolist() == [0.0] * 12


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"ops": "+^"}, "data.options.ops"),
        ({"ops": ""}, "data.options.ops"),
        ({"min_value": 5, "max_value": 1}, "must not exceed"),
        ({"terms": 1}, "data.options.terms"),
        ({"ops": "/", "min_value": 0, "max_value": 0}, "division"),
        ({"digits": 3}, "data.options.digits: Extra inputs are not permitted"),
        ({"terms": 2.5}, "data.options.terms"),
    ],
)
def test_arithmetic_bad_options(options: dict, message: str) -> None:
    with pytest.raises(UserError, match=message):
        make_prompt_source(DataSpec(source="arithmetic", options=options), 0)
    with pytest.raises(SpecError, match=message):  # and the spec says so before any work
        validate_spec({"data": {"source": "arithmetic", "options": options}, "advantage": "grpo"})


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"source": "demo", "options": {"symbols": ""}}, "data.options.symbols"),
        ({"source": "demo", "options": {"size": 3}}, "data.options.size"),
        ({"source": "prompts.jsonl", "options": {"ops": "+"}}, "a data file takes no options"),
    ],
)
def test_source_options_are_checked_by_validate(data: dict, message: str) -> None:
    with pytest.raises(SpecError, match=message):
        validate_spec({"data": data, "advantage": "grpo"})


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


def test_example_file_loads_and_its_answers_are_right() -> None:
    source = make_prompt_source(DataSpec(source=str(EXAMPLE), shuffle=False), 0)
    assert isinstance(source, JsonlSource) and isinstance(source, PromptSource)
    for row in source.next_rows(len(source.rows)):
        expression = re.fullmatch(
            r"What is (.*)\? Put the final answer in \\boxed\{\}\.", row["prompt"]
        )
        assert expression is not None
        assert _exact(expression.group(1)) == _answer(row["answer"])


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


# --------------------------------------------------------------- format_prompts
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _tokenizer(template: str | None):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={"[UNK]": 0, "hi": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    tokenizer.chat_template = template
    return tokenizer


ROWS = [{"prompt": "What is 1 + 1?", "answer": "2"}, {"prompt": "hi", "answer": ""}]


def test_format_prompts_plain() -> None:
    assert format_prompts(ROWS, None, DataSpec()) == ["What is 1 + 1?", "hi"]
    assert format_prompts(ROWS, _tokenizer(TEMPLATE), DataSpec(system_prompt="x")) == [
        "What is 1 + 1?",
        "hi",
    ]


def test_format_prompts_with_chat_template() -> None:
    tokenizer = _tokenizer(TEMPLATE)
    assert format_prompts(ROWS, tokenizer, DataSpec(chat_template=True)) == [
        "<|user|>What is 1 + 1?\n<|assistant|>",
        "<|user|>hi\n<|assistant|>",
    ]
    spec = DataSpec(chat_template=True, system_prompt="Be brief.")
    assert format_prompts(ROWS[:1], tokenizer, spec) == [
        "<|system|>Be brief.\n<|user|>What is 1 + 1?\n<|assistant|>"
    ]


def test_format_prompts_without_a_template_is_a_user_error() -> None:
    with pytest.raises(UserError, match="no chat template"):
        format_prompts(ROWS, _tokenizer(None), DataSpec(chat_template=True))


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
    tokenizer = _tokenizer(TEMPLATE)
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
