"""The slot table: every component slot of a spec, and what a component's requirements ask
of the spec, written once as data.

The spec's models and validation, the trainer's assembly, ``explain``, the JSON Schema and
the generated docs all read these two tables:

- :data:`SLOTS`: path in the spec, kind, default component, symbol and description of each
  slot, in the order a PPO round uses them;
- :data:`SOURCE`: the same for ``data.source``, the prompt source, which no slot of SLOTS
  holds (its own forms: a data file's path, ``hf:owner/name``);
- :data:`FIELDS`: the optional :class:`~ppokit.batch.RolloutBatch` fields a component may
  declare in ``requires``, with their shape and dtype (``ppokit.batch`` builds its checks
  from them) and what the spec must hold for the trainer to fill them.

Nothing here imports torch, pydantic models of the spec or the registry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

#: A validated :class:`ppokit.spec.Spec` (the slot table sits below the spec's models, which
#: read it: named here, not imported).
Spec = Any

__all__ = ["FIELDS", "KINDS", "SLOTS", "SOURCE", "BatchField", "Slot", "field", "slot"]


@dataclass(frozen=True)
class Slot:
    """One component slot of the spec."""

    #: where it sits in the spec (``critic.target``); ``reward`` may be a list
    path: str
    #: the component kind it takes
    kind: str
    #: the component it holds when the spec leaves it out
    default: str
    #: the symbol of the objective it fills (``A``, ``Y``, ``ω`` ...)
    symbol: str
    description: str
    #: its role in ``explain``'s account of a round (``prompt weight ω``)
    label: str = ""
    #: the attribute of the trainer's ``Assembly`` that holds its component
    attribute: str = ""
    #: whether its component names its optional section where runs are compared
    #: (``critic=mse``: the critic's loss; ``kl=k3``: the KL estimator)
    names_section: bool = False

    @property
    def section(self) -> str | None:
        """The optional section the slot lives in (``critic``, ``kl``), or None."""
        head, dot, _ = self.path.partition(".")
        return head if dot else None

    @property
    def key(self) -> str:
        """The slot's own key inside its section (``target`` of ``critic.target``)."""
        return self.path.rpartition(".")[2]


#: Every component slot, in the order a round uses them.
SLOTS: tuple[Slot, ...] = (
    Slot(
        "rollout.engine",
        "rollout_engine",
        "hf",
        "μ",
        "what samples the responses (the behaviour policy μ) and records their log-probs",
        label="rollout engine (behaviour policy μ)",
        attribute="engine",
    ),
    Slot(
        "rollout.environment",
        "environment",
        "none",
        "env",
        "what answers the model between its turns (multi-turn rollouts: a tool, a game); "
        "none: one turn",
        label="environment (multi-turn)",
        attribute="environment",
    ),
    Slot(
        "reward",
        "reward",
        "demo",
        "R",
        "the outcome reward: one component or a list, summed with their `weight` (an empty "
        "list with an environment: its turn rewards only)",
        label="reward",
        attribute="rewards",
    ),
    Slot(
        "rollout.filter",
        "group_filter",
        "none",
        "keep",
        "which generated groups (a prompt's n responses) enter the round: the round draws "
        "more prompts until prompts_per_round groups pass (DAPO's dynamic sampling with "
        "informative)",
        label="group filter (which groups enter the round)",
        attribute="filter",
    ),
    Slot(
        "truncation",
        "truncation",
        "terminal",
        "rule",
        "what happens to responses that hit max_new_tokens without EOS",
        label="rule",
        attribute="truncation",
    ),
    Slot(
        "kl.estimator",
        "kl_estimator",
        "k1",
        "kl",
        "the per-token KL estimator",
        label="estimator",
        attribute="kl",
        names_section=True,
    ),
    Slot(
        "advantage",
        "advantage",
        "grpo",
        "A",
        "the advantage estimator",
        label="estimator",
        attribute="advantage",
    ),
    Slot(
        "critic.target",
        "critic_target",
        "lambda_return",
        "Y",
        "the critic's regression target Y",
        label="target Y",
        attribute="critic_target",
    ),
    Slot(
        "critic.mask",
        "position_mask",
        "response",
        "m^V",
        "positions the critic loss counts (m^V)",
        label="position mask m^V",
        attribute="critic_mask",
    ),
    Slot(
        "critic.weight",
        "prompt_weight",
        "uniform",
        "ω",
        "per-prompt weight ω of the critic loss",
        label="prompt weight ω",
        attribute="critic_weight",
    ),
    Slot(
        "critic.loss",
        "regression_loss",
        "mse",
        "ℓ",
        "the regression loss ℓ(V_φ(s_t), Y_t, V_old(s_t))",
        label="regression loss ℓ",
        attribute="critic_loss",
        names_section=True,
    ),
    Slot(
        "critic.aggregation",
        "aggregation",
        "token_mean",
        "agg_V",
        "how the elementwise critic loss is reduced",
        label="aggregation",
        attribute="critic_agg",
    ),
    Slot(
        "policy.loss",
        "policy_loss",
        "ppo_clip",
        "pl",
        "the actor's surrogate loss",
        label="policy loss",
        attribute="policy_loss",
    ),
    Slot(
        "policy.aggregation",
        "aggregation",
        "token_mean",
        "agg",
        "how the elementwise actor loss is reduced",
        label="aggregation",
        attribute="policy_agg",
    ),
    Slot(
        "policy.weight",
        "prompt_weight",
        "uniform",
        "ω",
        "prompt weight of the actor loss: rows of weight 0 leave the loss and its "
        "denominators (DAPO's dynamic sampling with informative_groups)",
        label="prompt weight ω",
        attribute="policy_weight",
    ),
    Slot(
        "policy.correction",
        "rollout_correction",
        "none",
        "c",
        "per-token weights of the actor's policy-gradient term for the mismatch between the "
        "engine's μ and π_old: tokens of weight 0 leave the loss and its denominators",
        label="rollout correction c",
        attribute="correction",
    ),
)

_BY_PATH = {s.path: s for s in SLOTS}

#: Where the spec names its prompt source (kind ``prompt_source``): ``data.source``, which
#: besides a component's name or mapping takes a data file's path or ``hf:owner/name``, with
#: the data section's settings; no slot of :data:`SLOTS` (those are components of a round's
#: objective and rollout, which the trainer assembles).
SOURCE = Slot(
    "data.source",
    "prompt_source",
    "demo",
    "D",
    "where the prompts come from: a registered source, a data file or folder, or a Hub "
    "dataset; the run draws each round's prompts from it, seeded and resumable",
    label="prompt source",
)

#: The component kinds of docs/design.md, in the order a round first uses them.
KINDS: tuple[str, ...] = tuple(dict.fromkeys(s.kind for s in (SOURCE, *SLOTS)))


def slot(path: str) -> Slot:
    """The slot at ``path`` (KeyError for a path that is no slot)."""
    return _BY_PATH[path]


def _has(section: str) -> Callable[[Spec], bool]:
    return lambda spec: getattr(spec, section) is not None


@dataclass(frozen=True)
class BatchField:
    """An optional RolloutBatch field a component may require, and what the spec needs for it."""

    name: str
    #: ``BT``: [B, T]; ``B``: one value per row; ``BK``: one value per row and reward part
    #: (K: the spec's rewards, and an environment's turn rewards)
    shape: Literal["BT", "B", "BK"]
    #: dtype family: float, bool or integer
    dtype: Literal["float", "bool", "integer"]
    #: what fills it, for the docs (``a `critic` section``)
    provided_by: str
    #: the spec path an unmet requirement is reported at (None: always met)
    path: str | None = None
    #: whether a spec meets it (None: always)
    met: Callable[[Spec], bool] | None = None
    #: the error when it is not met: ``{who}`` the requiring slots, ``{spec}`` the spec
    error: str = ""

    def problem(self, spec: Spec, who: str) -> str | None:
        """The error line for a spec that does not meet this requirement, else None."""
        if self.met is None or self.met(spec):
            return None
        return f"{self.path}: " + self.error.format(who=who, spec=spec)


_CRITIC = "needs {field} from a critic: add a 'critic' section"

#: The optional batch fields, in RolloutBatch's order.
FIELDS: tuple[BatchField, ...] = (
    BatchField(
        "values",
        "BT",
        "float",
        "a `critic` section",
        "critic",
        _has("critic"),
        "{who} " + _CRITIC.format(field="values"),
    ),
    BatchField(
        "logp_old",
        "BT",
        "float",
        "nothing: the rollout engine's log-probs or the trainer's forward (`rollout.logp_old`)",
    ),
    BatchField("logp_rollout", "BT", "float", "nothing: the rollout engine records it"),
    BatchField(
        "logp_ref",
        "BT",
        "float",
        "a `kl` section",
        "kl",
        _has("kl"),
        "{who} needs reference log-probs: add a 'kl' section",
    ),
    BatchField(
        "group_ids",
        "B",
        "integer",
        "`rollout.n >= 2`",
        "rollout.n",
        lambda spec: spec.rollout.n >= 2,
        "{who} compares responses within a group: rollout.n must be >= 2, got {spec.rollout.n}",
    ),
    BatchField("truncated", "B", "bool", "nothing: sampling records it"),
    BatchField(
        "bootstrap_values",
        "B",
        "float",
        "a `critic` section",
        "critic",
        _has("critic"),
        "{who} " + _CRITIC.format(field="bootstrap_values"),
    ),
    BatchField(
        "baseline_rewards",
        "B",
        "float",
        "nothing: the trainer adds a greedy baseline rollout",
    ),
    BatchField(
        "env_mask",
        "BT",
        "bool",
        "a `rollout.environment`: the environment's tokens inside multi-turn responses",
        "rollout.environment",
        lambda spec: spec.rollout.environment.name != "none",
        "{who} reads the environment's tokens: set rollout.environment",
    ),
    BatchField(
        "reward_parts",
        "BK",
        "float",
        "the spec's rewards: each one's score r_k, a column each in the order of `reward` (with "
        "a `rollout.environment`, a last column of its turn rewards)",
    ),
    BatchField(
        "reward_weights",
        "BK",
        "float",
        "the spec's rewards: each column's `weight` w_k (1 for the environment's), the same "
        "on every row; R = Σ_k w_k r_k",
    ),
    BatchField(
        "weight_version",
        "B",
        "integer",
        "nothing: the rollout records the version of the weights that generated each row "
        "(the updates before them; `rollout.max_staleness` at most behind the update's)",
    ),
)

_FIELD_BY_NAME = {f.name: f for f in FIELDS}


def field(name: str) -> BatchField:
    """The optional batch field ``name`` (KeyError for an unknown one)."""
    return _FIELD_BY_NAME[name]
