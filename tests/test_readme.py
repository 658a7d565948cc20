"""The README's two set-up commands stay true: CI runs the test command verbatim, and the
main command trains the packaged demo."""

from __future__ import annotations

import re
from pathlib import Path

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
