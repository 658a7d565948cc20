"""The signs that a run has gone wrong (docs/health.md), evaluated on each round's record.

A sign compares one metric of the round with its threshold in the spec's ``health``
section (``entropy`` below ``health.entropy``, ``clipfrac`` above ``health.clipfrac``, ...);
it fires on a round when its condition has held on that round and the ``health.rounds - 1``
rounds before it, and keeps firing while the condition holds. The gradient-norm sign
compares the norm with its median over the ``health.grad_window`` rounds before; the
stale-push sign compares the round's mismatch with its median over those rounds, and fires
on the one round (a push is skipped once).

Pure: plain floats in (the record a round writes to ``metrics.jsonl``, after its one host
read, and the records before it), the fired signs out. A run writes ``health/<sign>: 1.0``
into the record of each round a sign fires on; :func:`fired_signs` reads them back.
Imports neither torch nor the trainer, so it reads any run's ``metrics.jsonl``.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ppokit.spec import HealthSpec

__all__ = ["NO_SIGNAL", "PREFIX", "SIGNS", "Fired", "Sign", "check", "condition", "fired_signs"]
__all__ += ["solved", "warning"]

#: The key of a sign in a round's record: ``health/<sign>``.
PREFIX = "health/"

Record = Mapping[str, Any]


@dataclass(frozen=True)
class Sign:
    """One sign: its ``name`` (the field of the ``health`` section holding its threshold,
    and ``health/<name>`` in the records), the ``metric`` it reads, whether it fires
    ``above`` the threshold (else below), how the warning names the value it compares
    (``{metric}`` and ``{value}`` filled in), and whether its condition must hold for
    ``health.rounds`` rounds in a row (``persistent``) or fires on the one round."""

    name: str
    metric: str
    above: bool
    shows: str = "{metric} {value:.3g}"
    persistent: bool = True

    @property
    def key(self) -> str:
        return PREFIX + self.name


#: The rows' staleness (asynchronous rollouts): the engine's μ then differs from π_old by
#: the updates between them, and the mismatch signs are not evaluated.
STALENESS = "rollout/staleness_max"
#: Every sign, in the order of docs/health.md.
SIGNS: tuple[Sign, ...] = (
    Sign("zero_variance", "rollout/zero_variance_groups", above=True),
    Sign("constant_reward", "reward_std", above=False),
    Sign("entropy", "entropy", above=False),
    Sign("clipfrac", "clipfrac", above=True),
    Sign("approx_kl", "approx_kl", above=True),
    Sign("grad_spike", "grad_norm_actor", True, "{metric} {value:.3g} times its recent median"),
    Sign("mismatch", "rollout/mismatch_k3", above=True),
    Sign(
        "stale_push",
        "rollout/mismatch_k3",
        True,
        "{metric} {value:.3g} above its recent median",
        persistent=False,
    ),
    Sign("truncated", "truncated_frac", above=True),
)


@dataclass(frozen=True)
class Fired:
    """A sign that fires on a round: the value its condition read (for ``grad_spike`` the
    ratio to the median), its threshold, and whether it starts firing on this round."""

    sign: Sign
    value: float
    threshold: float
    started: bool


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _trained(records: Sequence[Record]) -> list[Record]:
    """The records of training rounds (round 0, an evaluation only, is none)."""
    return [r for r in records if r.get("round") != 0]


def condition(
    sign: Sign, record: Record, before: Sequence[Record], health: HealthSpec
) -> float | None:
    """The value of ``sign`` on ``record`` when its condition holds there, else None (it
    does not hold, the sign is off, or the record has no value). ``before``: the training
    records before it, oldest first (the gradient norm's median reads them)."""
    threshold = getattr(health, sign.name)
    value = _number(record.get(sign.metric))
    if threshold is None or value is None:
        return None
    if sign.name in ("mismatch", "stale_push") and (_number(record.get(STALENESS)) or 0) > 0:
        return None  # asynchronous: μ is older weights' by design, not a drifting engine
    if sign.name == "stale_push":  # the jump over the engine's usual mismatch
        gaps = [_number(r.get(sign.metric)) for r in before]
        recent = [v for v in gaps if v is not None][-health.grad_window :]
        if not recent:
            return None
        value -= statistics.median(recent)
    if sign.name == "grad_spike":
        norms = [_number(r.get(sign.metric)) for r in before]
        window = [v for v in norms if v is not None][-health.grad_window :]
        if len(window) < health.grad_window or statistics.median(window) <= 0:
            return None
        value /= statistics.median(window)
    holds = value > threshold if sign.above else value < threshold
    return value if holds else None


#: The signs of a round with nothing to learn from, which a solved task also shows.
NO_SIGNAL = ("constant_reward", "zero_variance")


def solved(record: Record, history: Sequence[Record], health: HealthSpec) -> bool:
    """Whether ``record``'s round looks solved rather than without signal: every response
    scored the same (``reward_std`` below ``health.constant_reward``, 1e-6 when that sign is
    off), and that score is the best ``reward_mean`` of the run so far and above its first
    round's (the reward rose to it). Then the signs of :data:`NO_SIGNAL` stay quiet."""
    std = _number(record.get("reward_std"))
    value = _number(record.get("reward_mean"))
    bound = health.constant_reward if health.constant_reward is not None else 1e-6
    if std is None or value is None or std >= bound:
        return False
    means = [m for r in _trained(history) if (m := _number(r.get("reward_mean"))) is not None]
    return bool(means) and value > means[0] and value >= max(means)


def check(record: Record, history: Sequence[Record], health: HealthSpec) -> list[Fired]:
    """The signs that fire on ``record``, the round just run, given the records before it
    (``history``, oldest first; round 0 is skipped): each whose condition held on it and on
    the ``health.rounds - 1`` training rounds before. ``started``: it did not fire on the
    round before (the condition held exactly ``health.rounds`` rounds in a row)."""
    if not health.enabled:
        return []
    quiet = NO_SIGNAL if solved(record, history, health) else ()
    recent = history[-(health.rounds + health.grad_window + 1) :]  # round 0 included
    before = _trained(recent)[-(health.rounds + health.grad_window) :]
    rounds = [*before, record]
    fired = []
    for sign in SIGNS:
        value = None if sign.name in quiet else condition(sign, record, before, health)
        if value is None:
            continue
        needed = health.rounds if sign.persistent else 1
        streak = 1
        while streak <= needed and streak < len(rounds):  # one more: did it start?
            i = len(rounds) - 1 - streak
            if condition(sign, rounds[i], rounds[:i], health) is None:
                break
            streak += 1
        if streak >= needed:
            threshold = getattr(health, sign.name)
            fired.append(Fired(sign, value, threshold, started=streak == needed))
    return fired


def warning(fired: Fired, health: HealthSpec) -> str:
    """The line a run shows when a sign starts firing, e.g. ``health: entropy 0.00042 below
    health.entropy (0.001) for 5 rounds: see docs/health.md#entropy``."""
    sign = fired.sign
    value = sign.shows.format(metric=sign.metric, value=fired.value)
    side = "above" if sign.above else "below"
    needed = health.rounds if sign.persistent else 1
    rounds = f"{needed} rounds" if needed > 1 else "1 round"
    return (
        f"health: {value} {side} health.{sign.name} ({fired.threshold:g}) for {rounds}: "
        f"see docs/health.md#{sign.name}"
    )


def fired_signs(history: Sequence[Record]) -> dict[str, tuple[int, int]]:
    """Each sign that fired in ``history`` (the records of a run): (the first round it fired
    on, the number of rounds it fired on), in the order of :data:`SIGNS`."""
    found: dict[str, tuple[int, int]] = {}
    for sign in SIGNS:
        rounds = [int(r["round"]) for r in history if r.get(sign.key) == 1 and "round" in r]
        if rounds:
            found[sign.name] = (rounds[0], len(rounds))
    return found
