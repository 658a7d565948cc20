"""``ppokit new-plugin``: names, the generated files, and the generated distribution
installed into a throwaway virtualenv, passing its own tests and listed by that venv's CLI."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ppokit.cli import app
from ppokit.errors import UserError
from ppokit.scaffold import new_plugin, plugin_names
from tests.helpers import Venv, names_of


@pytest.mark.parametrize(
    ("name", "dist", "pkg", "component", "cls"),
    [
        ("myadv", "ppokit-myadv", "ppokit_myadv", "myadv_centered", "MyadvCentered"),
        ("my-adv", "ppokit-my-adv", "ppokit_my_adv", "my_adv_centered", "MyAdvCentered"),
        ("ppokit-x2_y", "ppokit-x2-y", "ppokit_x2_y", "x2_y_centered", "X2YCentered"),
    ],
)
def test_plugin_names(name: str, dist: str, pkg: str, component: str, cls: str) -> None:
    names = plugin_names(name)
    assert (names.dist, names.pkg, names.component, names.cls) == (dist, pkg, component, cls)
    assert names.component.isidentifier() and names.pkg.isidentifier()


@pytest.mark.parametrize("name", ["", "My", "1abc", "a b", "a--b", "a.b", "-a", "ünï"])
def test_bad_plugin_names(name: str) -> None:
    with pytest.raises(UserError, match="plugin name"):
        plugin_names(name)


def test_generated_files_have_no_placeholders_left(tmp_path: Path) -> None:
    root = new_plugin("zeta", tmp_path)
    for path in root.rglob("*"):
        if path.is_file():
            text = path.read_text()
            assert "{{" not in text and "__pkg__" not in str(path), path
    compile((root / "ppokit_zeta" / "plugin.py").read_text(), "plugin.py", "exec")
    readme = (root / "README.md").read_text()
    assert "zeta_centered" in readme
    assert "pip install -e './ppokit-zeta[test]'" in readme  # pytest is not in ppokit's install
    # the lazy factory is the module's name, as the built-ins' (no "module:Class")
    assert '"ppokit_zeta.advantage"' in readme and "advantage:ZetaCentered" not in readme
    # the test extra brings what the tests import
    pyproject = (root / "pyproject.toml").read_text()
    [test] = re.findall(r"^\[project\.optional-dependencies\]\ntest = \[(.*)\]$", pyproject, re.M)
    extra = {re.split(r"[<>=\[ ]", r.strip(' "'))[0] for r in test.split(",")}
    tests = (root / "tests" / "test_advantage.py").read_text()
    imported = set(re.findall(r"^(?:from|import) (\w+)", tests, re.M))
    assert {"pytest", "hypothesis"} <= imported and {"pytest", "hypothesis"} <= extra


@pytest.mark.parametrize("relative", [True, False])
def test_the_hint_installs_the_test_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, relative: bool
) -> None:
    monkeypatch.chdir(tmp_path)
    args = ["new-plugin", "zeta"] if relative else ["new-plugin", "zeta", "--dir", str(tmp_path)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.stderr
    root = "./ppokit-zeta" if relative else str(tmp_path / "ppokit-zeta")
    tests = "ppokit-zeta/tests" if relative else str(tmp_path / "ppokit-zeta" / "tests")
    hint = f"next: pip install -e '{root}[test]' && python -m pytest {tests}"
    assert hint in result.stdout.splitlines(), result.stdout


@pytest.mark.slow
def test_generated_plugin_installs_and_passes_its_tests(plugin_venv: Venv, tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["new-plugin", "scaffolded", "--dir", str(tmp_path)])
    assert result.exit_code == 0, result.stderr
    root = tmp_path / "ppokit-scaffolded"
    plugin_venv.install(root)
    tests = plugin_venv.run(["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"], cwd=root)
    assert tests.returncode == 0, tests.stdout[-3000:]
    assert "6 passed" in tests.stdout
    listed = plugin_venv.ppokit("list", "advantage", "--json", PPOKIT_LOAD_PLUGINS="scaffolded")
    assert listed.returncode == 0, listed.stderr
    assert names_of(json.loads(listed.stdout), "advantage")["scaffolded_centered"] == "scaffolded"
    spec = tmp_path / "spec.yaml"
    spec.write_text("rollout: {n: 2}\nadvantage: {name: scaffolded_centered, scale: 2.0}\n")
    valid = plugin_venv.ppokit("validate", str(spec), PPOKIT_LOAD_PLUGINS="scaffolded")
    assert valid.returncode == 0, valid.stderr
    variants = plugin_venv.ppokit("variants", "--json", PPOKIT_LOAD_PLUGINS="scaffolded")
    assert variants.returncode == 0, variants.stderr
    published = {row["name"]: row for row in json.loads(variants.stdout)}
    assert published["scaffolded_centered_grpo"]["plugin"] == "scaffolded"
    assert published["scaffolded_centered_grpo"]["base"] == "grpo"
    trained = plugin_venv.ppokit(
        "train", "scaffolded_centered_grpo", "--smoke", PPOKIT_LOAD_PLUGINS="scaffolded"
    )
    assert trained.returncode == 0, trained.stderr[-3000:]
    checked = plugin_venv.ppokit("check", "scaffolded", PPOKIT_LOAD_PLUGINS="scaffolded")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "advantage/scaffolded_centered contract: held" in checked.stdout


def test_check_fails_a_broken_copy_of_the_scaffold(plugin_venv: Venv, tmp_path: Path) -> None:
    """The same scaffold with its advantage returned in float64: the contract fails, with the
    counterexample, and nothing else of the check breaks."""
    result = CliRunner().invoke(app, ["new-plugin", "brokencopy", "--dir", str(tmp_path)])
    assert result.exit_code == 0, result.stderr
    code = tmp_path / "ppokit-brokencopy" / "ppokit_brokencopy" / "advantage.py"
    text = code.read_text()
    assert "return broadcast_rows(adv, batch.response_mask)" in text
    code.write_text(
        text.replace(
            "broadcast_rows(adv, batch.response_mask)",
            "broadcast_rows(adv, batch.response_mask).double()",
        )
    )
    plugin_venv.install(tmp_path / "ppokit-brokencopy")
    try:
        checked = plugin_venv.ppokit("check", "brokencopy", PPOKIT_LOAD_PLUGINS="brokencopy")
    finally:
        plugin_venv.run(["-m", "pip", "uninstall", "-y", "-q", "ppokit-brokencopy"])
    assert checked.returncode == 1, checked.stdout + checked.stderr
    assert "advantage/brokencopy_centered contract: failed" in checked.stdout
    assert "float64" in checked.stdout and "Traceback" not in checked.stdout + checked.stderr
