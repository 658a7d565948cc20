"""Data files and datasets read through the ``datasets`` package: every local format, the
column map, the messages layout, ``answer_pattern``, determinism and resume, Hub names
offline, a missing ``datasets`` package, and the example files with the example spec.
Nothing here touches the network."""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ppokit.data import (
    DatasetSource,
    JsonlSource,
    RowSource,
    make_prompt_source,
)
from ppokit.errors import MissingDependency, UserError
from ppokit.spec import DataSpec, load_spec
from ppokit.trainer.prompts import chat_messages, format_prompts
from tests.helpers.data import assert_resumes

datasets = pytest.importorskip("datasets")
pa = pytest.importorskip("pyarrow")

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "data"
EXAMPLE_SPEC = ROOT / "examples" / "specs" / "smollm2_gsm8k_style.yaml"
GSM8K = r"####\s*(.+)$"


@pytest.fixture(scope="module", autouse=True)
def _offline_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The datasets cache in a temporary folder, and the Hub switched off."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path_factory.mktemp("hf_cache"))
        mp.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
        mp.setattr(datasets.config, "HF_DATASETS_OFFLINE", True, raising=False)
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        yield


def _columns(n: int = 7) -> dict[str, list[Any]]:
    return {
        "question": [f"question {i}?" for i in range(n)],
        "final": [f"worked {i} ... #### {i} apples" for i in range(n)],
        "level": [i % 3 for i in range(n)],
    }


def _expected(n: int = 7) -> list[dict[str, Any]]:
    return [{"prompt": f"question {i}?", "answer": f"{i} apples", "level": i % 3} for i in range(n)]


def _spec(source: Path | str, **kw: Any) -> DataSpec:
    kw.setdefault("columns", {"prompt": "question", "answer": "final"})
    kw.setdefault("answer_pattern", GSM8K)
    return DataSpec(source=str(source), **kw)


def _arrow_stream(ds: Any, path: Path) -> None:
    table = ds.data.table
    with pa.OSFile(str(path), "wb") as f, pa.ipc.new_stream(f, table.schema) as writer:
        writer.write_table(table)


def _json_gz(ds: Any, path: Path) -> None:
    plain = path.with_suffix("")
    ds.to_json(str(plain))
    path.write_bytes(gzip.compress(plain.read_bytes(), mtime=0))
    plain.unlink()


def _folder_of_files(ds: Any, path: Path) -> None:
    path.mkdir()
    ds.to_parquet(str(path / "train.parquet"))
    ds.select([0]).to_parquet(str(path / "test.parquet"))


def _saved_dict(ds: Any, path: Path) -> None:
    datasets.DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(str(path))


#: name -> (file or folder name, writer of a Dataset to that path)
WRITERS: dict[str, tuple[str, Callable[[Any, Path], None]]] = {
    "parquet": ("rows.parquet", lambda ds, p: ds.to_parquet(str(p))),
    "csv": ("rows.csv", lambda ds, p: ds.to_csv(str(p))),
    "json-lines": ("rows.json", lambda ds, p: ds.to_json(str(p))),
    "json-array": ("rows.json", lambda ds, p: ds.to_json(str(p), lines=False)),
    "json-gzip": ("rows.json.gz", _json_gz),
    "arrow": ("rows.arrow", _arrow_stream),
    "save_to_disk": ("saved", lambda ds, p: ds.save_to_disk(str(p))),
    "save_to_disk-dict": ("saved_dict", _saved_dict),
    "folder-of-files": ("folder", _folder_of_files),
}


def _write(kind: str, directory: Path, n: int = 7) -> Path:
    name, writer = WRITERS[kind]
    path = directory / name
    writer(datasets.Dataset.from_dict(_columns(n)), path)
    return path


@pytest.fixture(scope="module")
def parquet(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write("parquet", tmp_path_factory.mktemp("parquet"), n=5)


# ------------------------------------------------------------------- formats
@pytest.mark.parametrize("kind", list(WRITERS))
def test_every_local_format_gives_the_same_rows(kind: str, tmp_path: Path) -> None:
    path = _write(kind, tmp_path)
    source = make_prompt_source(_spec(path, shuffle=False), 0)
    assert isinstance(source, DatasetSource) and isinstance(source, RowSource)
    assert source.next_rows(14) == _expected() + _expected()
    if kind in ("folder-of-files", "save_to_disk-dict"):
        test = make_prompt_source(_spec(path, shuffle=False, split="test"), 0)
        assert test.next_rows(2) == _expected(1) * 2


def test_jsonl_is_read_without_datasets_and_matches(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    datasets.Dataset.from_dict(_columns()).to_json(str(path))
    source = make_prompt_source(_spec(path, shuffle=False), 0)
    assert isinstance(source, JsonlSource)
    assert source.next_rows(7) == _expected()


@pytest.mark.parametrize(
    ("kind", "split", "message"),
    [
        ("parquet", "test", r"rows\.parquet: cannot load the dataset: ValueError: Unknown split"),
        ("folder-of-files", "validation", r"Unknown split .*validation"),
        ("save_to_disk-dict", "validation", r"no split 'validation'; its splits: train, test"),
        ("save_to_disk", "test", "a single saved Dataset, without splits"),
    ],
)
def test_unknown_split(kind: str, split: str, message: str, tmp_path: Path) -> None:
    path = _write(kind, tmp_path)
    with pytest.raises(UserError, match=message) as info:
        make_prompt_source(_spec(path, split=split), 0)
    assert "\n" not in str(info.value)


def test_unreadable_sources(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(UserError, match=r"notes\.txt: not a data file ppokit reads"):
        make_prompt_source(DataSpec(source=str(tmp_path / "notes.txt")), 0)
    with pytest.raises(
        UserError, match=r"data file not found: .*; for a Hub dataset write hf:ab/cd"
    ):
        make_prompt_source(DataSpec(source="ab/cd"), 0)
    with pytest.raises(UserError, match=r"data file not found: .*nope\.parquet"):
        make_prompt_source(DataSpec(source=str(tmp_path / "nope.parquet")), 0)
    (tmp_path / "broken.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(UserError, match=r"broken\.parquet: cannot load the dataset") as info:
        make_prompt_source(DataSpec(source=str(tmp_path / "broken.parquet")), 0)
    assert "\n" not in str(info.value)
    features = datasets.Features({"prompt": datasets.Value("string")})
    empty = datasets.Dataset.from_dict({"prompt": []}, features=features)
    with pytest.raises(UserError, match=r"^empty: the data has no rows$"):
        DatasetSource(0, empty, fingerprint="0", label="empty")


# ---------------------------------------------------------------- column map
def test_column_map_renames_copies_and_keeps_other_columns(tmp_path: Path) -> None:
    path = tmp_path / "rows.parquet"
    datasets.Dataset.from_dict(
        {"prompt": ["old"], "question": ["new?"], "final": ["#### 4"], "extra": [1.5]}
    ).to_parquet(str(path))
    spec = DataSpec(
        source=str(path), columns={"prompt": "question", "gold": "final", "answer": "final"}
    )
    (row,) = make_prompt_source(spec, 0).next_rows(1)
    # the mapped 'prompt' replaces the column of that name; mapped columns leave their names
    assert row == {"prompt": "new?", "gold": "#### 4", "answer": "#### 4", "extra": 1.5}
    identity = make_prompt_source(DataSpec(source=str(path)), 0).next_rows(1)[0]
    assert identity == {"prompt": "old", "question": "new?", "final": "#### 4", "extra": 1.5}


@pytest.mark.parametrize(
    ("columns", "pattern", "message"),
    [
        ({}, None, r"no column 'prompt' \(map the prompt to a column with data\.columns"),
        ({"prompt": "query"}, None, r"no column 'query' \(data\.columns\.prompt\)"),
        ({"prompt": "question", "answer": "gold"}, None, r"'gold' \(data\.columns\.answer\)"),
        ({"prompt": "question"}, GSM8K, r"no column 'answer' \(map the answer"),
        ({"prompt": "question", "hint": "tip"}, None, r"'tip' \(data\.columns\.hint\)"),
    ],
)
def test_missing_column_names_it_and_the_columns_there_are(
    columns: dict[str, str], pattern: str | None, message: str, parquet: Path
) -> None:
    with pytest.raises(UserError, match=message) as info:
        make_prompt_source(
            DataSpec(source=str(parquet), columns=columns, answer_pattern=pattern), 0
        )
    text = str(info.value)
    assert text.startswith(f"{parquet}: the data has no column")
    assert text.endswith("its columns: question, final, level")
    assert "\n" not in text


# ----------------------------------------------------------- messages layout
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4"}],
    [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "What is 3 + 3?"},
        {"role": "assistant", "content": "6"},
    ],
    [{"role": "user", "content": "Only the question"}],
]


class FakeTokenizer:
    """A chat template of its own: ``<|role|>content`` lines, then ``<|assistant|>``."""

    chat_template = "fake"

    def apply_chat_template(
        self, messages: list[dict], tokenize: bool, add_generation_prompt: bool
    ) -> str:
        assert not tokenize and add_generation_prompt
        return "".join(f"<|{m['role']}|>{m['content']}\n" for m in messages) + "<|assistant|>"


@pytest.fixture
def messages_file(tmp_path: Path) -> Path:
    path = tmp_path / "chat.parquet"
    datasets.Dataset.from_dict({"messages": CONVERSATIONS, "answer": ["4", "6", "?"]}).to_parquet(
        str(path)
    )
    return path


def test_messages_layout(messages_file: Path) -> None:
    spec = DataSpec(source=str(messages_file), columns={"prompt": "messages"}, shuffle=False)
    rows = make_prompt_source(spec, 0).next_rows(3)
    assert [r["prompt"] for r in rows] == ["What is 2 + 2?", "What is 3 + 3?", "Only the question"]
    assert rows[0]["messages"] == CONVERSATIONS[0][:1]
    assert rows[1]["messages"] == CONVERSATIONS[1][:4]  # up to and including the last user's
    assert rows[2]["messages"] == CONVERSATIONS[2]
    assert [r["answer"] for r in rows] == ["4", "6", "?"]

    tok = FakeTokenizer()
    plain = format_prompts(rows, tok, DataSpec(chat_template=False))
    assert plain == ["What is 2 + 2?", "What is 3 + 3?", "Only the question"]
    chat = format_prompts(rows, tok, DataSpec(chat_template=True, system_prompt="Show work."))
    assert chat[0] == "<|system|>Show work.\n<|user|>What is 2 + 2?\n<|assistant|>"
    assert chat[1] == (  # the conversation's own system message, no second one
        "<|system|>Be terse.\n<|user|>Hi\n<|assistant|>Hello\n<|user|>What is 3 + 3?\n<|assistant|>"
    )
    assert format_prompts(rows[2:], tok, DataSpec(chat_template=True)) == [
        "<|user|>Only the question\n<|assistant|>"
    ]


def test_a_messages_column_beside_a_text_prompt_is_not_the_chat(tmp_path: Path) -> None:
    """A published transcript (ending with the assistant's answer) is a field, not the chat."""
    path = tmp_path / "both.parquet"
    datasets.Dataset.from_dict(
        {"problem": ["What is 2 + 2?"], "messages": CONVERSATIONS[:1]}
    ).to_parquet(str(path))
    (row,) = make_prompt_source(
        DataSpec(source=str(path), columns={"prompt": "problem"}), 0
    ).next_rows(1)
    assert row["messages"] == CONVERSATIONS[0]
    assert chat_messages(row) == [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.mark.parametrize(
    ("conversation", "message"),
    [
        ([{"role": "assistant", "content": "x"}], r"row 1: the chat messages in 'messages' have no user message"),
        ([{"role": "user", "content": None}], r"row 1: the last user message in 'messages' has no text"),
        ([{"content": "no role"}], r"row 1: 'messages' holds a list whose item 0 is not a chat message"),
    ],
)  # fmt: skip
def test_bad_messages_name_the_row(conversation: list[dict], message: str, tmp_path: Path) -> None:
    path = tmp_path / "chat.json"
    rows = [{"messages": CONVERSATIONS[0]}, {"messages": conversation}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(UserError, match=message) as info:
        make_prompt_source(DataSpec(source=str(path), columns={"prompt": "messages"}), 0)
    assert "\n" not in str(info.value)


def test_prompt_of_another_type_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "numbers.parquet"
    datasets.Dataset.from_dict({"prompt": [1, 2]}).to_parquet(str(path))
    with pytest.raises(UserError, match=r"row 0: 'prompt' must be a string or a list of chat"):
        make_prompt_source(DataSpec(source=str(path)), 0)


# ------------------------------------------------------------ answer_pattern
def test_answer_pattern_extracts_the_gold_answer(tmp_path: Path) -> None:
    path = tmp_path / "gsm.csv"
    datasets.Dataset.from_dict(
        {
            "question": ["a", "b", "c"],
            "answer": ["2 + 2 = <<2+2=4>>4\n#### 4", "so\n####   -1,200 \n", "#### 7"],
            "number": [10, 20, 30],
        }
    ).to_csv(str(path))
    spec = DataSpec(source=str(path), columns={"prompt": "question"}, answer_pattern=GSM8K)
    rows = make_prompt_source(spec.model_copy(update={"shuffle": False}), 0).next_rows(3)
    assert [r["answer"] for r in rows] == ["4", "-1,200", "7"]
    numeric = DataSpec(
        source=str(path), columns={"prompt": "question", "answer": "number"}, answer_pattern=r"(\d)"
    )
    assert make_prompt_source(numeric, 0).next_rows(3)  # a number is matched as its text


def test_answer_pattern_that_does_not_match_names_the_row(tmp_path: Path) -> None:
    path = tmp_path / "gsm.parquet"
    answers = ["#### 1", "#### 2", "the answer is 3", "#### 4"]
    datasets.Dataset.from_dict({"prompt": list("abcd"), "answer": answers}).to_parquet(str(path))
    with pytest.raises(UserError) as info:
        make_prompt_source(DataSpec(source=str(path), answer_pattern=GSM8K), 0)
    text = str(info.value)
    assert text.startswith(f"{path}: row 2: data.answer_pattern")
    assert "'the answer is 3'" in text and "\n" not in text
    missing = tmp_path / "none.parquet"
    datasets.Dataset.from_dict({"prompt": ["a"], "answer": [None]}).to_parquet(str(missing))
    with pytest.raises(
        UserError, match=r"row 0: data\.answer_pattern .* does not match the answer None"
    ):
        make_prompt_source(DataSpec(source=str(missing), answer_pattern=GSM8K), 0)


# ------------------------------------------------------- determinism, resume
def test_same_seed_same_rows_other_seed_other_order(parquet: Path) -> None:
    a = make_prompt_source(_spec(parquet), 3).next_rows(15)
    assert a == make_prompt_source(_spec(parquet), 3).next_rows(15)
    assert a != make_prompt_source(_spec(parquet), 4).next_rows(15)
    key = lambda r: r["prompt"]  # noqa: E731
    for epoch in range(3):
        assert sorted(a[5 * epoch : 5 * epoch + 5], key=key) == sorted(_expected(5), key=key)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32),
    shuffle=st.booleans(),
    chunks=st.lists(st.integers(0, 9), min_size=1, max_size=6),
    split=st.integers(0, 6),
)
def test_resume_draws_the_same_rows(
    parquet: Path, seed: int, shuffle: bool, chunks: list[int], split: int
) -> None:
    spec = _spec(parquet, shuffle=shuffle)
    drawn = make_prompt_source(spec, seed)
    expected = [drawn.next_rows(n) for n in chunks]
    whole = make_prompt_source(spec, seed).next_rows(sum(chunks))
    assert [r for chunk in expected for r in chunk] == whole  # chunking changes nothing
    assert_resumes(spec, seed, chunks, split)


def test_state_names_the_source_and_the_data(parquet: Path, tmp_path: Path) -> None:
    state = make_prompt_source(_spec(parquet), 0).state_dict()
    assert state["source"] == "dataset" and len(state["fingerprint"]) == 16
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text(json.dumps({"prompt": "p"}) + "\n")
    with pytest.raises(UserError, match="prompt source is 'jsonl', the spec's is 'dataset'"):
        make_prompt_source(_spec(parquet), 0).load_state_dict(
            make_prompt_source(DataSpec(source=str(jsonl)), 0).state_dict()
        )


@pytest.mark.parametrize("kind", ["parquet", "save_to_disk", "folder-of-files"])
def test_changed_data_is_rejected_on_resume(kind: str, tmp_path: Path) -> None:
    path = _write(kind, tmp_path)
    state = make_prompt_source(_spec(path), 0).state_dict()
    assert make_prompt_source(_spec(path), 0).state_dict() == state  # same files, same state
    changed = tmp_path / "changed"
    changed.mkdir()
    written = _write(kind, changed, n=8)
    path.rename(tmp_path / "old")
    written.rename(path)
    with pytest.raises(UserError, match="the data changed since the checkpoint"):
        make_prompt_source(_spec(path), 0).load_state_dict(state)


# ----------------------------------------------------------------- the Hub
def test_hub_dataset_reads_name_config_split_and_fingerprint(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ds = datasets.Dataset.from_dict(_columns(4))
    calls = []

    def load_dataset(*args: Any, **kwargs: Any) -> Any:
        calls.append((args, kwargs))
        return ds

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    spec = _spec("hf:someone/gsm", config="main", split="train[:4]", shuffle=False)
    source = make_prompt_source(spec, 0)
    assert calls == [(("someone/gsm", "main"), {"split": "train[:4]"})]
    assert source.next_rows(4) == _expected(4)
    assert source.state_dict()["fingerprint"] == ds._fingerprint
    assert source.label == "hf:someone/gsm (main, train[:4])"


def test_hub_dataset_offline_is_a_one_line_error(tmp_path: Path) -> None:
    """In a fresh process with the Hub switched off, as a user offline would run it."""
    script = textwrap.dedent(
        """
        import sys
        from ppokit.data import make_prompt_source
        from ppokit.errors import UserError
        from ppokit.spec import DataSpec
        try:
            make_prompt_source(DataSpec(source="hf:nobody/nothing", config="main"), 0)
        except UserError as exc:
            print(exc)
            sys.exit(3)
        """
    )
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HOME": str(tmp_path / "hf"),
        "HF_DATASETS_CACHE": str(tmp_path / "hf" / "datasets"),
    }
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 3, result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1, result.stdout
    assert lines[0].startswith("hf:nobody/nothing (main, train): cannot load the dataset:")
    assert "Traceback" not in result.stdout + result.stderr


# ------------------------------------------------------- missing ``datasets``
def test_missing_datasets_package_is_a_one_line_error_naming_the_extra(
    parquet: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)
    for source in (str(parquet), "hf:someone/gsm", str(tmp_path)):
        with pytest.raises(MissingDependency) as info:
            make_prompt_source(DataSpec(source=source), 0)
        text = str(info.value)
        assert text == f"data.source {source!r} needs the 'datasets' package: " + (
            "pip install 'ppokit[data]'"
        )
    jsonl = tmp_path / "rows.jsonl"  # the JSONL reader needs no datasets
    jsonl.write_text(json.dumps({"question": "q", "answer": "#### 1"}) + "\n")
    spec = DataSpec(source=str(jsonl), columns={"prompt": "question"}, answer_pattern=GSM8K)
    assert make_prompt_source(spec, 0).next_rows(1) == [{"prompt": "q", "answer": "1"}]


# ----------------------------------------------------------- example files
def _make_examples() -> Any:
    spec = importlib.util.spec_from_file_location("make_examples", EXAMPLES / "make_examples.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_files_are_what_the_generator_makes() -> None:
    import pyarrow.parquet as pq

    tables = _make_examples().tables()
    assert set(tables) == {p.name for p in EXAMPLES.glob("*.parquet")}
    for name, table in tables.items():
        path = EXAMPLES / name
        assert path.stat().st_size < 32_000, name
        assert pq.read_table(path).equals(table), f"{name}: run examples/data/make_examples.py"
    sizes = {name: t.num_rows for name, t in tables.items()}
    assert sizes["gsm8k_style.parquet"] == 400 and sizes["gsm8k_style_test.parquet"] == 200
    assert sizes["math_style_test.parquet"] >= 200
    for stem, column in (("gsm8k_style", "question"), ("math_style", "messages")):
        train = tables[f"{stem}.parquet"].column(column).to_pylist()
        test = tables[f"{stem}_test.parquet"].column(column).to_pylist()
        assert not {json.dumps(x) for x in train} & {json.dumps(x) for x in test}, stem


def _calculations_are_right(solution: str) -> str:
    """The final answer of a GSM8K solution, after checking each <<expression=value>>."""
    for expression, value in re.findall(r"<<([^=>]+)=([^>]+)>>", solution):
        assert re.fullmatch(r"[\d+\-*/ ]+", expression)
        assert eval(expression, {"__builtins__": {}}) == int(value), solution
    return solution.rsplit("####", 1)[1].strip()


@pytest.mark.parametrize("name", ["gsm8k_style.parquet", "gsm8k_style_test.parquet"])
def test_gsm8k_style_examples_load_with_the_example_spec(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pyarrow.parquet as pq

    monkeypatch.chdir(ROOT)  # the spec's data path is relative to the project root
    spec = load_spec(EXAMPLE_SPEC)
    data = spec.data.model_copy(update={"source": f"examples/data/{name}", "shuffle": False})
    source = make_prompt_source(data, spec.seed)
    assert isinstance(source, DatasetSource)
    raw = pq.read_table(EXAMPLES / name).to_pylist()
    rows = source.next_rows(len(raw))
    for row, original in zip(rows, raw, strict=True):
        assert row == {"prompt": original["question"], "answer": row["answer"]}
        assert row["answer"] == _calculations_are_right(original["answer"])
        assert re.fullmatch(r"\d+", row["answer"])
    assert make_prompt_source(spec.data, spec.seed).size == 400  # the spec's own file


def test_example_answers_pass_math_verify(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("math_verify")
    from ppokit.registry import get_registry

    reward = get_registry().create("reward", "math_verify")
    monkeypatch.chdir(ROOT)
    spec = load_spec(EXAMPLE_SPEC)
    sources = [
        make_prompt_source(spec.data, 0),
        make_prompt_source(
            DataSpec(source="examples/data/math_style.parquet", columns={"prompt": "messages"}), 0
        ),
    ]
    for source in sources:
        rows = source.next_rows(16)
        answers = [r["answer"] for r in rows]
        if source is sources[1]:  # LaTeX answers: math_verify reads bare 8\sqrt{10} as 8
            answers = [f"${a}$" for a in answers]
        prompts = [r["prompt"] for r in rows]
        right = [f"So the answer is $\\boxed{{{a}}}$." for a in answers]
        assert reward(prompts, right, answer=answers).tolist() == [1.0] * len(rows)
        wrong = ["So the answer is $\\boxed{123457}$."] * len(rows)
        assert reward(prompts, wrong, answer=answers).tolist() == [0.0] * len(rows)


def test_math_style_example_is_in_the_messages_layout() -> None:
    source = make_prompt_source(
        DataSpec(source=str(EXAMPLES / "math_style.parquet"), columns={"prompt": "messages"}), 0
    )
    for row in source.next_rows(source.size):
        assert set(row) == {"prompt", "messages", "answer", "type"}
        assert row["messages"] == [{"role": "user", "content": row["prompt"]}]
        text = format_prompts(
            [row], FakeTokenizer(), DataSpec(chat_template=True, system_prompt="S")
        )
        assert text == [f"<|system|>S\n<|user|>{row['prompt']}\n<|assistant|>"]
