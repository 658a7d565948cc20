"""Every ``ppokit`` command through typer's CliRunner, the one-line user errors, and the
light import path of the data commands (a subprocess check of sys.modules)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import types
from importlib.metadata import version
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from typer.testing import CliRunner

from ppokit import __version__
from ppokit.cli import app
from ppokit.errors import UserError
from tests.helpers import ROOT, Plugin, Scaled, ScaleParams, invalid_specs, valid_specs

pytestmark = pytest.mark.usefixtures("clean_registry")

runner = CliRunner()
GRPO = str(ROOT / "tests" / "specs" / "valid" / "grpo.yaml")
PPO = str(ROOT / "tests" / "specs" / "valid" / "ppo_critic.yaml")
DEMO = str(ROOT / "ppokit" / "specs" / "demo.yaml")


def invoke(*args: str) -> Any:
    return runner.invoke(app, list(args), catch_exceptions=False)


def assert_user_error(result: Any, *fragments: str) -> None:
    """Exit status 1, the message on stderr, no traceback."""
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output + result.stderr
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr


def test_version_and_help() -> None:
    assert invoke("--version").stdout.strip() == f"ppokit {__version__}"
    stated = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    assert stated is not None
    assert __version__ == version("ppokit") == stated[1]  # written once, in pyproject.toml
    result = invoke("--help")
    for command in (
        "list",
        "show",
        "validate",
        "explain",
        "schema",
        "plugins",
        "new-plugin",
        "train",
    ):
        assert command in result.stdout


# ---------------------------------------------------------------------- list / show
def test_list_json_has_every_component_with_its_plugin(use_registry: Any) -> None:
    use_registry(Plugin().add("advantage", "scaled", Scaled, summary="a test estimator"))
    rows = json.loads(invoke("list", "--json").stdout)
    assert {
        "kind": "advantage",
        "name": "scaled",
        "plugin": "test0",
        "summary": "a test estimator",
    } in rows
    assert {("advantage", "gae"), ("aggregation", "token_mean")} <= {
        (r["kind"], r["name"]) for r in rows
    }
    kinds = {r["kind"] for r in json.loads(invoke("list", "advantage", "--json").stdout)}
    assert kinds == {"advantage"}


def test_list_table() -> None:
    result = invoke("list", "policy_loss")
    assert result.exit_code == 0
    assert "ppo_clip" in result.stdout and "gae" not in result.stdout
    assert "plugin" in result.stdout.splitlines()[0]


def test_list_unknown_kind() -> None:
    assert_user_error(
        invoke("list", "advantages"),
        "unknown component kind 'advantages'",
        "did you mean 'advantage'",
    )


def test_show_parameters_formula_requires_source(use_registry: Any) -> None:
    use_registry(
        Plugin().add(
            "advantage",
            "scaled",
            Scaled,
            params=ScaleParams,
            formula="A = s·R",
            source="A paper (X, 2024)",
            requires=("group_ids",),
        )
    )
    data = json.loads(invoke("show", "advantage", "scaled", "--json").stdout)
    assert data["formula"] == "A = s·R"
    assert data["requires"] == ["group_ids"]
    assert (data["source"], data["plugin"]) == ("A paper (X, 2024)", "test0")
    (param,) = data["parameters"]
    assert param == {
        "name": "scale",
        "type": "number",
        "required": False,
        "default": 1.0,
        "bounds": "> 0, <= 10",
        "description": "a positive scale",
    }
    text = invoke("show", "advantage", "scaled").stdout
    for fragment in ("A = s·R", "group_ids", "A paper (X, 2024)", "scale", "> 0, <= 10", "test0"):
        assert fragment in text


def test_show_a_builtin() -> None:
    text = invoke("show", "advantage", "gae").stdout
    assert "lam" in text and "values" in text and "arXiv" in text


def test_show_unknown() -> None:
    assert_user_error(invoke("show", "advantage", "gea"), "unknown advantage 'gea'", "'gae'")
    assert_user_error(invoke("show", "advantag", "gae"), "unknown component kind")


# ---------------------------------------------------------------------- validate
def test_validate_valid_specs() -> None:
    paths = [str(p) for p in valid_specs()]
    result = invoke("validate", *paths)
    assert result.exit_code == 0, result.stderr
    assert result.stdout.splitlines() == [f"{p}: valid" for p in paths]


def test_validate_prints_every_error_one_line_each() -> None:
    case = next(c for c in invalid_specs() if c.path.stem == "many_errors")
    result = invoke("validate", GRPO, str(case.path))
    assert result.exit_code == 1
    assert f"{GRPO}: valid" in result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == len(case.errors)
    for line, expected in zip(lines, case.errors, strict=True):
        assert line.startswith(f"{case.path}: ") and expected in line


def test_validate_warns_of_asynchronous_rollouts_without_a_correction() -> None:
    """Valid, exit 0, and one warning line that says what it trains; in --json too."""
    result = invoke("validate", GRPO, "--set", "rollout.max_staleness=1")
    assert result.exit_code == 0, result.stderr
    assert result.stdout.strip() == f"{GRPO}: valid"
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"{GRPO}: warning: policy.correction: none with rollout.max_staleness")
    record = json.loads(invoke("validate", GRPO, "-s", "rollout.max_staleness=1", "--json").stdout)
    assert record[0]["valid"] and len(record[0]["warnings"]) == 1
    fixed = invoke(
        "validate", GRPO, "-s", "rollout.max_staleness=1", "-s", "policy.correction=token_tis"
    )
    assert fixed.exit_code == 0 and not fixed.stderr.strip()


def test_validate_json_and_set(tmp_spec: Any) -> None:
    bad = invoke("validate", GRPO, "--set", "rollout.n=1", "--json")
    assert bad.exit_code == 1
    (record,) = json.loads(bad.stdout)
    assert record["valid"] is False and record["errors"][0].startswith("rollout.n:")
    good = invoke(
        "validate",
        str(tmp_spec("advantage: gae\n")),
        "--set",
        "critic={}",
        "-s",
        "advantage.lam=0.5",
    )
    assert good.exit_code == 0, good.stderr


def test_validate_missing_file_and_bad_override() -> None:
    assert_user_error(invoke("validate", "/nonexistent.yaml"), "/nonexistent.yaml: file not found")
    assert_user_error(invoke("validate", GRPO, "--set", "rollout.n"), "expected path=value")


# ---------------------------------------------------------------------- explain / schema
def test_explain_writes_out_the_objectives() -> None:
    text = invoke("explain", PPO).stdout
    order = [
        "1. Reward",
        "2. Truncation",
        "3. KL in the reward",
        "4. Advantage",
        "5. Critic",
        "6. Actor",
    ]
    positions = [text.index(section) for section in order]
    assert positions == sorted(positions)
    for fragment in (
        "gae(gamma=1.0, lam=0.95, whiten=True)",  # chosen params and defaults
        "lambda_return(gamma=1.0, lam=1.0)",
        "clipped_mse(clip=0.2)",
        "r_t ← r_t − β·k1(logp_old, logp_ref), β = 0.05 (adaptive: target 6",
        "L_V = 0.5 · token_mean(clipped_mse(V_φ(s_t), Y_t, V_old(s_t)) · ω[:, None], m^V)",
        "− 0.01·token_mean(entropy",
        "δ_t = r_t + γ V(s_{t+1}) − V(s_t)",  # the estimator's formula
        "arXiv:1506.02438",
    ):
        assert fragment in text, fragment


def test_explain_kl_in_the_loss_and_no_critic() -> None:
    text = invoke("explain", GRPO, "--set", "policy.nll_coef=0.1").stdout
    assert "5. Critic: none" in text
    assert "+ 0.04·seq_mean_token_mean(k3(logp, logp_ref)" in text
    assert "+ 0.1·seq_mean_token_mean(−logp" in text
    assert "ppo_clip(clip_low=0.2, clip_high=0.28, dual_clip=None)" in text


def test_explain_invalid_spec() -> None:
    assert_user_error(
        invoke("explain", GRPO, "--set", "advantage=gea"), "advantage: unknown advantage 'gea'"
    )


def test_schema_is_json_schema() -> None:
    schema = json.loads(invoke("schema").stdout)
    jsonschema.Draft202012Validator.check_schema(schema)
    assert "gae" in schema["$defs"]["component.advantage"]["anyOf"][0]["enum"]


# ---------------------------------------------------------------------- plugins
def test_plugins_reports_loaded_and_failed(use_registry: Any) -> None:
    registry = use_registry(Plugin().add("advantage", "scaled", Scaled))
    registry.load_plugin("bad", Plugin(fail_with=RuntimeError("broken on purpose")))
    registry.load_plugin("clash", Plugin().add("advantage", "scaled", Scaled))
    data = json.loads(invoke("plugins", "--json").stdout)
    by_name = {p["name"]: p for p in data["plugins"]}
    assert by_name["test0"]["ok"] and by_name["test0"]["components"] == ["advantage/scaled"]
    assert by_name["bad"]["error"] == "RuntimeError: broken on purpose"
    assert data["conflicts"] == [
        "advantage 'scaled' is registered by more than one plugin: test0, clash"
    ]
    text = invoke("plugins").stdout
    assert "bad: failed: RuntimeError: broken on purpose" in text and "conflict:" in text
    listed = invoke("list")
    assert listed.exit_code == 0 and "plugin bad failed to load" in listed.stderr


def test_strict_plugins_error_is_one_line(
    use_registry: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ppokit import registry as registry_module

    def strict(strict: bool | None = None) -> Any:
        raise registry_module.RegistryError("plugin bad: RuntimeError: boom")

    monkeypatch.setattr(registry_module, "build_registry", strict)
    registry_module.reset_registry()
    for args in (["list"], ["plugins"], ["validate", GRPO], ["schema"]):
        assert_user_error(invoke(*args), "error: plugin bad: RuntimeError: boom")


# ---------------------------------------------------------------------- new-plugin
def test_new_plugin_scaffolds_a_distribution(tmp_path: Path) -> None:
    result = invoke("new-plugin", "my-adv", "--dir", str(tmp_path))
    assert result.exit_code == 0, result.stderr
    root = tmp_path / "ppokit-my-adv"
    files = {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}
    assert files == {
        "pyproject.toml",
        "README.md",
        "ppokit_my_adv/__init__.py",
        "ppokit_my_adv/plugin.py",
        "ppokit_my_adv/advantage.py",
        "tests/test_advantage.py",
    }
    assert 'my_adv = "ppokit_my_adv.plugin"' in (root / "pyproject.toml").read_text()
    assert_user_error(invoke("new-plugin", "my-adv", "--dir", str(tmp_path)), "already exists")
    assert_user_error(
        invoke("new-plugin", "My Plugin", "--dir", str(tmp_path)), "plugin name 'My Plugin'"
    )


# ---------------------------------------------------------------------- train
@pytest.fixture
def fake_trainer(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    calls: list[dict[str, Any]] = []
    module = types.ModuleType("ppokit.trainer")

    def train(
        spec: Any,
        *,
        resume: bool = False,
        smoke: bool = False,
        overwrite: bool = False,
        smoke_out: str | None = None,
        **options: Any,
    ) -> dict[str, Any]:
        if spec.seed == 666:
            raise UserError("output directory runs/x exists: pass --overwrite or --resume")
        calls.append(
            {
                "spec": spec,
                "resume": resume,
                "smoke": smoke,
                "overwrite": overwrite,
                "smoke_out": smoke_out,
                **options,
            }
        )
        return {"rounds": spec.train.rounds}

    module.train = train  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "ppokit.trainer", module)
    monkeypatch.setitem(sys.modules, "ppokit.trainer.loop", module)
    return calls


def test_train_a_spec_with_overrides(fake_trainer: list[dict[str, Any]], tmp_path: Path) -> None:
    result = invoke(
        "train", GRPO, "--set", "train.rounds=2", "--out", str(tmp_path / "o ut"), "--seed", "5",
        "--smoke", "--overwrite", "--json",
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    (call,) = fake_trainer
    spec = call["spec"]
    assert (spec.train.rounds, spec.seed, spec.output.dir) == (2, 5, str(tmp_path / "o ut"))
    assert (call["resume"], call["smoke"], call["overwrite"]) == (False, True, True)
    assert call["smoke_out"] == str(tmp_path / "o ut")
    assert json.loads(result.stdout) == {"rounds": 2}


def test_each_process_gets_the_command_with_its_flags(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``--nproc 2``: the launcher starts ``ppokit train`` with the spec, its overrides, seed,
    threads, output folder and every flag (``--resume`` too) on each process, and the
    launcher's exit status is the command's."""
    from ppokit import launcher

    seen: list[tuple[int, list[str]]] = []

    def launch(nproc: int, argv: list[str]) -> tuple[int, list[str]]:
        seen.append((nproc, argv))
        return 3, []

    monkeypatch.setattr(launcher, "launch", launch)
    out = str(tmp_path / "o ut")
    result = invoke(
        "train", GRPO, "--nproc", "2", "--set", "train.rounds=2", "--seed", "5", "--threads",
        "1", "--out", out, "--resume", "--allow-spec-change", "--overwrite", "--json",
    )  # fmt: skip
    assert result.exit_code == 3, result.stderr
    assert seen == [
        (
            2,
            [
                "train", GRPO, "--set", "train.rounds=2", "--seed", "5", "--threads", "1",
                "--out", out, "--resume", "--allow-spec-change", "--overwrite", "--json",
            ],
        )
    ]  # fmt: skip


@pytest.mark.parametrize("out", [None, "given"])
def test_a_smoke_run_on_processes_leaves_no_temporary_folder(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, out: str | None
) -> None:
    """``--smoke --nproc 2`` without ``--out``: the processes' TMPDIR is a new folder, removed
    with what a process stopped by the launcher left in it; with ``--out`` none is made."""
    from ppokit import launcher

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    seen: list[str] = []

    def launch(nproc: int, argv: list[str]) -> tuple[int, list[str]]:
        seen.append(os.environ["TMPDIR"])
        (Path(os.environ["TMPDIR"]) / "ppokit-smoke-left").mkdir(exist_ok=True)
        return 1, ["error: process 1 (pid 1) was killed by signal SIGKILL"]

    monkeypatch.setattr(launcher, "launch", launch)
    args = ["train", "--smoke", "--nproc", "2"]
    result = invoke(*args) if out is None else invoke(*args, "--out", str(tmp_path / out))
    assert result.exit_code == 1 and "SIGKILL" in result.stderr
    assert os.environ["TMPDIR"] == str(tmp_path)  # put back
    [folder] = seen
    if out is None:
        assert Path(folder).name.startswith("ppokit-processes-") and not Path(folder).exists()
    else:
        assert folder == str(tmp_path)
        assert (tmp_path / "ppokit-smoke-left").is_dir()


def test_train_defaults_to_the_packaged_demo(fake_trainer: list[dict[str, Any]]) -> None:
    result = invoke("train", "--resume", "--set", "train.rounds=1")
    assert result.exit_code == 0, result.stderr
    (call,) = fake_trainer
    assert call["resume"] and call["spec"].train.rounds == 1
    assert call["spec"].data.source == "demo"


def test_train_user_errors(fake_trainer: list[dict[str, Any]]) -> None:
    assert_user_error(
        invoke("train", GRPO, "--seed", "666"), "error: output directory runs/x exists"
    )
    assert_user_error(invoke("train", GRPO, "--set", "rollout.n=1"), "rollout.n:")
    assert_user_error(invoke("train", "missing.yaml"), "missing.yaml: file not found")
    assert fake_trainer == []


# ---------------------------------------------------------------------- light imports
LIGHT = """
import sys
from ppokit.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
heavy = sorted(m for m in ("torch", "transformers", "numpy", "vllm") if m in sys.modules)
print("HEAVY=" + ",".join(heavy))
"""


@pytest.mark.parametrize(
    "args",
    [
        ["--help"],
        ["list"],
        ["plugins"],
        ["schema"],
        ["validate", GRPO, PPO],
        # the vllm engine's checks (its heads of 16 refused) import neither torch nor vLLM
        ["validate", DEMO, "-s", "rollout.engine=vllm", "-s", "model.tiny.num_attention_heads=4"],
        ["show", "advantage", "gae"],
        ["check", "--help"],
        ["check", "advantag"],
    ],
    ids=lambda a: a[0],
)
def test_data_commands_do_not_import_torch(args: list[str]) -> None:
    result = subprocess.run(
        [sys.executable, "-c", LIGHT, *args], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "HEAVY=\n" in result.stdout, result.stdout[-300:]
