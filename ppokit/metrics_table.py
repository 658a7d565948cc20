"""The table of metrics: every metric a run logs, written once as data.

Each :class:`Metric` says what a ``metrics.jsonl`` key is (its label and short label), which
way it is better (``higher``, ``lower`` or ``none``: the policy loss, KL or an entropy have
no "best") and where it appears: in every metrics line (``required``), on the live progress
line (``shown``, a priority), as a panel of curves.png (``curve``), as a row of the summary
table (``summary``), among the timings that comparing runs leaves out (``timing``). The
metrics log, curves.png, the live display, the summary table and ``ppokit compare`` derive
their lists from here, in the table's order.

A component reports its own diagnostics: its catalogue entry lists them
(``Component(..., metrics=(Metric("rollout/my_ratio", "mean ratio"),))``) and its
implementation returns them from an optional ``metrics(batch, out)`` member; :func:`metric`
finds a declared one by name (:func:`declare`). Any other key under a component prefix
(``rollout/``, ``policy/``, ``critic/``, ``advantage/``, ``reward/``) is accepted with a
default label, so a paper's new metric needs no edit here.

Torch-free and import-light: ``ppokit compare`` reads it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "ACCURACY",
    "COMPONENT_PREFIXES",
    "CURRICULUM",
    "CURVES",
    "EVAL_CURVES",
    "EVAL_PREFIX",
    "EVAL_PROMPTS",
    "FLOPS",
    "FLOPS_GENERATE",
    "FLOP_PHASES",
    "METRICS",
    "MFU",
    "REQUIRED",
    "REWARD",
    "ROUND",
    "ROUND_TIME",
    "SHOWN",
    "SUMMARY",
    "THROUGHPUT",
    "TIMING",
    "Metric",
    "best_direction",
    "declare",
    "known",
    "metric",
]

Direction = Literal["higher", "lower", "none"]


@dataclass(frozen=True)
class Metric:
    """One metric of a run. A ``name`` ending in ``@`` or ``/`` is a family (``eval/pass@``
    is every ``eval/pass@k``, ``health/`` every ``health/<sign>``)."""

    name: str
    #: what the value is, with its unit (curves.png's y-axis)
    label: str
    #: the live line's name for it ("" where not shown)
    short: str = ""
    direction: Direction = "none"
    #: a key of every metrics line (None when the run has no such quantity)
    required: bool = False
    #: its priority on the live line (the highest number is dropped first); None: not shown
    shown: int | None = None
    #: a panel of curves.png
    curve: bool = False
    #: a row of the summary table at the end of a run
    summary: bool = False
    #: a time or memory measurement (left out when runs are compared for equality)
    timing: bool = False

    def matches(self, key: str) -> bool:
        family = self.name.endswith(("@", "/"))
        return key == self.name or (family and key.startswith(self.name))


def _m(name: str, label: str, **facts: object) -> Metric:
    return Metric(name, label, **facts)  # type: ignore[arg-type]


#: The metrics the views name by their role (each the name of its row below): the round a
#: line is of, the reward a run optimises, the held-out accuracy and the number of prompts it
#: rests on, the generation throughput and a round's seconds; and the held-out evaluation's
#: prefix.
ROUND = "round"
REWARD = "reward_mean"
ACCURACY = "eval/accuracy"
EVAL_PROMPTS = "eval/prompts"
THROUGHPUT = "tokens_per_s"
ROUND_TIME = "time_round"
EVAL_PREFIX = "eval/"
#: The prefix of a prompt source's curriculum levels (``curriculum/<attribute>``).
CURRICULUM = "curriculum/"
#: The phases whose model FLOPs a round counts (docs/speed.md): each phase's FLOPs, its
#: seconds, and its model FLOP utilisation (FLOPs over seconds over the device's peak).
FLOP_PHASES = ("generate", "logprob", "update")
FLOPS = {p: f"flops_{p}" for p in FLOP_PHASES}
MFU = {p: f"mfu_{p}" for p in FLOP_PHASES}
FLOPS_GENERATE = FLOPS["generate"]

#: Every metric of a run, in the order the views list them.
METRICS: tuple[Metric, ...] = (
    _m(ROUND, "round", required=True),
    _m(
        REWARD,
        "mean reward",
        short="reward",
        direction="higher",
        required=True,
        shown=0,
        curve=True,
        summary=True,
    ),
    _m("reward_std", "reward standard deviation", required=True),
    _m(
        ACCURACY,
        "greedy accuracy (95% CI)",
        short="eval acc",
        direction="higher",
        shown=1,
        curve=True,
    ),
    _m("eval/accuracy_ci95", "half-width of the accuracy's 95% Wilson interval"),
    _m("eval/pass@", "fraction of prompts", direction="higher", curve=True),
    _m("eval/reward_mean", "mean reward (sampled)", direction="higher", curve=True),
    _m("eval/response_length_mean", "tokens"),
    _m(EVAL_PROMPTS, "prompts evaluated"),
    _m(
        "response_length_mean",
        "tokens",
        short="len",
        required=True,
        shown=3,
        curve=True,
        summary=True,
    ),
    _m("response_length_below_group", "tokens, responses below their group's mean reward"),
    _m("response_length_above_group", "tokens, responses above their group's mean reward"),
    _m("truncated_frac", "fraction of responses", required=True),
    _m("kl", "KL to the reference", short="kl", required=True, shown=2, curve=True, summary=True),
    _m("kl_coef", "KL coefficient β", required=True, summary=True),
    _m("entropy", "nats per token", short="ent", required=True, shown=5, curve=True, summary=True),
    _m("policy_loss", "actor loss", required=True, summary=True),
    _m(
        "value_loss",
        "critic loss",
        short="vloss",
        direction="lower",
        required=True,
        shown=4,
        curve=True,
        summary=True,
    ),
    _m(
        "value_error",
        "mean |V - target|",
        direction="lower",
        required=True,
        curve=True,
        summary=True,
    ),
    _m(
        "explained_variance",
        "explained variance of the targets",
        direction="higher",
        required=True,
        summary=True,
    ),
    _m(
        "clipfrac",
        "fraction of tokens",
        short="clip",
        required=True,
        shown=6,
        curve=True,
        summary=True,
    ),
    _m("ratio_outside", "fraction of tokens with π/π_old outside the clip band"),
    _m("vf_clipfrac", "fraction of positions", required=True),
    _m("approx_kl", "KL(π_old ‖ π) per token", required=True),
    _m("advantage_mean", "mean advantage per token"),
    _m("grad_norm_actor", "gradient norm", required=True, curve=True, summary=True),
    _m("grad_norm_critic", "gradient norm", required=True, summary=True),
    _m("skipped_steps", "optimizer steps skipped"),
    _m(
        "rollout/kept_groups",
        "groups kept by rollout.filter",
        short="kept",
        shown=7,
        curve=True,
        summary=True,
    ),
    _m("rollout/generated_groups", "groups generated", curve=True, summary=True),
    _m("rollout/generation_batches", "generation batches", summary=True),
    _m(
        "rollout/turns_mean",
        "model turns per episode",
        short="turns",
        shown=8,
        curve=True,
        summary=True,
    ),
    _m("rollout/env_tokens_mean", "environment tokens per episode", summary=True),
    _m("rollout/ended_done", "fraction of episodes the environment ended", summary=True),
    _m("rollout/ended_max_turns", "fraction of episodes ended by rollout.max_turns"),
    _m("rollout/ended_budget", "fraction of episodes ended by the token budget"),
    _m("rollout/passed_groups", "groups that passed rollout.filter"),
    _m("rollout/kept_reward_mean", "mean reward of the kept groups", direction="higher"),
    _m(
        "rollout/zero_variance_groups",
        "fraction of groups with rewards all equal",
        direction="lower",
    ),
    _m("rollout/exhausted", "the bound ended the drawing (1) or not (0)"),
    _m("rollout/mismatch_k1", "KL(μ ‖ π_old) per token (k1)"),
    _m("rollout/mismatch_k3", "KL(μ ‖ π_old) per token (k3)"),
    _m("rollout/mismatch_max", "max |log π_old − log μ|"),
    _m("rollout/mismatch_outside", "fraction of tokens with π_old/μ outside the clip band"),
    _m(
        "rollout/mismatch_ess",
        "effective sample size of the weights π_old/μ, a fraction of the tokens",
        direction="higher",
    ),
    _m("rollout/staleness_mean", "updates between the sampling weights and the update's"),
    _m("rollout/staleness_max", "most updates between the sampling weights and the update's"),
    _m(
        CURRICULUM,
        "the prompt source's curriculum level of an attribute, after the round "
        "(data.source.curriculum)",
    ),
    _m("health/", "a sign of docs/health.md fired (1; absent: it did not)", direction="lower"),
    _m(THROUGHPUT, "tokens per second", required=True, summary=True, timing=True),
    _m("peak_memory_gb", "GiB", timing=True),
    _m(FLOPS["generate"], "model FLOPs of the round's generation (docs/speed.md)"),
    _m(FLOPS["logprob"], "model FLOPs of the round's no-grad forward passes"),
    _m(FLOPS["update"], "model FLOPs of the round's update, forward and backward"),
    _m(MFU["generate"], "generation's model FLOP utilisation (of the measured peak)", timing=True),
    _m(MFU["logprob"], "the no-grad passes' model FLOP utilisation", timing=True),
    _m(MFU["update"], "the update's model FLOP utilisation", summary=True, timing=True),
    _m("time_generate", "seconds", required=True, timing=True),
    _m("time_score", "seconds (the scoring generation did not hide)", required=True, timing=True),
    _m("time_discarded", "seconds generating a batch ahead the round did not need", timing=True),
    _m("time_logprob", "seconds", required=True, timing=True),
    _m("time_update", "seconds", required=True, timing=True),
    _m("time_sync", "seconds", timing=True),
    _m("time_wait_engine", "seconds the trainer waited for the engine", timing=True),
    _m("time_wait_trainer", "seconds the engine waited for the trainer", timing=True),
    _m(ROUND_TIME, "seconds", required=True, summary=True, timing=True),
    _m("time_eval", "seconds", timing=True),
)

#: Prefixes of the metrics components report: any key under one is accepted.
COMPONENT_PREFIXES = ("rollout/", "policy/", "critic/", "advantage/", "reward/")

_DECLARED: dict[str, Metric] = {}


def declare(metrics: Iterable[Metric]) -> None:
    """Make metrics a component declares known to :func:`metric` (a name of the table keeps
    its row)."""
    for m in metrics:
        _DECLARED.setdefault(m.name, m)


def metric(key: str) -> Metric:
    """The row of ``key``: the table's, a family's (``eval/pass@4``), a component's declared
    one, or a default (``reward/<name>``, one reward of several, is better higher)."""
    for m in METRICS:
        if m.matches(key):
            return m
    if key in _DECLARED:
        return _DECLARED[key]
    if key.startswith("reward/"):
        return Metric(key, f"mean reward of {key.removeprefix('reward/')}", direction="higher")
    return Metric(key, key)


def known(key: str) -> bool:
    """Whether ``key`` is a metric the table, a family of it or a registered component
    declares (not only the default row :func:`metric` gives any key)."""
    return any(m.matches(key) for m in METRICS) or key in _DECLARED


def best_direction(key: str) -> Literal["max", "min"] | None:
    """Which way ``key`` is better: ``max``, ``min`` or None (no better direction)."""
    return {"higher": "max", "lower": "min", "none": None}[metric(key).direction]


def _names(flag: str) -> tuple[str, ...]:
    return tuple(m.name for m in METRICS if getattr(m, flag))


#: Keys every metrics line carries (None when a run has no such quantity).
REQUIRED = _names("required")
#: Timing and memory measurements (excluded when comparing runs).
TIMING = _names("timing")
#: Panels of curves.png (training), then the held-out evaluation's (``eval/pass@``: every
#: ``eval/pass@k``), drawn where the history has values.
CURVES = tuple(n for n in _names("curve") if not n.startswith(EVAL_PREFIX))
EVAL_CURVES = tuple(n for n in _names("curve") if n.startswith(EVAL_PREFIX))
#: (key, short name, priority) of the live progress line, in order.
SHOWN = tuple((m.name, m.short, m.shown) for m in METRICS if m.shown is not None)
#: Rows of the summary table, in order (the evaluation's follow the reward).
SUMMARY = _names("summary")
