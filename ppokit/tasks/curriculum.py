"""A curriculum's levels (:class:`Levels`): attributes whose levels rise, one at a time, as
the reward does. Pure bookkeeping, without reasoning-gym: the reasoning_gym source
(:mod:`ppokit.tasks.reasoning_gym`) turns the levels into a generator's configuration.

Every attribute starts at level 0. After each round the source hears the round's mean
reward; the last ``window`` of them since the levels last changed are kept. When there are
``window`` of them and their mean is at least ``threshold``, the next attribute in turn
(round-robin, in the curriculum's order, skipping those at their last level) goes up one
level and the kept rewards are dropped. Once every attribute is at its last level nothing
changes. The levels, the attribute whose turn it is and the kept rewards are the state: a
run resumed from it moves its levels exactly as the uninterrupted run would.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ppokit.errors import UserError

__all__ = ["Levels"]


class Levels:
    """The levels of the attributes ``sizes`` names (each with its number of levels)."""

    def __init__(self, sizes: Mapping[str, int], threshold: float, window: int) -> None:
        if not sizes or any(n < 1 for n in sizes.values()) or window < 1:
            raise ValueError(f"a curriculum needs attributes with levels, got {dict(sizes)}")
        self.sizes = dict(sizes)
        self.threshold, self.window = float(threshold), int(window)
        self.levels = dict.fromkeys(self.sizes, 0)
        self.turn = 0  # the index (in sizes) of the attribute to raise next
        self.history: list[float] = []  # the last rewards at the current levels

    def done(self) -> bool:
        """Whether every attribute is at its last level."""
        return all(self.levels[a] == n - 1 for a, n in self.sizes.items())

    def observe(self, reward: float) -> str | None:
        """One round's mean reward; the attribute raised on it, or None."""
        if self.done() or not math.isfinite(reward):
            return None
        self.history = [*self.history, float(reward)][-self.window :]
        if len(self.history) < self.window or sum(self.history) / self.window < self.threshold:
            return None
        names = list(self.sizes)
        for step in range(len(names)):
            name = names[(self.turn + step) % len(names)]
            if self.levels[name] < self.sizes[name] - 1:
                self.levels[name] += 1
                self.turn = (self.turn + step + 1) % len(names)
                self.history = []
                return name
        return None  # pragma: no cover: done() said an attribute can rise

    def state_dict(self) -> dict[str, Any]:
        return {"levels": dict(self.levels), "turn": self.turn, "history": list(self.history)}

    def load_state_dict(self, state: Any) -> None:
        """The state :meth:`state_dict` gave; a one-line error when it does not fit these
        attributes."""
        try:
            levels, turn, history = state["levels"], state["turn"], state["history"]
            if set(levels) != set(self.sizes):
                raise ValueError(
                    f"attributes {sorted(levels)}, the curriculum's {sorted(self.sizes)}"
                )
            if not all(type(v) is int and 0 <= v < self.sizes[a] for a, v in levels.items()):
                raise ValueError(f"levels {levels} out of range")
            if type(turn) is not int or not 0 <= turn < len(self.sizes):
                raise ValueError(f"turn {turn!r} out of range")
            kept = [float(r) for r in history][-self.window :]
        except (KeyError, TypeError, ValueError) as exc:
            raise UserError(f"the checkpoint's curriculum does not fit the spec's: {exc}") from None
        self.levels = {a: levels[a] for a in self.sizes}
        self.turn, self.history = turn, kept
