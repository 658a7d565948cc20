"""The assembled actor and critic objectives of a spec, written out as readable text.

:func:`explain` follows the order of a PPO round (docs/design.md): reward → truncation →
KL placement → advantage → critic target, mask, weight, loss and aggregation → policy loss,
aggregation, entropy and NLL terms. Each component appears with its effective parameters
(defaults filled in), its formula and its source. Torch is not imported for components whose
catalogue entry gives the formula.
"""

from __future__ import annotations

import textwrap
from typing import Any

from ppokit.registry import ComponentInfo, Registry, get_registry
from ppokit.slots import slot
from ppokit.spec import ComponentSpec, Spec

__all__ = ["describe_component", "explain"]

_INDENT = "   "

#: Where log π_old comes from, for each ``rollout.logp_old``.
_LOGP_OLD = {
    "auto": "the engine's log μ if it samples from the actor itself (no top-k/top-p), else a "
    "forward pass",
    "forward": "a no-grad forward pass of the actor at the weights that sampled",
    "rollout": "the engine's recorded log μ",
}


def _value(v: Any) -> str:
    return repr(v) if isinstance(v, str) else str(v)


def describe_component(comp: ComponentSpec, info: ComponentInfo) -> str:
    """``name(p=v, ...)`` with every parameter's effective value (defaults filled in)."""
    values = {**info.defaults(), **comp.params}
    if not values:
        return comp.name
    return f"{comp.name}(" + ", ".join(f"{k}={_value(v)}" for k, v in values.items()) + ")"


class _Writer:
    """Collects the lines of an explanation."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self.lines: list[str] = []

    def line(self, text: str = "", level: int = 0) -> None:
        self.lines.append(_INDENT * level + text if text else "")

    def section(self, number: int, title: str) -> None:
        self.line()
        self.line(f"{number}. {title}")

    def component(self, path: str, comp: ComponentSpec, level: int = 1) -> str:
        """Write ``label: name(params)`` of the component in slot ``path`` (the slot table's
        label) with its formula and source; return the short form."""
        s = slot(path)
        info = self.registry.info(s.kind, comp.name)
        self.line(f"{s.label}: {describe_component(comp, info)}", level)
        if info.formula:
            for part in info.formula.strip().splitlines():
                self.line(part.strip(), level + 1)
        elif info.summary:
            self.line(info.summary, level + 1)
        origin = f"plugin {info.plugin}" if info.plugin != "ppokit" else ""
        source = "; ".join(s for s in (info.source, origin) if s)
        if source:
            for part in textwrap.wrap(f"[{source}]", 92):
                self.line(part, level + 1)
        return comp.name

    def text(self) -> str:
        return "\n".join(self.lines).strip("\n") + "\n"


def _rollout(w: _Writer, spec: Spec, source: str | None) -> None:
    r = spec.rollout
    w.line(f"ppokit run{': ' + source if source else ''}")
    for word in ("variant", "task"):
        name = getattr(spec, word)
        if name:  # its title where it is registered (a run folder's spec may outlive it)
            known = w.registry.has_entry(word, name)
            w.line(f"{word} {name}" + (f": {w.registry.entry(word, name).title}" if known else ""))
    comp = spec.data.prompt_source(w.registry)
    known = w.registry.has("prompt_source", comp.name)
    prompts = (
        describe_component(comp, w.registry.info("prompt_source", comp.name))
        if known
        else comp.name
    )
    template = ", in the tokenizer's chat template" if spec.data.chat_template else ""
    w.line(f"prompts: {prompts} (data.source){template}")
    w.line(
        f"model {spec.model.actor!r}; each round samples {r.n} response(s) for each of "
        f"{r.prompts_per_round} prompts (up to {r.max_new_tokens} new tokens, "
        f"temperature {r.temperature}, top_p {r.top_p}"
        + (f", top_k {r.top_k}" if r.top_k else "")
        + ")"
    )
    w.component("rollout.engine", r.engine)
    s = r.max_staleness
    if not s:
        w.line(f"log π_old: {_LOGP_OLD[r.logp_old]} (rollout.logp_old: {r.logp_old})", 1)
    else:
        w.line(
            f"asynchronous: round k's batch comes from the weights after max(0, k − {s + 1}) "
            f"updates (rollout.max_staleness: {s}), generated while the rounds before it "
            "update",
            1,
        )
        old = (
            "μ itself (bypass: the ratio and its clip against μ)"
            if r.logp_old == "rollout"
            else "a forward pass at the weights the update starts from (decoupled PPO)"
        )
        w.line(
            f"μ: the engine's weights, up to {s} update(s) behind; π_old: {old} "
            f"(rollout.logp_old: {r.logp_old})",
            1,
        )
    if r.environment.name != slot("rollout.environment").default:
        w.component("rollout.environment", r.environment)
        budget = (
            f"at most {r.max_episode_tokens} response tokens"
            if r.max_episode_tokens
            else "room for every turn and observation"
        )
        w.line(
            f"episodes of up to {r.max_turns} model turns of up to {r.max_new_tokens} tokens, "
            f"observations of up to {r.max_observation_tokens} tokens between them, "
            f"{budget}; the environment's tokens are never trained (outside "
            "the loss, critic, KL and entropy masks); turn rewards on each turn's last token",
            1,
        )


def _reward(w: _Writer, spec: Spec) -> None:
    w.section(1, "Reward (an outcome score R on each response's last token)")
    terms = [f"{r.weight:g}·{r.name}" for r in spec.reward]
    if spec.rollout.environment.name != slot("rollout.environment").default:
        terms.append(f"the turn rewards of {spec.rollout.environment.name}")
    w.line("R = " + " + ".join(terms), 1)
    for reward in spec.reward:
        w.component("reward", reward)
    r = spec.rollout
    w.component("rollout.filter", r.filter)
    if r.filter.name != slot("rollout.filter").default:
        w.line(
            f"batches of {r.prompts_per_round} prompts until {r.prompts_per_round} groups "
            f"pass, at most {r.max_generation_batches} a round (then rollout.filter_exhausted: "
            f"{r.filter_exhausted})",
            1,
        )


def _truncation(w: _Writer, spec: Spec) -> None:
    w.section(2, "Truncation (responses that hit max_new_tokens without EOS)")
    w.component("truncation", spec.truncation)


def _kl(w: _Writer, spec: Spec) -> str | None:
    kl = spec.kl
    if kl is None:
        w.section(3, "KL to the reference policy: none")
        return None
    beta = f"β = {kl.coef:g}" + (
        f" (adaptive: target {kl.target:g} per sequence, horizon {kl.horizon})"
        if kl.target is not None
        else " (fixed)"
    )
    if kl.placement == "reward":
        w.section(3, "KL in the reward")
        w.line(f"r_t ← r_t − β·{kl.estimator.name}(logp_old, logp_ref), {beta}", 1)
    else:
        w.section(3, "KL in the loss (the β term of the actor loss below)")
        w.line(beta, 1)
    w.component("kl.estimator", kl.estimator)
    return kl.placement


def _advantage(w: _Writer, spec: Spec) -> None:
    w.section(4, "Advantage A")
    w.component("advantage", spec.advantage)


def _critic(w: _Writer, spec: Spec) -> None:
    c = spec.critic
    if c is None:
        w.section(5, "Critic: none (actor only, no value model)")
        return
    w.section(5, f"Critic ({spec.model.critic} value model)")
    w.component("critic.target", c.target)
    w.component("critic.mask", c.mask)
    w.component("critic.weight", c.weight)
    w.component("critic.loss", c.loss)
    w.component("critic.aggregation", c.aggregation)
    w.line(
        f"L_V = {spec.train.vf_coef:g} · {c.aggregation.name}("
        f"{c.loss.name}(V_φ(s_t), Y_t, V_old(s_t)) · ω[:, None], m^V)",
        1,
    )
    w.line("(rows of weight ω = 0 stay in m^V and in the denominator)", 1)


def _actor(w: _Writer, spec: Spec, kl_placement: str | None) -> None:
    p = spec.policy
    agg = p.aggregation.name
    w.section(6, "Actor")
    w.component("policy.loss", p.loss)
    w.component("policy.aggregation", p.aggregation)
    w.component("policy.weight", p.weight)
    w.component("policy.correction", p.correction)
    if p.correction.name == slot("policy.correction").default:
        w.line(
            "mask' = mask·[ω > 0]: rows of weight 0 leave every actor term and its denominator", 1
        )
        terms = [f"{agg}({p.loss.name}(logp, logp_old, A, mask') · ω[:, None], mask')"]
    else:
        w.line(
            "mask' = mask·[ω > 0]·[c > 0]: rows of weight 0 and rejected tokens leave every "
            "actor term and its denominator",
            1,
        )
        terms = [f"{agg}({p.loss.name}(logp, logp_old, A, mask') · ω[:, None] · c, mask')"]
    if spec.rollout.max_staleness:
        if spec.rollout.logp_old == "rollout":
            gap = "c = 1: π_old is μ itself (bypass), the ratio carries the staleness"
        elif p.correction.name != slot("policy.correction").default:
            gap = (
                f"c = {p.correction.name}(π_old/μ): the weight of the gap between the stale "
                "sampling weights and π_old"
            )
        else:
            gap = (
                "c = 1: the gap π_old/μ between the stale sampling weights and π_old is not "
                "weighted (ppokit validate warns)"
            )
        w.line(gap, 1)
    if kl_placement == "loss" and spec.kl is not None:
        terms.append(f"+ {spec.kl.coef:g}·{agg}({spec.kl.estimator.name}(logp, logp_ref), mask')")
    if p.entropy_coef:
        terms.append(f"− {p.entropy_coef:g}·{agg}(entropy, mask')")
    if p.nll_coef:
        terms.append(f"+ {p.nll_coef:g}·{agg}(−logp, mask'·[R > 0])")
    w.line("L_π = " + terms[0], 1)
    for term in terms[1:]:
        w.line("      " + term, 1)


def _updates(w: _Writer, spec: Spec) -> None:
    t = spec.train
    batch = spec.rollout.prompts_per_round * spec.rollout.n
    mb = t.minibatch_size or batch
    w.section(7, "Updates")
    w.line(
        f"{t.ppo_epochs} pass(es) over the round's {batch} responses in minibatches of {mb}"
        + (f" (micro-batches of {t.micro_batch_size})" if t.micro_batch_size else "")
        + (
            f" (micro-batches of at most {t.micro_batch_tokens} tokens"
            + (", packed into one row each)" if t.pack_sequences else ", by length)")
            if t.micro_batch_tokens
            else ""
        ),
        1,
    )
    lr = f"actor lr {t.actor_lr:g}"
    if t.lr_schedule != "constant" or t.warmup_steps:
        lr += f" ({t.warmup_steps} warm-up steps"
        if t.lr_schedule != "constant":
            lr += f", then {t.lr_schedule} down to {t.min_lr_ratio:g}x"
        lr += ")"
    if spec.critic is not None:
        lr += f", critic lr {t.critic_lr:g}"
        if t.critic_warmup_rounds:
            lr += f", {t.critic_warmup_rounds} critic-only warm-up round(s)"
    w.line(lr + f"; {t.rounds} rounds", 1)


def explain(spec: Spec, registry: Registry | None = None, source: str | None = None) -> str:
    """The objectives a spec assembles, as text (``source``: where the spec came from)."""
    w = _Writer(registry or get_registry())
    _rollout(w, spec, source)
    _reward(w, spec)
    _truncation(w, spec)
    placement = _kl(w, spec)
    _advantage(w, spec)
    _critic(w, spec)
    _actor(w, spec, placement)
    _updates(w, spec)
    return w.text()
