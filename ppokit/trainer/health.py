"""The signs that a run has gone wrong (docs/health.md), evaluated on each round's record.

A sign compares one metric of the round with its threshold in the spec's ``health``
section (``entropy`` below ``health.entropy``, ``clipfrac`` above ``health.clipfrac``, ...);
it fires on a round when its condition has held on that round and the ``health.rounds - 1``
rounds before it, and keeps firing while the condition holds. The gradient-norm sign
compares the norm with its median over the ``health.grad_window`` rounds before; the
stale-push sign compares the round's mismatch with its median over those rounds, and fires
on the one round (a push is skipped once). The flat-reward sign reads every round so far:
the slope of ``reward_mean`` over them, in standard errors (a least-squares fit), from a
quarter of the run's rounds on; its warning names the likely causes the records show
(:func:`flat_causes`).

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
__all__ += ["flat_causes", "solved", "warning"]

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
    Sign(
        "flat_reward",
        "reward_mean",
        False,
        "the slope of {metric} over the rounds so far, {value:.2g} standard errors,",
    ),
)
#: The flat-reward sign is evaluated from this fraction of the run's rounds on ...
FLAT_AFTER = 0.25
#: ... and from this round on (a slope and its error need a few rounds).
FLAT_FROM = 6
#: A mean ``approx_kl`` below this with a gradient: the update barely moves the policy.
STILL_KL = 1e-6
#: A share of all-equal groups from which they are named as a cause of a flat reward.
NO_VARIANCE = 0.5


@dataclass(frozen=True)
class Fired:
    """A sign that fires on a round: the value its condition read (for ``grad_spike`` the
    ratio to the median), its threshold, and whether it starts firing on this round."""

    sign: Sign
    value: float
    threshold: float
    started: bool
    causes: tuple[str, ...] = ()


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _trained(records: Sequence[Record]) -> list[Record]:
    """The records of training rounds (round 0, an evaluation only, is none)."""
    return [r for r in records if r.get("round") != 0]


def _slope_errors(values: Sequence[float]) -> float:
    """The least-squares slope of ``values`` over their index, in its standard errors
    (its t statistic): 0 for values all equal, infinite for a line without scatter."""
    n = len(values)
    mx, my = (n - 1) / 2, statistics.fmean(values)
    sxx = sum((i - mx) ** 2 for i in range(n))
    slope = sum((i - mx) * (v - my) for i, v in enumerate(values)) / sxx
    scatter = sum((v - my - slope * (i - mx)) ** 2 for i, v in enumerate(values)) / (n - 2)
    if scatter <= 1e-24 * max(1.0, my * my):
        return 0.0 if abs(slope) <= 1e-12 * max(1.0, abs(my)) else float("inf")
    return slope / (scatter / sxx) ** 0.5


def condition(
    sign: Sign,
    record: Record,
    before: Sequence[Record],
    health: HealthSpec,
    total: int | None = None,
) -> float | None:
    """The value of ``sign`` on ``record`` when its condition holds there, else None (it
    does not hold, the sign is off, or the record has no value). ``before``: the training
    records before it, oldest first (the gradient norm's median reads them, the flat
    reward's slope all of them); ``total``: the run's rounds (the flat reward is evaluated
    from :data:`FLAT_AFTER` of them on; None: not evaluated)."""
    threshold = getattr(health, sign.name)
    value = _number(record.get(sign.metric))
    if threshold is None or value is None:
        return None
    if sign.name == "flat_reward":
        rewards = [v for r in before if (v := _number(r.get(sign.metric))) is not None]
        rewards.append(value)
        if total is None or len(rewards) < max(FLAT_FROM, FLAT_AFTER * total):
            return None
        value = abs(_slope_errors(rewards))
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


def check(
    record: Record, history: Sequence[Record], health: HealthSpec, total: int | None = None
) -> list[Fired]:
    """The signs that fire on ``record``, the round just run, given the records before it
    (``history``, oldest first; round 0 is skipped): each whose condition held on it and on
    the ``health.rounds - 1`` training rounds before. ``started``: it did not fire on the
    round before (the condition held exactly ``health.rounds`` rounds in a row).
    ``total``: the run's rounds (``train.rounds``), which the flat-reward sign needs."""
    if not health.enabled:
        return []
    quiet = (*NO_SIGNAL, "flat_reward") if solved(record, history, health) else ()
    recent = history[-(health.rounds + health.grad_window + 1) :]  # round 0 included
    window = _trained(recent)[-(health.rounds + health.grad_window) :]
    fired = []
    for sign in SIGNS:
        before = _trained(history) if sign.name == "flat_reward" else window
        rounds = [*before, record]
        value = None if sign.name in quiet else condition(sign, record, before, health, total)
        if value is None:
            continue
        needed = health.rounds if sign.persistent else 1
        streak = 1
        while streak <= needed and streak < len(rounds):  # one more: did it start?
            i = len(rounds) - 1 - streak
            if condition(sign, rounds[i], rounds[:i], health, total) is None:
                break
            streak += 1
        if streak >= needed:
            threshold = getattr(health, sign.name)
            causes = flat_causes(rounds[-needed:], health) if sign.name == "flat_reward" else ()
            fired.append(Fired(sign, value, threshold, streak == needed, causes))
    return fired


def _mean(records: Sequence[Record], metric: str) -> float | None:
    values = [v for r in records if (v := _number(r.get(metric))) is not None]
    return statistics.fmean(values) if values else None


def flat_causes(records: Sequence[Record], health: HealthSpec) -> tuple[str, ...]:
    """The likely causes of a flat reward that ``records`` (the rounds the sign held on)
    show: groups without variance (their share from :data:`NO_VARIANCE` on, or every reward
    the same), an update that barely moves the policy though it has a gradient (mean
    ``approx_kl`` below :data:`STILL_KL`: a learning rate too small for these gradients),
    answers all truncated (``truncated_frac`` above ``health.truncated``, when that sign is
    on). None of them: the line says what was checked."""
    causes = []
    share = _mean(records, "rollout/zero_variance_groups")
    std = _mean(records, "reward_std")
    if share is not None and share >= NO_VARIANCE:
        causes.append(
            f"no variance in groups: {share:.0%} of groups have rewards all equal "
            "(rollout/zero_variance_groups), an advantage of 0"
        )
    elif std is not None and std < (health.constant_reward or 1e-6):
        causes.append(f"no variance: every response scored the same (reward_std {std:.2g})")
    kl, grad = _mean(records, "approx_kl"), _mean(records, "grad_norm_actor")
    if kl is not None and grad is not None and grad > 0 and kl < STILL_KL:
        causes.append(
            f"the update barely moves the policy: approx_kl {kl:.2g} per token with "
            f"grad_norm_actor {grad:.2g}, a learning rate too small for these gradients "
            "(train.actor_lr)"
        )
    cut = _mean(records, "truncated_frac")
    if cut is not None and health.truncated is not None and cut > health.truncated:
        causes.append(
            f"the answers are truncated: {cut:.0%} of responses cut by the length limit "
            "(truncated_frac)"
        )
    if not causes:
        causes.append(
            "none of those it measures (groups without variance, an update too small, "
            "truncated answers): check the reward on samples.jsonl"
        )
    return tuple(causes)


def warning(fired: Fired, health: HealthSpec) -> str:
    """The line a run shows when a sign starts firing, e.g. ``health: entropy 0.00042 below
    health.entropy (0.001) for 5 rounds: see docs/health.md#entropy``."""
    sign = fired.sign
    value = sign.shows.format(metric=sign.metric, value=fired.value)
    side = "above" if sign.above else "below"
    needed = health.rounds if sign.persistent else 1
    rounds = f"{needed} rounds" if needed > 1 else "1 round"
    likely = f"; likely: {'; '.join(fired.causes)}" if fired.causes else ""
    return (
        f"health: {value} {side} health.{sign.name} ({fired.threshold:g}) for {rounds}"
        f"{likely}: see docs/health.md#{sign.name}"
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
