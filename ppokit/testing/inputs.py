"""What the conformance properties share: the one-line counterexample (:class:`Violation`),
how inputs are written in it, and the inputs a component of an elementwise kind or an
aggregation is called with.

Imports torch, numpy and hypothesis: imported only when a check runs.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from hypothesis import strategies as st
from torch import Tensor

from ppokit.batch import RolloutBatch
from ppokit.components import KIND_PACKAGES
from ppokit.slots import KINDS

__all__ = [
    "FLOAT_FIELDS",
    "Args",
    "Violation",
    "call_args",
    "close",
    "elementwise_args",
    "first_bad",
    "mask_text",
    "number",
    "shape_of",
]

#: The [B, T] float fields of a RolloutBatch: what a padded position holds.
FLOAT_FIELDS = ("token_rewards", "values", "logp_old", "logp_rollout", "logp_ref")


class Violation(Exception):
    """A property that does not hold: its message is the counterexample, one line."""


def number(x: float) -> str:
    return f"{x:.4g}"


def mask_text(mask: Tensor) -> str:
    """``[110 100]``: a mask's rows as 1s and 0s."""
    rows = ["".join("1" if v else "0" for v in row) for row in (mask != 0).tolist()]
    return "[" + " ".join(rows) + "]"


def shape_of(x: Tensor) -> str:
    return "[" + ", ".join(str(s) for s in x.shape) + "]"


def first_bad(bad: Tensor) -> tuple[int, ...]:
    """The index of the first True element of ``bad``."""
    flat = int(torch.nonzero(bad.reshape(-1))[0, 0])
    return tuple(int(i) for i in np.unravel_index(flat, tuple(bad.shape)))


def close(a: Tensor, b: Tensor, where: Tensor | None = None, what: str = "the output") -> None:
    """``a`` equals ``b`` (where ``where`` is True), up to float32 rounding relative to the
    scale of ``b``; a :class:`Violation` naming the first position that differs."""
    a64, b64 = a.detach().double(), b.detach().double()
    if where is None:
        where = torch.ones(b.shape, dtype=torch.bool)
    scale = 1.0 + (b64[where].abs().max().item() if bool(where.any()) else 0.0)
    same = (a64 == b64) | ((a64 - b64).abs() <= 1e-5 * scale)
    bad = where & ~same
    if bool(bad.any()):
        i = first_bad(bad)
        raise Violation(
            f"{what} at {list(i)} changed from {number(b64[i].item())} to {number(a64[i].item())}"
        )


def call_args(kind: str, requires: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The argument names of a kind's call, read from the Protocol in its package: its
    required ones, and an optional one that names a batch field the component ``requires``
    (a KL estimator that requires ``logp_old`` is called with it)."""
    package = KIND_PACKAGES[KINDS.index(kind)]
    for obj in vars(package).values():
        if (
            isinstance(obj, type)
            and getattr(obj, "_is_protocol", False)
            and obj.__module__ == package.__name__
            and "__call__" in vars(obj)
        ):
            params = inspect.signature(obj.__call__).parameters.values()
            return tuple(
                p.name
                for p in params
                if p.name != "self" and (p.default is p.empty or p.name in requires)
            )
    raise LookupError(f"{kind} has no Protocol with __call__")


@dataclass
class Args:
    """The tensor arguments of an elementwise call or an aggregation, by name (``mask``
    bool); ``head`` is the regression loss's value-head output its ``pred`` is read from."""

    values: dict[str, Tensor]

    @property
    def mask(self) -> Tensor | None:
        return self.values.get("mask")

    @property
    def shape(self) -> tuple[int, int]:
        t = next(v for k, v in self.values.items() if k != "head")
        return int(t.shape[0]), int(t.shape[1])

    def text(self) -> str:
        b, t = self.shape
        out = f"B={b} T={t}"
        if self.mask is not None:
            out += f" mask={mask_text(self.mask)}"
        return out

    def map(self, fn: Callable[[str, Tensor], Tensor]) -> Args:
        return Args({k: fn(k, v) for k, v in self.values.items()})


def _draw_arg(rng: np.random.Generator, name: str, shape: tuple[int, ...]) -> Tensor:
    x = torch.from_numpy(rng.standard_normal(shape).astype(np.float32))
    if name.startswith("logp"):
        return -x.abs()
    return x


def elementwise_args(
    names: tuple[str, ...], *, head_size: int = 0, dtype: torch.dtype | None = None
) -> st.SearchStrategy[Args]:
    """Inputs of a call taking ``names`` ([B, T] floats; ``mask`` a bool [B, T]; with
    ``head_size``, ``pred`` replaced by ``head`` [B, T, head_size])."""

    @st.composite
    def draw(d: st.DrawFn) -> Args:
        rng = np.random.default_rng(d(st.integers(0, 2**31 - 1)))
        b, t = d(st.integers(1, 6)), d(st.integers(1, 8))
        chosen = dtype or d(st.sampled_from([torch.float32, torch.bfloat16]))
        out: dict[str, Tensor] = {}
        for name in names:
            if name == "denom":
                continue
            if name == "mask":
                out[name] = torch.from_numpy(rng.random((b, t)) < 0.7)
            elif name == "pred" and head_size:
                out["head"] = _draw_arg(rng, name, (b, t, head_size)).to(chosen)
            else:
                out[name] = _draw_arg(rng, name, (b, t)).to(chosen)
        return Args(out)

    return draw()


def batch_text(batch: RolloutBatch) -> str:
    b, t = batch.response_mask.shape
    return f"B={b} T={t} mask={mask_text(batch.response_mask)}"


def batch_fields(batch: RolloutBatch) -> dict[str, Any]:
    from ppokit.batch import FIELDS

    return {f: getattr(batch, f) for f in FIELDS if getattr(batch, f) is not None}
