"""docs/from-trl-verl.md names, beside each mapping it claims, the test that proves it: every
test it names exists, and every test of tests/peers/ is named there."""

from __future__ import annotations

import ast
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
PAGE = HERE.parents[1] / "docs" / "from-trl-verl.md"


def defined() -> set[str]:
    out = set()
    for name in ("test_trl.py", "test_verl.py"):
        tree = ast.parse((HERE / name).read_text())
        out |= {f"{name}::{f.name}" for f in tree.body if isinstance(f, ast.FunctionDef) and f.name.startswith("test_")}  # fmt: skip
    return out


def test_page_names_the_tests() -> None:
    text = PAGE.read_text()
    named = set(re.findall(r"(test_(?:trl|verl)\.py::test_\w+)", text))
    bare = set(re.findall(r"`(test_\w+_differs)`", text))
    tests = defined()
    assert named <= tests, sorted(named - tests)
    assert {t.split("::")[1] for t in tests} <= {n.split("::")[1] for n in named} | bare
