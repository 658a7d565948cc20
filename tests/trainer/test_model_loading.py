"""Local model directories: the code a directory ships (an ``auto_map`` in its config) never
runs unless ``model.trust_remote_code`` is set; nothing is downloaded from a hub."""

from __future__ import annotations

import json
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ppokit.errors import UserError
from ppokit.trainer.models import build_models, load_actor, tiny_model
from ppokit.trainer.tokenizer import char_tokenizer
from tests.helpers.trainer import small_spec

TINY = {"hidden_size": 32, "intermediate_size": 64}

CUSTOM_CODE = """
from pathlib import Path

from transformers import LlamaConfig, LlamaForCausalLM, LlamaModel

Path({proof!r}).write_text("the directory's code ran")


class CustomConfig(LlamaConfig):
    model_type = "ppokit-custom"


class CustomModel(LlamaModel):
    config_class = CustomConfig


class CustomForCausalLM(LlamaForCausalLM):
    config_class = CustomConfig
"""


@pytest.fixture(autouse=True)
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any attempt to reach a hub (or anything else) fails the test; so does a prompt."""

    def refuse(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError(f"network access attempted: {args[1:2]}")

    def no_prompt(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("transformers asked on the terminal")

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr("builtins.input", no_prompt)


@pytest.fixture
def modules_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """transformers copies trusted code into a cache of modules: keep it under tmp_path."""
    import transformers.dynamic_module_utils as dmu

    cache = tmp_path / "hf_modules"
    cache.mkdir()
    monkeypatch.setattr(dmu, "HF_MODULES_CACHE", str(cache))
    monkeypatch.syspath_prepend(str(cache))
    yield cache
    for name in [m for m in sys.modules if m.startswith("transformers_modules")]:
        del sys.modules[name]


def _save_tiny(folder: Path) -> Path:
    tokenizer = char_tokenizer()
    tiny_model(tokenizer, TINY, 0).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _ship_code(folder: Path, proof: Path) -> Path:
    """Make ``folder`` a model whose config maps its classes to the directory's own code."""
    (folder / "custom_code.py").write_text(CUSTOM_CODE.format(proof=str(proof)))
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "ppokit-custom"
    config["architectures"] = ["CustomForCausalLM"]
    config["auto_map"] = {
        "AutoConfig": "custom_code.CustomConfig",
        "AutoModel": "custom_code.CustomModel",
        "AutoModelForCausalLM": "custom_code.CustomForCausalLM",
    }
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture
def plain(tmp_path: Path) -> Path:
    return _save_tiny(tmp_path / "plain")


@pytest.fixture
def custom(tmp_path: Path) -> Path:
    return _ship_code(_save_tiny(tmp_path / "custom"), tmp_path / "proof")


def test_a_plain_local_directory_loads(plain: Path) -> None:
    tokenizer, model = load_actor(str(plain), {}, 0)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert tokenizer.padding_side == "left" and tokenizer.pad_token_id is not None


def test_code_shipped_by_a_directory_is_refused_by_default(custom: Path, tmp_path: Path) -> None:
    with pytest.raises(UserError) as info:
        load_actor(str(custom), {}, 0)
    message = str(info.value)
    assert "\n" not in message
    assert "model.trust_remote_code: true" in message and str(custom) in message
    assert not (tmp_path / "proof").exists()


def test_build_models_refuses_the_actor_and_the_critic_init(custom: Path, tmp_path: Path) -> None:
    for override in (f"model.actor={custom}", f"model.critic_init={custom}"):
        spec = small_spec(tmp_path / "out", override)
        assert spec.model.trust_remote_code is False
        with pytest.raises(UserError, match=r"model\.trust_remote_code: true"):
            build_models(spec, 1)
    assert not (tmp_path / "proof").exists()


@pytest.mark.usefixtures("modules_cache")
def test_the_code_runs_when_trusted(custom: Path, tmp_path: Path) -> None:
    spec = small_spec(
        tmp_path / "out",
        f"model.actor={custom}",
        f"model.critic_init={custom}",
        "model.trust_remote_code=true",
    )
    models = build_models(spec, 1)
    assert type(models.actor).__name__ == "CustomForCausalLM"
    assert models.critic is not None and type(models.critic.trunk).__name__ == "CustomModel"
    assert (tmp_path / "proof").exists()


def test_a_missing_directory_is_never_looked_up_on_a_hub(tmp_path: Path) -> None:
    for override in ("model.actor=someone/some-model", "model.critic_init=someone/some-model"):
        spec = small_spec(tmp_path / "out", override)
        with pytest.raises(UserError, match="local Hugging Face model directory"):
            build_models(spec, 1)
