"""Bounds before work: an observation, a reset text or a prompt is cut by characters before
it is tokenized (a megabyte of tool output is never tokenized whole), text UTF-8 cannot
encode is replaced, the calculator answers an overflow with an error observation, a data
file that never ends is refused without being read, a deeply nested JSON line and a BOM are
handled, and an engine's output is checked where it crosses into the trainer."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ppokit.components.environment.impl import Calculator, evaluate
from ppokit.components.rollout_engine import Generation, Sampling
from ppokit.data import JsonlSource, make_prompt_source
from ppokit.errors import ComponentError, UserError
from ppokit.spec import DataSpec
from ppokit.trainer.contract import EngineLimits, Where, check_generation
from ppokit.trainer.episodes import ObservationFormat
from ppokit.trainer.prompts import TextBounds, encodable
from tests.helpers.trainer import learner, small_spec


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return learner(small_spec(None)).setup.models.tokenizer


class Counting:
    """A tokenizer that records the longest text it was given."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.longest = 0

    def __call__(self, texts: Any, **kwargs: Any) -> Any:
        batch = [texts] if isinstance(texts, str) else texts
        self.longest = max([self.longest, *(len(t) for t in batch)])
        return self.tokenizer(texts, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tokenizer, name)

    def __len__(self) -> int:
        return len(self.tokenizer)


def test_a_megabyte_observation_is_cut_before_it_is_tokenized(tokenizer) -> None:
    counting = Counting(tokenizer)
    fmt = ObservationFormat(counting, chat=False, role="user", max_tokens=16)
    (ids,) = fmt(["ab" * 500_000], [False])
    assert ids == tokenizer("ab" * 500_000, add_special_tokens=False)["input_ids"][:16]
    assert counting.longest <= 17 * TextBounds(tokenizer).chars


@settings(max_examples=40, deadline=None)
@given(st.text(alphabet="ab cd\n!é", max_size=400), st.integers(1, 30))
def test_the_cut_keeps_the_tokens_kept(tokenizer, text: str, tokens: int) -> None:
    bounds = TextBounds(tokenizer)
    whole = tokenizer(text, add_special_tokens=False)["input_ids"]
    head = tokenizer(bounds.head(text, tokens), add_special_tokens=False)["input_ids"]
    tail = tokenizer(bounds.tail(text, tokens), add_special_tokens=False)["input_ids"]
    assert head[:tokens] == whole[:tokens]
    assert tail[-tokens:] == whole[-tokens:]


def test_a_prompt_is_cut_to_what_the_context_can_hold(tmp_path: Path) -> None:
    lrn = learner(small_spec(tmp_path))
    counting = Counting(lrn.setup.models.tokenizer)
    lrn.setup.encode.tokenizer = counting
    data = lrn.setup.spec.data
    with pytest.raises(UserError, match="does not fit the model's context"):
        lrn.setup.encode(["a" * 1_000_000], data, 4)
    limit = lrn.setup.encode.limit
    assert counting.longest <= (limit + 1) * TextBounds(lrn.setup.models.tokenizer).chars
    cut = data.model_copy(update={"long_prompts": "truncate"})
    with pytest.warns(UserWarning, match="are cut"):
        ids, _ = lrn.setup.encode(["b" + "a" * 1_000_000], cut, 4)
    assert ids.shape[1] == limit - 4


def test_text_utf8_cannot_encode_is_replaced(tokenizer) -> None:
    assert encodable("a\ud800b\udfff") == "a\ufffdb\ufffd"
    fmt = ObservationFormat(tokenizer, chat=False, role="user", max_tokens=16)
    (ids,) = fmt(["file \udcff name"], [False])  # a lone surrogate, as os.fsdecode makes
    assert ids == tokenizer("file \ufffd name", add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize(
    "expression", ["1e999", "-1e999*0", "1e308*1e308", "-" * 9999 + "1", "2**64**64", "9" * 5000]
)
def test_the_calculator_answers_an_overflow_with_an_error(expression: str) -> None:
    calc = Calculator(open="<calc>", close="</calc>", max_length=10_000, open_first=False)
    step = calc.step({}, f"<calc>{expression}</calc>", 0)
    assert step.observation is not None and step.observation.startswith("Error: ")
    with pytest.raises(ValueError):
        evaluate(expression)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs")
def test_a_data_file_that_never_ends_is_refused_unread(tmp_path: Path) -> None:
    zero = tmp_path / "zero.jsonl"
    zero.symlink_to("/dev/zero")
    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)  # opened without a writer: a plain open() would wait forever
    pipe = tmp_path / "pipe.parquet"
    os.mkfifo(pipe)
    for path in (zero, fifo, pipe):
        with pytest.raises(UserError, match="not a regular file"):
            make_prompt_source(DataSpec(source=str(path)), 0)


def test_a_large_jsonl_is_refused_without_reading_it_whole(tmp_path: Path) -> None:
    from ppokit.data import read_data_file

    path = tmp_path / "big.jsonl"
    path.write_text('{"prompt": "p"}\n' * 100)
    with pytest.raises(UserError, match="larger than 0 MiB"):
        read_data_file(path, limit=1000)


def test_nesting_and_a_bom(tmp_path: Path) -> None:
    deep = tmp_path / "deep.jsonl"
    deep.write_text('{"prompt": "p", "x": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    with pytest.raises(UserError, match=r"deep\.jsonl:1: the JSON nests too deeply"):
        JsonlSource(0, deep)
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b'\xef\xbb\xbf{"prompt": "p"}\n')
    assert JsonlSource(0, bom).row(0) == {"prompt": "p"}


# ---------------------------------------------------------------------- engine output
def _generation(**changes: Any) -> Generation:
    fields: dict[str, Any] = {
        "response_ids": torch.tensor([[3, 4, 0], [5, 0, 0]]),
        "response_mask": torch.tensor([[True, True, False], [True, False, False]]),
        "truncated": torch.tensor([False, False]),
        "logp": torch.tensor([[-0.5, -1.0, 0.0], [-2.0, 0.0, 0.0]]),
    }
    fields.update(changes)
    return Generation(**fields)


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        ({"response_ids": torch.tensor([[3, 4, 0], [5, 100, 0]])}, "outside the vocabulary of 10"),
        ({"response_ids": torch.tensor([[3, -1, 0], [5, 0, 0]])}, "outside the vocabulary"),
        ({"response_ids": torch.tensor([[3, 4, 0], [5, 0, 0]], dtype=torch.int32)}, "int64"),
        ({"logp": torch.tensor([[-0.5, 5.0, 0.0], [-2.0, 0.0, 0.0]])}, "logp above 0"),
        ({"logp": torch.tensor([[-0.5, float("nan"), 0], [-2.0, 0, 0]])}, "NaN or infinite"),
        (
            {"response_mask": torch.tensor([[True, False, True], [True, False, False]])},
            "tokens after a row's padding",
        ),
        (
            {"response_mask": torch.tensor([[True, True, False], [False, False, False]])},
            "a row without any token",
        ),
        (
            {
                "response_ids": torch.zeros(2, 0, dtype=torch.long),
                "response_mask": torch.zeros(2, 0, dtype=torch.bool),
                "logp": torch.zeros(2, 0),
            },
            "responses of no position",
        ),
        (
            {
                "response_ids": torch.zeros(2, 9, dtype=torch.long),
                "response_mask": torch.ones(2, 9, dtype=torch.bool),
                "logp": torch.zeros(2, 9),
            },
            "9 positions for max_new_tokens=4",
        ),
    ],
)
def test_an_engines_output_is_checked_where_it_crosses(changes: dict[str, Any], says: str) -> None:
    where = Where("rollout.engine", "odd", "test")
    prompts = torch.ones(2, 3, dtype=torch.long)
    limits = EngineLimits(vocab=10, context=16)
    sampling = Sampling(n=1, max_new_tokens=4)
    assert check_generation(where, _generation(), prompts, sampling, limits) is not None
    with pytest.raises(ComponentError) as info:
        check_generation(where, _generation(**changes), prompts, sampling, limits)
    assert str(info.value).startswith("rollout.engine (odd, plugin test) returned ")
    assert says in str(info.value)


def test_an_engines_output_past_the_context_is_refused() -> None:
    where = Where("rollout.engine", "odd", "test")
    with pytest.raises(ComponentError, match="past the model's context of 4"):
        check_generation(
            where,
            _generation(),
            torch.ones(2, 3, dtype=torch.long),
            Sampling(),
            EngineLimits(10, 4),
        )


# ---------------------------------------------------------------------- vLLM
def test_a_max_model_len_without_room_is_refused_when_validating() -> None:
    from ppokit.components.rollout_engine import VLLMParams, vllm_problems

    spec = small_spec(None, "rollout.max_new_tokens=64")
    lines = list(vllm_problems(spec, VLLMParams(max_model_len=64)))
    assert any(line.startswith("rollout.engine.max_model_len: 64 tokens leave") for line in lines)
    assert not any("max_model_len" in line for line in vllm_problems(spec, VLLMParams()))


def test_a_prompt_past_max_model_len_is_refused_not_cut() -> None:
    from ppokit.components.rollout_engine.vllm_impl import VLLMEngine

    engine = VLLMEngine.__new__(VLLMEngine)
    engine.max_len = 64
    engine._fits(60, 4)  # fits exactly
    with pytest.raises(UserError, match=r"max_model_len: a prompt of 61 tokens"):
        engine._fits(61, 4)


def test_a_kv_cache_too_small_names_the_setting() -> None:
    from ppokit.components.rollout_engine.vllm_impl import start_error

    vllm_says = ValueError(
        "To serve at least one request with the model's max seq len (8192), (0.5 GiB KV cache "
        "is needed, which is larger than the available KV cache memory (0.01 GiB). Try ..."
    )
    line = str(start_error(vllm_says, 0.01, 8192))
    assert line.startswith("rollout.engine.kv_cache_gb: vLLM's KV cache (0.01 GiB) cannot hold")
    assert "\n" not in line


def test_a_killed_runs_weights_copy_is_removed_at_the_next_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import subprocess
    import sys
    import tempfile

    from ppokit.components.rollout_engine import vllm_impl

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True
    )
    dead = int(gone.stdout)  # a process that has ended
    left = tmp_path / f"{vllm_impl.FOLDER_PREFIX}{dead}-abc"
    (left / "model").mkdir(parents=True)
    alive = tmp_path / f"{vllm_impl.FOLDER_PREFIX}{os.getppid()}-def"  # a running process's
    alive.mkdir()
    mine = vllm_impl.new_folder()
    assert not left.exists() and alive.exists()
    assert mine.parent == tmp_path and mine.name.startswith(
        f"{vllm_impl.FOLDER_PREFIX}{os.getpid()}-"
    )
