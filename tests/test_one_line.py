"""``ppokit.errors.one_line``: an exception as one line of an error message."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from ppokit.errors import one_line


def test_the_type_named_the_whitespace_collapsed_the_controls_escaped() -> None:
    assert one_line(ValueError("bad\n  value\tthere ")) == "ValueError: bad value there"
    assert one_line(OSError()) == "OSError"
    assert one_line(KeyError("x")) == "KeyError: 'x'"
    assert one_line(RuntimeError("\x1b[2Jgone")) == "RuntimeError: \\x1b[2Jgone"


@given(st.text())
def test_any_message_is_one_printable_line(message: str) -> None:
    line = one_line(RuntimeError(message))
    assert line.startswith("RuntimeError")
    assert "\n" not in line and "\r" not in line and "\x1b" not in line
    assert line == " ".join(line.split())  # no run of whitespace, none at either end
