"""The researcher-facing docs: the references ``ppokit docs`` generates are up to date and
complete, and the plugin tutorial (docs/plugins.md) works when followed literally."""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ppokit import docgen
from ppokit.cli import app
from ppokit.registry import get_registry
from ppokit.slots import FIELDS, SLOTS
from ppokit.spec import Spec
from tests.helpers import ROOT, Venv

TUTORIAL = ROOT / "docs" / "plugins.md"
REGENERATE = "run `ppokit docs` in the project root and commit the result"
runner = CliRunner()


@pytest.fixture(scope="module")
def generated() -> dict[str, str]:
    return docgen.generate(ROOT)


def table_rows(text: str, head: str) -> list[dict[str, str]]:
    """The rows of the Markdown table whose header line starts with ``head``, by column."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(head))
    block = itertools.takewhile(lambda line: line.startswith("|"), lines[start:])
    cells = [[c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]] for line in block]
    return [dict(zip(cells[0], row, strict=True)) for row in cells[2:]]


# ---------------------------------------------------------------------- generated docs
def test_generated_docs_are_up_to_date() -> None:
    stale = docgen.write_docs(ROOT / "docs", root=ROOT, check=True)
    assert not stale, f"out of date: {', '.join(map(str, stale))}; {REGENERATE}"


def test_generation_is_deterministic_and_has_no_local_paths(generated: dict[str, str]) -> None:
    assert set(generated) == {"components.md", "variants.md", "spec.md"}
    assert docgen.generate(ROOT) == generated
    for path, text in generated.items():
        assert str(ROOT) not in text, path
        assert not re.search(r"\b20\d\d-\d\d-\d\d[T ]\d\d:\d\d", text), f"{path}: a timestamp"
        assert not re.search(r"\{\{ ?\w+ ?(\||\}\})", text), f"{path}: a placeholder left"


def test_installed_plugins_do_not_change_the_docs(
    generated: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PPOKIT_LOAD_PLUGINS", raising=False)  # every installed plugin
    assert docgen.generate(ROOT) == generated


def test_check_names_the_stale_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    out = tmp_path / "docs"
    monkeypatch.chdir(ROOT)
    assert "docs" in runner.invoke(app, ["--help"]).stdout
    assert runner.invoke(app, ["docs", "--out", str(out)]).exit_code == 0
    assert runner.invoke(app, ["docs", "--out", str(out), "--check"]).exit_code == 0
    spec_md = out / "spec.md"
    edited = spec_md.read_text() + "edited by hand\n"
    spec_md.write_text(edited)
    (out / "components.md").unlink()
    result = runner.invoke(app, ["docs", "--out", str(out), "--check"])
    assert result.exit_code == 1
    lines = result.stderr.splitlines()
    assert len(lines) == 2, lines
    assert str(out / "components.md") in lines[0] and str(spec_md) in lines[1]
    assert all("ppokit docs" in line for line in lines)
    assert "variants.md" not in result.stderr
    assert spec_md.read_text() == edited and not (out / "components.md").exists()  # wrote nothing
    result = runner.invoke(app, ["docs", "--out", str(out)])
    assert result.exit_code == 0 and "spec.md" in result.stdout
    assert spec_md.read_text() == docgen.generate(ROOT)["spec.md"]


def test_docs_outside_the_project_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Outside a checkout the docs are generated from the installed registry."""
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["docs", "--out", "docs"])
    assert result.exit_code == 0, result.output
    text = (tmp_path / "docs" / "variants.md").read_text()
    assert "\n## dapo\n" in text and "\n## ppo_demo\n" in text
    assert runner.invoke(app, ["docs", "--out", "docs", "--check"]).exit_code == 0


def test_variants_cover_every_method_and_link_the_concepts(generated: dict[str, str]) -> None:
    text = generated["variants.md"]
    assert "(concepts.md)" in text
    rows = table_rows(text, "| method |")
    registry, _ = docgen.method_registry(ROOT)
    methods = [info.name for info in registry.entries("variant")]
    assert [re.match(r"\[(\w+)\]", r["method"]).group(1) for r in rows] == methods  # type: ignore[union-attr]
    assert list(rows[0]) == ["method", *(s.path for s in SLOTS)]
    for name in methods:
        assert f"\n## {name}\n" in text
        assert f"```text\nppokit run: variant {name}\nvariant {name}: " in text  # explain
    ppo = rows[methods.index("ppo")]
    assert ppo["advantage"] == "`gae(gamma=1, lam=0.95, whiten=true)`"
    assert ppo["critic.loss"] == "`clipped_mse(clip=0.2)`"
    assert ppo["kl.estimator"] == "`k1`, β=0.05, reward"
    grpo = rows[methods.index("grpo")]
    assert [grpo[s.path] for s in SLOTS if s.section == "critic"] == ["—"] * 5
    hlgauss = rows[methods.index("ppo_hlgauss")]
    assert hlgauss["critic.loss"].endswith("†") and "(plugin ppokit-hlgauss)" in text


def test_components_reference_lists_every_builtin(generated: dict[str, str]) -> None:
    text = generated["components.md"]
    registry = docgen.builtin_registry()
    assert {i.plugin for i in registry.components()} == {"ppokit"}
    for kind in registry.kinds():
        assert f"\n## {kind}\n" in text
        assert docgen.convention(kind).split("\n")[0] in text
    for info in registry.components():
        assert f"### `{info.name}`" in text
        if info.source:
            assert info.source in text
        if info.formula:
            assert info.formula.strip() in text
    for s in SLOTS:
        assert f"- `{s.path}` ({s.symbol}): {s.description}" in text
    assert "| `lam` | number | `0.95` | >= 0.0, <= 1.0 | GAE lambda in [0, 1] |" in text
    assert "In a spec: `critic: {loss: {name: clipped_mse, clip: 0.2}}`" in text


def test_show_and_the_docs_share_the_parameter_table(
    generated: dict[str, str], clean_registry: None
) -> None:
    info = get_registry().info("advantage", "gae")
    rows = docgen.param_rows(info.params)
    shown = json.loads(runner.invoke(app, ["show", "advantage", "gae", "--json"]).stdout)
    assert shown["parameters"] == [r.as_dict() for r in rows]
    assert docgen.params_markdown(rows) in generated["components.md"]
    text = runner.invoke(app, ["show", "advantage", "gae"]).stdout
    for row in rows:
        assert re.search(r"\s+".join(map(re.escape, row.cells()[:4])), text), row


def test_spec_reference_lists_every_field(generated: dict[str, str]) -> None:
    text = generated["spec.md"]
    for name, field in Spec.model_fields.items():
        assert f"| `{name}` |" in text
        model = docgen._section(field)
        for sub in model.model_fields if model is not None else ():
            assert f"| `{name}.{sub}` |" in text
    for s in SLOTS:
        assert f"| `{s.path}` | [{s.kind}](components.md#{s.kind}) | `{s.default}` |" in text
    for f in FIELDS:
        assert re.search(rf"\| `{f.name}` \| [^|]+ \| {re.escape(f.provided_by)} \|", text)
    assert "| `rollout.top_p` | number | `1.0` | > 0, <= 1 |" in text
    assert "| `reward` | list[component] | `demo` | — |" in text


# ---------------------------------------------------------------------- the tutorial
@dataclass
class Block:
    info: str
    text: str

    @property
    def lang(self) -> str:
        return self.info.split()[0] if self.info else ""

    @property
    def options(self) -> dict[str, str]:
        return dict(o.split("=", 1) for o in self.info.split()[1:] if "=" in o)


def fenced_blocks(markdown: str) -> list[Block]:
    """The fenced code blocks of a markdown text, in order."""
    return [
        Block(m.group(1).strip(), m.group(2))
        for m in re.finditer(r"^```([^`\n]*)\n(.*?)^```\s*$", markdown, re.M | re.S)
    ]


def _trainer_importable() -> bool:
    try:
        import ppokit.trainer  # noqa: F401
    except ImportError:
        return False
    return True


def _ppokit_launcher(venv: Venv) -> None:
    """``ppokit`` on the venv's PATH, as a console script installed with ppokit would be."""
    script = venv.python.parent / "ppokit"
    if not script.exists():
        script.write_text(
            f"#!{venv.python}\nimport sys\nfrom ppokit.cli import main\nmain(sys.argv[1:])\n"
        )
        script.chmod(0o755)


def test_tutorial_blocks_are_marked() -> None:
    blocks = fenced_blocks(TUTORIAL.read_text())
    commands = "\n".join(b.text for b in blocks if b.lang == "bash")
    for step in ("ppokit new-plugin", "pip install -e", "pytest", "ppokit list", "ppokit show"):
        assert step in commands
    for step in ("ppokit validate", "ppokit explain", "ppokit train", "pip wheel"):
        assert step in commands
    titles = [b.options["title"] for b in blocks if "title" in b.options]
    assert "ppokit-zclip/ppokit_zclip/plugin.py" in titles
    assert any(t.endswith(".yaml") for t in titles)


def test_plugin_tutorial_followed_literally(tmp_path: Path, plugin_venv: Venv) -> None:
    """Runs each ```bash block in order in an empty directory with the venv's bin dir first on
    PATH, writing each ``title=path`` block first. pip is told through its environment that
    the machine is offline (no index, no build isolation)."""
    _ppokit_launcher(plugin_venv)
    (tmp_path / "tmp").mkdir()
    env = plugin_venv.env(
        PATH=f"{plugin_venv.python.parent}{os.pathsep}{os.environ.get('PATH', '')}",
        PIP_NO_INDEX="1",
        PIP_NO_BUILD_ISOLATION="0",
        PIP_DISABLE_PIP_VERSION_CHECK="1",
        TMPDIR=str(tmp_path / "tmp"),
    )
    work = tmp_path / "work"
    work.mkdir()
    trainer = _trainer_importable()
    ran = []
    try:
        for block in fenced_blocks(TUTORIAL.read_text()):
            if "title" in block.options:
                target = work / block.options["title"]
                assert target.parent.is_dir(), f"{block.options['title']}: no such directory yet"
                target.write_text(block.text)
            elif block.lang == "python":
                compile(block.text, "docs/plugins.md", "exec")
            elif block.lang == "bash":
                if block.options.get("needs") == "trainer" and not trainer:
                    continue
                result = subprocess_run(block.text, work, env)
                assert result.returncode == 0, (
                    f"docs/plugins.md step failed:\n{block.text}\n"
                    f"--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"
                )
                ran.append((block.text, result.stdout))
    finally:
        plugin_venv.run(["-m", "pip", "uninstall", "-y", "-q", "ppokit-zclip"])
    outputs = dict(ran)
    listed = next(out for cmd, out in outputs.items() if "ppokit list advantage" in cmd)
    assert re.search(r"zclip\s+zclip\s+Group z-score", listed), listed
    shown = next(out for cmd, out in outputs.items() if "ppokit show advantage zclip" in cmd)
    assert "requires: group_ids" in shown and "clip" in shown
    explained = next(out for cmd, out in outputs.items() if "ppokit explain" in cmd)
    assert "estimator: zclip(clip=2.0, eps=1e-06)" in explained
    assert "plugin zclip" in explained
    assert list((work / "dist").glob("ppokit_zclip-*.whl"))


def subprocess_run(script: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
