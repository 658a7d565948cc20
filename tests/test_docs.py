"""The researcher-facing docs: the generated references are up to date, and the plugin
tutorial (docs/plugins.md) works when followed literally."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import ROOT, Venv, load_gen_docs

TUTORIAL = ROOT / "docs" / "plugins.md"
REGENERATE = "run `python scripts/gen_docs.py` and commit the result"


@pytest.fixture(scope="module")
def generated() -> dict[str, str]:
    return load_gen_docs().generate()


# ---------------------------------------------------------------------- generated docs
def test_generated_docs_are_up_to_date(generated: dict[str, str]) -> None:
    stale = load_gen_docs().stale(generated)
    assert not stale, f"out of date: {', '.join(stale)}; {REGENERATE}"


def test_generation_is_deterministic_and_has_no_local_paths(generated: dict[str, str]) -> None:
    assert load_gen_docs().generate() == generated
    for path, text in generated.items():
        assert str(ROOT) not in text, path
        assert not re.search(r"\b20\d\d-\d\d-\d\d[T ]\d\d:\d\d", text), f"{path}: a timestamp"


def test_check_names_the_stale_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    gen_docs = load_gen_docs()
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    monkeypatch.setattr(gen_docs, "ROOT", tmp_path)
    assert gen_docs.main([]) == 0
    assert gen_docs.main(["--check"]) == 0
    spec_md = tmp_path / "docs" / "spec.md"
    spec_md.write_text(spec_md.read_text() + "edited by hand\n")
    capsys.readouterr()
    assert gen_docs.main(["--check"]) == 1
    message = capsys.readouterr().err
    assert "docs/spec.md" in message and "python scripts/gen_docs.py" in message
    assert "docs/variants.md" not in message


def test_variants_cover_every_method_and_link_the_concepts(generated: dict[str, str]) -> None:
    gen_docs = load_gen_docs()
    text = generated["docs/variants.md"]
    assert "(concepts.md)" in text
    rows = [line for line in text.splitlines() if line.startswith("| [")]
    methods = [p.stem for p in gen_docs.method_paths()]
    assert [re.match(r"\| \[(\w+)\]", r).group(1) for r in rows] == methods  # type: ignore[union-attr]
    for name in methods:
        assert f"\n## {name}\n" in text
    ppo = rows[methods.index("ppo")].split(" | ")
    assert ppo[1] == "`gae(gamma=1, lam=0.95, whiten=true)`"
    assert ppo[5] == "`clipped_mse(clip=0.2)`"
    assert ppo[9] == "`k1`, β=0.05, reward"
    grpo = rows[methods.index("grpo")].split(" | ")
    assert grpo[2:6] == ["—"] * 4


def test_components_reference_lists_every_builtin(generated: dict[str, str]) -> None:
    text = generated["docs/components.md"]
    registry = load_gen_docs().builtin_registry()
    for info in registry.components():
        assert f"### `{info.name}`" in text
        if info.source:
            assert info.source in text
    assert "| `lam` | number | `0.95` | >= 0.0, <= 1.0 | GAE lambda in [0, 1] |" in text


def test_spec_reference_lists_every_field(generated: dict[str, str]) -> None:
    from ppokit.spec import SLOT_KINDS, Spec

    text = generated["docs/spec.md"]
    for name, field in Spec.model_fields.items():
        assert f"| `{name}` |" in text
        model = load_gen_docs()._section_model(field)
        for sub in model.model_fields if model is not None else ():
            assert f"| `{name}.{sub}` |" in text
    for slot in SLOT_KINDS:
        assert f"| `{slot}` | [" in text
    assert "| `rollout.top_p` | number | `1.0` | > 0, <= 1 |" in text


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
