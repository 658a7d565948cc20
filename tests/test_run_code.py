"""A run folder names no code that runs: ``ppokit eval RUN`` and ``ppokit export RUN`` read
the run's spec, and a spec (with a manifest sealed again to match) that sets
``model.trust_remote_code`` with ``model.actor`` pointing at Python inside the folder is
refused with one line naming ``--trust-remote-code``; the proof file the folder's code would
write never appears. With the flag (the user's own word) the code is run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from ppokit.cli import app
from ppokit.runfolder import CHECKPOINT
from ppokit.trainer import train
from tests.helpers import one_error_line
from tests.helpers.trainer import reseal_manifest, small_spec

ROOT = Path(__file__).resolve().parents[1]
PROOF_CODE = """
from pathlib import Path
Path({proof!r}).write_text("the run folder's code ran")
from transformers import PretrainedConfig
class ProofConfig(PretrainedConfig):
    model_type = "proof"
"""


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("trained") / "run"
    train(small_spec(out, "train.rounds=1", "output.save_every=1"))
    return out


def hostile(trained: Path, root: Path, trust: bool = True) -> tuple[Path, Path]:
    """A copy of the run whose checkpoint's spec points ``model.actor`` at a model folder
    inside the run that ships Python writing a proof file; the manifest sealed to match."""
    run = root / "run"
    shutil.copytree(trained, run)
    proof = root / "proof.txt"
    model = run / "model"
    model.mkdir()
    (model / "proof.py").write_text(PROOF_CODE.format(proof=str(proof)))
    config = {"model_type": "proof", "auto_map": {"AutoConfig": "proof.ProofConfig"}}
    (model / "config.json").write_text(json.dumps(config))
    for spec_file in (run / CHECKPOINT / "spec.yaml", run / "spec.yaml"):
        data = yaml.safe_load(spec_file.read_text())
        data["model"]["actor"] = str(model)
        data["model"]["trust_remote_code"] = trust
        spec_file.write_text(yaml.safe_dump(data))
    reseal_manifest(run / CHECKPOINT)
    return run, proof


@pytest.mark.parametrize("command", ["eval", "export"])
def test_a_run_spec_asking_for_remote_code_is_refused(
    trained: Path, tmp_path: Path, command: str
) -> None:
    run, proof = hostile(trained, tmp_path)
    args = [command, str(run)] + ([str(tmp_path / "exported")] if command == "export" else [])
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 1
    line = one_error_line(result.stderr)
    assert "model.trust_remote_code" in line and "--trust-remote-code" in line
    assert not proof.exists()
    assert not (tmp_path / "exported").exists()


@pytest.mark.parametrize("command", ["eval", "export"])
def test_a_model_folder_with_code_is_not_run_without_trust(
    trained: Path, tmp_path: Path, command: str
) -> None:
    """trust_remote_code false in the spec: the model folder's code is data, never run."""
    run, proof = hostile(trained, tmp_path, trust=False)
    args = [command, str(run)] + ([str(tmp_path / "exported")] if command == "export" else [])
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 1
    assert "ships its own Python code" in one_error_line(result.stderr)
    assert not proof.exists()


@pytest.mark.parametrize("command", ["eval", "export"])
def test_the_flag_is_the_users_word(trained: Path, tmp_path: Path, command: str) -> None:
    """With --trust-remote-code the folder's code runs (the proof appears): the flag is
    what gates it, not some other failure."""
    run, proof = hostile(trained, tmp_path)
    args = [command, str(run)] + ([str(tmp_path / "exported")] if command == "export" else [])
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1"}
    subprocess.run(
        [sys.executable, "-m", "ppokit", *args, "--trust-remote-code"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        timeout=300,
    )
    assert proof.read_text() == "the run folder's code ran"
