"""docs/from-trl-verl.md names, beside each mapping it claims, the test that proves it: every
test it names exists, and every test of the files that hold its rows against TRL's and
verl's code is named there."""

from __future__ import annotations

import ast
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
PAGE = HERE.parents[1] / "docs" / "from-trl-verl.md"
#: the files whose every test proves (or shows the difference of) a row of the page
ROWS = ("test_trl.py", "test_verl.py", "test_verl_advantage.py")
#: the files a row may also name
NAMED = (*ROWS, "test_convert.py")


def defined(names: tuple[str, ...]) -> set[str]:
    out = set()
    for name in names:
        tree = ast.parse((HERE / name).read_text())
        out |= {f"{name}::{f.name}" for f in tree.body if isinstance(f, ast.FunctionDef) and f.name.startswith("test_")}  # fmt: skip
    return out


def test_page_names_the_tests() -> None:
    text = PAGE.read_text()
    named = set(re.findall(r"(test_\w+\.py::test_\w+)", text))
    bare = set(re.findall(r"`(test_\w+)`", text))
    every = defined(NAMED)
    assert named <= every, sorted(named - every)
    assert bare <= {t.split("::")[1] for t in every}, sorted(bare)
    rows = defined(ROWS)
    unnamed = {t.split("::")[1] for t in rows} - {n.split("::")[1] for n in named} - bare
    assert not unnamed, sorted(unnamed)
    assert any(n.startswith("test_verl_advantage.py::") for n in named)
    assert any(n.startswith("test_convert.py::") for n in named)
