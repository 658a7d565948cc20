"""Non-finite values caught before they reach a parameter (docs/design.md, "The trainer's
boundary and bad numbers"): :class:`NonFinite` counts NaNs and infs on the device and reads
them back once, :class:`Guard` decides what a bad value does to the run
(``train.on_nonfinite``).

A counter is made active for a stretch of a round with ``with counting() as checks:``; every
component's checked wrapper counts its own result into the active counter under its slot
(:func:`count`), so the trainer adds by hand only what it computes itself (forward passes,
losses, gradient norms). Outside such a stretch (an evaluation) nothing is counted.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch import Tensor

from ppokit import distributed
from ppokit.errors import NonFiniteError

__all__ = ["Guard", "NonFinite", "count", "counting"]


class NonFinite:
    """NaN and inf counts of named tensors, summed on the device and read back in one
    transfer (:meth:`read_problem`).

    ``add(label, x)`` counts ``x``'s non-finite entries under ``label`` (a component in its
    slot, ``the actor's loss``, ...); labels keep the order they were first added in, the
    order the values arise in a round, so the first bad label is where a NaN appeared
    (everything computed from it is NaN too).
    """

    def __init__(self) -> None:
        self.counts: dict[str, Tensor] = {}
        self.sizes: dict[str, int] = {}
        self.forms: dict[str, tuple[str, str]] = {}

    def add(self, label: str, x: Tensor, unit: str = "positions", source: str = "") -> None:
        """Count ``x``'s NaNs and infs under ``label``. A scalar (a loss, a norm) is
        reported as ``label is NaN (source)``, anything else as ``label produced NaN at n
        of N unit``."""
        x = x.detach()
        count = torch.stack([torch.isnan(x).sum(), torch.isinf(x).sum()])
        previous = self.counts.get(label)
        self.counts[label] = count if previous is None else previous + count
        self.sizes[label] = self.sizes.get(label, 0) + x.numel()
        self.forms[label] = (unit, source)

    def read_problem(self) -> str | None:
        """The first label with a non-finite value, as a message (one host read), or None."""
        if not self.counts:
            return None
        counts = list(self.counts.values())
        # a reward's scores are counted where it made them (the host): one device for all
        device = next((c.device for c in counts if c.device.type != "cpu"), counts[0].device)
        stacked = torch.stack([c.to(device) for c in counts])
        # summed over the processes, so that every process takes the same decision
        values = distributed.all_sum(stacked).tolist()
        for label, (nan, inf) in zip(self.counts, values, strict=True):
            if nan or inf:
                return self._message(label, nan, inf)
        return None

    def _message(self, label: str, nan: int, inf: int) -> str:
        unit, source = self.forms[label]
        if unit == "scalar":  # a loss or a norm (of its source), or an aggregation's value
            value = "NaN" if nan else "inf"
            return f"{label} is {value} ({source})" if source else f"{label} produced {value}"
        found = " and ".join(f"{name} at {n}" for name, n in (("NaN", nan), ("inf", inf)) if n)
        return f"{label} produced {found} of {self.sizes[label]} {unit}"


class Guard:
    """What a caught non-finite value does: ``on_nonfinite: stop`` raises
    :class:`NonFiniteError`; ``skip`` counts it and returns the message, until
    ``max_skipped_steps`` in a row (``bad_in_row``) raise."""

    def __init__(self, on_nonfinite: str, max_skipped_steps: int) -> None:
        self.on_nonfinite = on_nonfinite
        self.max_skipped_steps = max_skipped_steps
        self.bad_in_row = 0

    def __call__(self, round_no: int, problem: str, consequence: str) -> str:
        """Raise, or count the problem and return its message with ``consequence``."""
        message = f"round {round_no}: {problem}"
        if self.on_nonfinite == "stop":
            raise NonFiniteError(message)
        self.bad_in_row += 1
        if self.bad_in_row >= self.max_skipped_steps:
            raise NonFiniteError(
                f"{message}; {self.bad_in_row} in a row (train.max_skipped_steps: "
                f"{self.max_skipped_steps})"
            )
        return f"{message}: {consequence}"

    def good(self) -> None:
        """A step was taken: the count in a row starts again."""
        self.bad_in_row = 0


#: The counter of the stretch of a round being run (None outside one).
_ACTIVE: ContextVar[NonFinite | None] = ContextVar("ppokit_nonfinite", default=None)


@contextmanager
def counting(into: NonFinite | None = None) -> Iterator[NonFinite]:
    """A new :class:`NonFinite` (or ``into``: one that goes on counting), the active
    counter until the block ends."""
    checks = into if into is not None else NonFinite()
    token = _ACTIVE.set(checks)
    try:
        yield checks
    finally:
        _ACTIVE.reset(token)


def count(label: str, x: Tensor, unit: str = "positions", source: str = "") -> None:
    """``NonFinite.add`` on the active counter; nothing outside :func:`counting`."""
    checks = _ACTIVE.get()
    if checks is not None:
        checks.add(label, x, unit, source)
