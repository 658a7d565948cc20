"""The README's two set-up commands stay true: CI runs the test command verbatim, and the
main command trains the packaged demo."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    return [b.strip() for b in blocks if b.strip().startswith("python3 -m venv")]


def test_readme_has_the_two_setup_commands() -> None:
    main, tests = _commands()[:2]
    assert main.endswith("&& ppokit train")
    assert tests.endswith("&& pytest")
    assert "pip install torch==2.13.0" in main and "pip install torch==2.13.0" in tests


def test_ci_runs_the_readme_test_command_verbatim() -> None:
    tests = _commands()[1]
    assert tests in (ROOT / ".ci" / "run").read_text()


#: Paths a README names: repository files and folders (globs allowed), in text or code.
PATH = re.compile(
    r"(?<![\w/.-])((?:docs|examples|ppokit|plugins|benchmarks|tests|\.ci)/[\w./*-]*[\w*]"
    r"|constraints\.txt)"
)


def test_every_path_the_readme_names_exists() -> None:
    text = (ROOT / "README.md").read_text()
    named = set(PATH.findall(text))
    assert "docs/design.md" in named and "constraints.txt" in named  # the pattern finds them
    missing = sorted(p for p in named if not list(ROOT.glob(p)))
    assert not missing, f"the README names paths that do not exist: {missing}"


def test_every_ppokit_command_the_readme_names_exists() -> None:
    import typer.main

    from ppokit.cli import app

    commands = set(typer.main.get_command(app).commands)  # type: ignore[attr-defined]
    text = (ROOT / "README.md").read_text()
    code = re.findall(r"```bash\n(.*?)```", text, re.S) + re.findall(r"`([^`\n]+)`", text)
    named = set(re.findall(r"(?:^|\s)ppokit ([a-z][a-z-]*)", "\n".join(code), re.M))
    assert {"train", "list", "compare"} <= named  # the pattern finds them
    assert named <= commands, f"not ppokit commands: {sorted(named - commands)}"


def test_the_readme_states_no_test_counts_and_one_figure_per_command() -> None:
    """Test counts go stale with every test; timings with loads belong in docs/results.md."""
    text = (ROOT / "README.md").read_text()
    assert not re.search(r"\d[\d,]* (?:tests|passed)", text)
    assert not re.search(r"\bload(?: average)? \d", text)
    assert not re.search(r"\b[A-Z]+_FIGURE\b", text)  # a figure still to be measured


def test_ci_fails_a_test_skipped_for_a_package_it_should_have_installed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With PPOKIT_REQUIRE_EXTRAS=1 (.ci/run) a skip for a missing package fails; another
    skip, or any skip without it, stays a skip."""
    from conftest import missing_package_fails

    def report(reason: str) -> pytest.TestReport:
        return pytest.TestReport(
            "t.py::t", ("t.py", 1, "t"), {}, "skipped", ("t.py", 1, reason), "call"
        )

    missing = "Skipped: could not import 'trl': No module named 'trl'"
    assert "export PPOKIT_REQUIRE_EXTRAS=1" in (ROOT / ".ci" / "run").read_text()
    for required, reason, outcome in [
        ("1", missing, "failed"),
        ("1", "Skipped: root ignores chmod", "skipped"),
        ("", missing, "skipped"),
    ]:
        monkeypatch.setenv("PPOKIT_REQUIRE_EXTRAS", required)
        r = report(reason)
        missing_package_fails(r)
        assert r.outcome == outcome
