"""The tagged encoding of plain values, the one thing that crosses out of the ``code_tests``
sandbox (:mod:`ppokit.components.reward.sandbox`): :func:`encode` there, :func:`decode` in
ppokit's process, which builds only built-in values and runs no other code.

Its functions run inside the sandbox too (their source is part of
:data:`~ppokit.components.reward.harness.HARNESS`): they use only builtins and the constants
below, and this module imports nothing but the names its annotations use.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: The most bytes of answers read from one sandbox (and the most one answer may take).
REPORT_BYTES = 1 << 20
#: The deepest nesting of lists, tuples, dicts and sets an answer may have.
MAX_DEPTH = 100


def encode(value: Any, budget: list[int], depth: int = 0) -> list[Any]:
    """``value`` as JSON-able tagged data of plain built-in values: None, bool, int,
    float, complex, str, bytes, list, tuple, dict, set, frozenset, nested at most MAX_DEPTH
    deep; a subclass of one of them (a bytearray too) as its built-in base, read with the
    base's own methods (its ``__eq__`` stays behind). Anything else, or more than
    ``budget[0]`` characters, raises ValueError."""
    if depth > MAX_DEPTH:
        raise ValueError("nested too deep")
    budget[0] -= 8
    tagged: list[Any]
    if value is None:
        tagged = ["n"]
    elif value is True or value is False:
        tagged = ["b", value is True]
    elif isinstance(value, int):
        tagged = ["i", hex(int.__index__(value))]
    elif isinstance(value, float):
        tagged = ["f", float.hex(value)]
    elif isinstance(value, complex):
        real, imag = complex.real.__get__, complex.imag.__get__  # type: ignore[attr-defined]
        tagged = ["c", [float.hex(real(value)), float.hex(imag(value))]]
    elif isinstance(value, str):
        tagged = ["s", str.__str__(value)]
    elif isinstance(value, bytes):
        tagged = ["y", bytes.hex(value)]
    elif isinstance(value, bytearray):
        tagged = ["y", bytearray.hex(value)]
    elif isinstance(value, dict):
        pairs = dict.items(value)
        tagged = [
            "d",
            [[encode(k, budget, depth + 1), encode(v, budget, depth + 1)] for k, v in pairs],
        ]
    else:
        for kind, tag in ((list, "l"), (tuple, "t"), (set, "S"), (frozenset, "F")):
            if isinstance(value, kind):
                members = kind.__iter__(value)  # type: ignore[attr-defined,arg-type]
                return [tag, [encode(v, budget, depth + 1) for v in members]]
        raise ValueError("not a plain value: " + type(value).__name__)
    if len(tagged) == 2 and isinstance(tagged[1], str):
        budget[0] -= len(tagged[1])
    if budget[0] < 0:
        raise ValueError("too large")
    return tagged


def decode(data: Any, depth: int = 0) -> Any:
    """The plain value ``data`` (from :func:`encode`, via ``json.loads``) stands for; builds
    only built-in values and runs no other code. Malformed data raises ValueError (or
    TypeError: an unhashable member of a set or key of a dict)."""
    if depth > MAX_DEPTH:
        raise ValueError("nested too deep")
    if type(data) is not list or not data or type(data[0]) is not str:
        raise ValueError("not an encoded value")
    tag = data[0]
    if tag == "n" and len(data) == 1:
        return None
    if len(data) != 2:
        raise ValueError("not an encoded value")
    arg = data[1]
    if tag == "b" and type(arg) is bool:
        return arg
    if tag in ("i", "f", "s", "y") and type(arg) is str:
        if tag == "i":
            return int(arg, 16)  # base 16: linear time whatever its length
        if tag == "f":
            return float.fromhex(arg)
        return arg if tag == "s" else bytes.fromhex(arg)
    if type(arg) is not list:
        raise ValueError("not an encoded value")
    if tag == "c" and len(arg) == 2 and type(arg[0]) is str and type(arg[1]) is str:
        return complex(float.fromhex(arg[0]), float.fromhex(arg[1]))
    if tag == "d":
        pairs = []
        for pair in arg:
            if type(pair) is not list or len(pair) != 2:
                raise ValueError("not an encoded value")
            pairs.append((decode(pair[0], depth + 1), decode(pair[1], depth + 1)))
        refuse_shared_hashes([key for key, _ in pairs])
        return dict(pairs)
    kinds: dict[str, Callable[[list[Any]], Any]] = {
        "l": list,
        "t": tuple,
        "S": set,
        "F": frozenset,
    }
    if tag in kinds:
        items = [decode(item, depth + 1) for item in arg]
        if tag in ("S", "F"):
            refuse_shared_hashes(items)
        return kinds[tag](items)
    raise ValueError("not an encoded value")


def refuse_shared_hashes(items: list[Any]) -> None:
    """Refuse members of a set (keys of a dict) many of which share a hash (ints chosen
    equal modulo 2**61 - 1 would make building it quadratic)."""
    if len(items) - len({hash(item) for item in items}) > 64:
        raise ValueError("too many equal hashes")
