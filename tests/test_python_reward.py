"""A reward as a plain Python function (``reward: {name: python, function: FILE.py:fn}``
or ``package.module:fn``): called like a reward component, its return value checked at
the same boundary, every mistake one line. Validating a spec imports nothing; a run
folder's spec that names such a function is refused by ``ppokit eval RUN`` and ``ppokit
export RUN`` without ``--trust-remote-code``, and the proof file its code would write never
appears."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from ppokit.cli import app
from ppokit.components.reward.impl import PythonReward, load_function
from ppokit.errors import ComponentError, UserError
from ppokit.runfolder import CHECKPOINT, read_run_spec
from ppokit.spec import SpecError
from ppokit.trainer import train
from tests.helpers import one_error_line
from tests.helpers.trainer import reseal_manifest, small_spec

PROOF = """
from pathlib import Path
Path({proof!r}).write_text("the function's file ran")

def reward(prompts, responses, **fields):
    return [0.5] * len(responses)
"""


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_a_file_function_gets_only_the_fields_it_names(tmp_path: Path) -> None:
    write(
        tmp_path / "mine.py",
        "def reward(prompts, responses, answer):\n"
        "    return [float(r == a) for r, a in zip(responses, answer)]\n",
    )
    fn = PythonReward(function=f"{tmp_path / 'mine.py'}:reward")
    scores = fn(["p", "q"], ["4", "5"], answer=["4", "6"], lengths=[1, 1], truncated=[0, 0])
    assert scores == [1.0, 0.0]


def test_a_function_with_kwargs_gets_every_field(tmp_path: Path) -> None:
    write(tmp_path / "kw.py", "def reward(prompts, responses, **f):\n    return sorted(f)\n")
    fn = PythonReward(function=f"{tmp_path / 'kw.py'}:reward")
    assert fn([], [], answer=[], lengths=[]) == ["answer", "lengths"]


def test_a_trl_reward_function_is_called_by_keyword(tmp_path: Path) -> None:
    """TRL calls reward_funcs as f(prompts=..., completions=..., **columns)."""
    write(
        tmp_path / "trl_style.py",
        "def correct(completions, answer, **kwargs):\n"
        "    return [float(c == a) for c, a in zip(completions, answer)]\n"
        "def short(completions):\n"
        "    return [-len(c) for c in completions]\n",
    )
    fn = PythonReward(function=f"{tmp_path / 'trl_style.py'}:correct")
    assert fn(["p", "q"], ["4", "5"], answer=["4", "6"], lengths=[1, 1]) == [1.0, 0.0]
    fn = PythonReward(function=f"{tmp_path / 'trl_style.py'}:short")
    assert fn(["p"], ["abc"], answer=["x"]) == [-3]


def test_a_module_function(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "myrewards"
    package.mkdir()
    write(package / "__init__.py", "")
    write(
        package / "scores.py", "def length(prompts, responses):\n    return [1.0]*len(responses)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_function("myrewards.scores:length")([], ["a", "b"]) == [1.0, 1.0]


@pytest.mark.parametrize(
    ("body", "reference", "expected"),
    [
        (None, "missing.py:reward", "file not found: missing.py"),
        ("x = 1\n", "FILE:reward", "has no 'reward'"),
        ("reward = 3\n", "FILE:reward", "is a int, not a function"),
        ("raise RuntimeError('boom')\n", "FILE:reward", "raised RuntimeError: boom"),
        (None, "no_such_module_xyz:reward", "cannot import no_such_module_xyz"),
    ],
)
def test_each_mistake_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str | None, reference: str, expected: str
) -> None:
    monkeypatch.chdir(tmp_path)
    if body is not None:
        write(tmp_path / "bad.py", body)
    with pytest.raises(UserError) as info:
        load_function(reference.replace("FILE", "bad.py"))
    assert expected in str(info.value) and "\n" not in str(info.value)


def test_validating_a_spec_checks_the_form_and_runs_nothing(tmp_path: Path) -> None:
    proof = tmp_path / "proof.txt"
    code = write(tmp_path / "code.py", PROOF.format(proof=str(proof)))
    spec = small_spec(tmp_path / "run", f"reward={{name: python, function: '{code}:reward'}}")
    assert spec.reward[0].name == "python"
    assert not proof.exists()
    with pytest.raises(SpecError) as info:
        small_spec(tmp_path / "run", "reward={name: python, function: 'not a reference'}")
    assert "reward.function" in str(info.value)


def test_a_run_trains_on_the_function_and_its_scores_are_checked(tmp_path: Path) -> None:
    proof = tmp_path / "proof.txt"
    code = write(tmp_path / "code.py", PROOF.format(proof=str(proof)))
    ref = f"reward={{name: python, function: '{code}:reward'}}"
    result = train(small_spec(tmp_path / "run", "train.rounds=1", ref))
    assert result["reward_first"] == pytest.approx(0.5)
    assert proof.exists()  # the spec's own author ran it: the code ran
    write(tmp_path / "short.py", "def reward(prompts, responses):\n    return [1.0]\n")
    short = f"reward={{name: python, function: '{tmp_path / 'short.py'}:reward'}}"
    with pytest.raises(ComponentError) as info:
        train(small_spec(tmp_path / "run2", "train.rounds=1", short))
    assert "1 scores for" in str(info.value) and "python" in str(info.value)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("trained") / "run"
    train(small_spec(out, "train.rounds=1", "output.save_every=1"))
    return out


def hostile(trained: Path, root: Path) -> tuple[Path, Path]:
    """A copy of the run whose spec names a python reward in a file that writes a proof
    file when imported; the checkpoint's manifest sealed again to match."""
    run = root / "run"
    shutil.copytree(trained, run)
    proof = root / "proof.txt"
    code = write(run / "reward.py", PROOF.format(proof=str(proof)))
    for spec_file in (run / CHECKPOINT / "spec.yaml", run / "spec.yaml"):
        data = yaml.safe_load(spec_file.read_text())
        data["reward"] = [{"name": "python", "function": f"{code}:reward", "weight": 1.0}]
        spec_file.write_text(yaml.safe_dump(data))
    reseal_manifest(run / CHECKPOINT)
    return run, proof


@pytest.mark.parametrize("command", ["eval", "export"])
def test_a_run_folder_naming_a_function_is_refused(
    trained: Path, tmp_path: Path, command: str
) -> None:
    run, proof = hostile(trained, tmp_path)
    args = [command, str(run)] + ([str(tmp_path / "exported")] if command == "export" else [])
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 1
    line = one_error_line(result.stderr)
    assert "python reward function" in line and "--trust-remote-code" in line
    assert not proof.exists()
    assert "ppokit_reward_reward" not in " ".join(sys.modules)


def test_the_flag_lets_the_folder_spec_through(trained: Path, tmp_path: Path) -> None:
    run, proof = hostile(trained, tmp_path)
    data = read_run_spec(run, trust_remote_code=True)
    assert data["reward"][0]["name"] == "python"
    assert not proof.exists()  # reading is not running: creating the reward would be


def test_the_trl_verl_page_spec_validates_and_its_functions_score(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/from-trl-verl.md: its ppokit spec is valid and its reward functions run."""
    import re

    from ppokit.spec import validate_spec

    page = (Path(__file__).resolve().parents[1] / "docs" / "from-trl-verl.md").read_text()
    spec = re.search(r"```yaml\n(model: \{actor: .*?)```", page, re.S)
    code = re.search(r"```python\n(# rewards\.py\n.*?)```", page, re.S)
    assert spec is not None and code is not None
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "rewards.py", code.group(1))
    parsed = validate_spec(yaml.safe_load(spec.group(1)))
    assert parsed.reward[0].name == "python" and parsed.train.lr_schedule == "cosine"
    for name in ("correct", "trl_style"):
        fn = PythonReward(function=f"rewards.py:{name}")
        assert fn(["1+3?", "2+2?"], ["= 4", "5"], answer=[4, 4], lengths=[2, 1]) == [1.0, 0.0]
