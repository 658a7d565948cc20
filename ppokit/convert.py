"""``ppokit convert trl|verl CONFIG``: a TRL ``GRPOConfig`` YAML (its dataclass's keys) or a
verl Hydra YAML as the equivalent ppokit spec.

The spec names the built-in variant the config's method is (TRL: ``grpo``, ``dr_grpo``,
``dapo``, ``gspo``, ``cispo``; verl: the variant of ``algorithm.adv_estimator``, ``ppo`` for
``gae``) and sets only what differs from it, the variant's own settings the config does not
share (DAPO's dynamic sampling, PPO's KL in the reward, ...) set back to ppokit's defaults. Every option that is not carried over exactly gets one
``# differs: KEY: ...`` or ``# no equivalent: KEY: ...`` line, in the spec and on stderr;
an unknown key is reported the same way, never dropped silently. The option-by-option
mapping is :data:`TRL` and :data:`VERL` (docs/from-trl-verl.md states it and names the test
that holds each row against the peer's own code); an option a config leaves out takes the
peer's default (:data:`TRL_DEFAULTS`, :data:`VERL_DEFAULTS`: TRL 1.16, verl 0.9.1).

Nothing here imports torch.
"""

from __future__ import annotations

import copy
import re
import sys
from pathlib import Path
from typing import Any

import typer
import yaml

from ppokit.errors import UserError, one_line

__all__ = ["TRL", "TRL_DEFAULTS", "VERL", "VERL_DEFAULTS", "convert", "convert_command"]

#: TRL 1.16 GRPOConfig's defaults of the options read here.
TRL_DEFAULTS: dict[str, Any] = {
    "loss_type": "dapo", "beta": 0.0, "epsilon": 0.2, "epsilon_high": None, "delta": None,
    "scale_rewards": "group", "num_generations": 8, "mask_truncated_completions": False,
    "importance_sampling_level": "token", "use_bias_correction_kl": True,
    "learning_rate": 1e-6, "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1,
    "steps_per_generation": None, "num_iterations": 1, "max_completion_length": 512,
    "temperature": 1.0, "top_p": 1.0, "top_k": 0, "entropy_coef": 0.0, "weight_decay": 0.0,
    "max_grad_norm": 1.0,
}  # fmt: skip

#: TRL option -> where it goes (or what happens to it).
TRL: dict[str, str] = {
    "loss_type": "variant and policy.aggregation: grpo seq_mean_token_mean, dr_grpo "
    "seq_mean_token_sum_norm (norm: max_completion_length), dapo token_mean, cispo "
    "policy.loss cispo",
    "beta": "kl.coef (kl.placement: loss); 0: no kl section",
    "use_bias_correction_kl": "kl.estimator: k3_is (true) or k3 (false)",
    "epsilon": "policy.loss.clip_low", "epsilon_high": "policy.loss.clip_high (cispo: minus 1)",
    "delta": "policy.loss.dual_clip",
    "scale_rewards": "advantage: grpo with eps 1e-4 (group), dr_grpo (none)",
    "importance_sampling_level": "policy.loss: gspo (sequence)",
    "num_generations": "rollout.n",
    "mask_truncated_completions": "policy.weight: untruncated (and rows: all under grpo, dr_grpo)",
    "learning_rate": "train.actor_lr", "num_iterations": "train.ppo_epochs",
    "per_device_train_batch_size": "train.micro_batch_size",
    "gradient_accumulation_steps": "train.minibatch_size (x per_device_train_batch_size)",
    "steps_per_generation": "rollout.prompts_per_round (x per_device_train_batch_size / n)",
    "max_completion_length": "rollout.max_new_tokens",
    "temperature": "rollout.temperature", "top_p": "rollout.top_p", "top_k": "rollout.top_k",
    "entropy_coef": "policy.entropy_coef", "weight_decay": "train.weight_decay",
    "max_grad_norm": "train.max_grad_norm",
}  # fmt: skip

#: verl 0.9.1's defaults of the options read here (dotted paths).
VERL_DEFAULTS: dict[str, Any] = {
    "algorithm.adv_estimator": "gae", "algorithm.norm_adv_by_std_in_grpo": True,
    "algorithm.use_kl_in_reward": False, "algorithm.kl_penalty": "kl",
    "algorithm.kl_ctrl.type": "fixed", "algorithm.kl_ctrl.kl_coef": 0.001,
    "actor_rollout_ref.actor.clip_ratio_low": 0.2, "actor_rollout_ref.actor.clip_ratio_high": 0.2,
    "actor_rollout_ref.actor.clip_ratio_c": 3.0,
    "actor_rollout_ref.actor.loss_agg_mode": "token-mean",
    "actor_rollout_ref.actor.use_kl_loss": False, "actor_rollout_ref.actor.kl_loss_coef": 0.001,
    "actor_rollout_ref.actor.kl_loss_type": "low_var_kl",
    "actor_rollout_ref.actor.entropy_coeff": 0.0, "actor_rollout_ref.actor.ppo_epochs": 1,
    "actor_rollout_ref.actor.ppo_mini_batch_size": 256, "actor_rollout_ref.actor.optim.lr": 1e-6,
    "actor_rollout_ref.rollout.n": 1, "actor_rollout_ref.rollout.temperature": 1.0,
    "actor_rollout_ref.rollout.top_p": 1.0, "data.train_batch_size": 1024,
    "data.max_response_length": 512, "algorithm.gamma": 1.0, "algorithm.lam": 1.0,
    "critic.cliprange_value": 0.5, "actor_rollout_ref.actor.policy_loss.loss_mode": "vanilla",
}  # fmt: skip

#: verl option -> where it goes.
VERL: dict[str, str] = {
    "algorithm.adv_estimator": "variant and advantage (grpo, rloo, reinforce_plus_plus(_baseline), "
    "remax, opo; gae: the ppo variant, with a critic)",
    "algorithm.gamma": "advantage.gamma (reinforce_plus_plus, gae), critic.target.gamma",
    "algorithm.lam": "advantage.lam, critic.target.lam (gae)",
    "critic.cliprange_value": "critic.loss: clipped_mse clip (gae)",
    "critic.loss_agg_mode": "critic.aggregation (gae; unset: the actor's loss_agg_mode); "
    "train.vf_coef: 1",
    "critic.loss_scale_factor": "critic.aggregation.norm (seq-mean-token-sum-norm; unset: the "
    "actor's loss_scale_factor)",
    "actor_rollout_ref.actor.policy_loss.loss_mode": "policy.loss (vanilla ppo_clip, gspo, cispo)",
    "actor_rollout_ref.actor.loss_scale_factor": "policy.aggregation.norm (seq-mean-token-sum-norm)",
    "algorithm.norm_adv_by_std_in_grpo": "advantage: dr_grpo (false)",
    "algorithm.use_kl_in_reward": "kl.placement: reward",
    "algorithm.kl_penalty": "kl.estimator (in the reward)",
    "algorithm.kl_ctrl.type": "kl.target: target_kl x the response length (adaptive)", "algorithm.kl_ctrl.kl_coef": "kl.coef",
    "actor_rollout_ref.actor.clip_ratio_low": "policy.loss.clip_low",
    "actor_rollout_ref.actor.clip_ratio_high": "policy.loss.clip_high",
    "actor_rollout_ref.actor.clip_ratio_c": "policy.loss.dual_clip",
    "actor_rollout_ref.actor.loss_agg_mode": "policy.aggregation",
    "actor_rollout_ref.actor.use_kl_loss": "kl.placement: loss",
    "actor_rollout_ref.actor.kl_loss_coef": "kl.coef",
    "actor_rollout_ref.actor.kl_loss_type": "kl.estimator (low_var_kl k3, kl k1, mse k2, abs; "
    "a trailing +: straight_through)",
    "actor_rollout_ref.actor.entropy_coeff": "policy.entropy_coef",
    "actor_rollout_ref.actor.ppo_epochs": "train.ppo_epochs",
    "actor_rollout_ref.actor.ppo_mini_batch_size": "train.minibatch_size (x rollout.n)",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "train.micro_batch_size",
    "actor_rollout_ref.actor.optim.lr": "train.actor_lr",
    "actor_rollout_ref.model.path": "model.actor",
    "actor_rollout_ref.rollout.n": "rollout.n",
    "actor_rollout_ref.rollout.temperature": "rollout.temperature",
    "actor_rollout_ref.rollout.top_p": "rollout.top_p",
    "actor_rollout_ref.rollout.response_length": "rollout.max_new_tokens",
    "data.max_response_length": "rollout.max_new_tokens",
    "data.train_batch_size": "rollout.prompts_per_round",
}  # fmt: skip

VERL_ADVANTAGE = {
    "grpo": "grpo", "rloo": "rloo", "reinforce_plus_plus": "reinforce_pp",
    "reinforce_plus_plus_baseline": "reinforce_pp_baseline", "remax": "remax", "opo": "opo",
    "gae": "gae",
}  # fmt: skip
#: ppokit's variant of each verl advantage estimator (``grpo`` without the std: ``dr_grpo``)
VERL_VARIANT = {**{k: v for k, v in VERL_ADVANTAGE.items() if k != "gae"}, "gae": "ppo"}
VERL_KL = {
    "low_var_kl": "k3",
    "k3": "k3",
    "kl": "k1",
    "k1": "k1",
    "mse": "k2",
    "k2": "k2",
    "abs": "abs",
}
VERL_AGG = {
    "token-mean": "token_mean", "seq-mean-token-mean": "seq_mean_token_mean",
    "seq-mean-token-sum": "seq_mean_token_sum", "seq-mean-token-sum-norm": "seq_mean_token_sum_norm",
}  # fmt: skip


def _flat(data: dict[str, Any], at: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        path = f"{at}{key}"
        if isinstance(value, dict) and value:
            out.update(_flat(value, path + "."))
        else:
            out[path] = value
    return out


def _set(spec: dict[str, Any], path: str, value: Any) -> None:
    *head, last = path.split(".")
    node = spec
    for key in head:
        node = node.setdefault(key, {})
    node[last] = value


class _Out:
    """The spec being written and its notes (``# differs:`` / ``# no equivalent:``)."""

    def __init__(self) -> None:
        self.spec: dict[str, Any] = {}
        self.notes: list[str] = []

    def set(self, path: str, value: Any) -> None:
        _set(self.spec, path, value)

    def differs(self, key: str, why: str) -> None:
        self.notes.append(f"# differs: {key}: {why}")

    def none(self, key: str, why: str = "not mapped") -> None:
        self.notes.append(f"# no equivalent: {key}: {why}")


def _trl(config: dict[str, Any], out: _Out) -> str:
    given = set(config)
    c = {**TRL_DEFAULTS, **config}
    loss_type, n = c["loss_type"], int(c["num_generations"])
    micro = int(c["per_device_train_batch_size"])
    steps = c["steps_per_generation"] or c["gradient_accumulation_steps"]
    length = int(c["max_completion_length"])
    high = c["epsilon_high"] if c["epsilon_high"] is not None else c["epsilon"]
    if loss_type == "cispo":
        variant = "cispo"
    elif c["importance_sampling_level"] == "sequence":
        variant = "gspo"
    elif loss_type == "dr_grpo":
        variant = "dr_grpo"
    elif loss_type == "dapo" and high != c["epsilon"]:
        variant = "dapo"  # clip-higher with the token-level loss
    else:
        variant = "grpo"
    out.set("rollout.n", n)
    out.set("rollout.max_new_tokens", length)
    out.set("rollout.prompts_per_round", max(1, micro * int(steps) // n))
    for key in ("temperature", "top_p"):
        out.set(f"rollout.{key}", c[key])
    if c["top_k"]:
        out.set("rollout.top_k", c["top_k"])
    out.set("train.micro_batch_size", micro)
    out.set("train.minibatch_size", micro * int(c["gradient_accumulation_steps"]))
    out.set("train.ppo_epochs", c["num_iterations"])
    out.set("train.actor_lr", c["learning_rate"])
    out.set("train.weight_decay", c["weight_decay"])
    out.set("train.max_grad_norm", c["max_grad_norm"])
    scale = c["scale_rewards"]
    if scale in ("none", False):
        out.set("advantage", {"name": "dr_grpo"})
    elif scale == "batch":
        out.set("advantage", {"name": "grpo", "eps": 1e-4, "std": "batch"})
    else:
        out.set("advantage", {"name": "grpo", "eps": 1e-4})
    if loss_type == "cispo":
        loss: dict[str, Any] = {"name": "cispo", "clip_high": high - 1.0}
    elif c["importance_sampling_level"] == "sequence":
        loss = {"name": "gspo", "clip_low": c["epsilon"], "clip_high": high}
    else:
        loss = {"name": "ppo_clip", "clip_low": c["epsilon"], "clip_high": high}
        if c["delta"] is not None:
            loss["dual_clip"] = c["delta"]
    out.set("policy.loss", loss)
    rows = {"rows": "all"} if c["mask_truncated_completions"] else {}
    if loss_type == "grpo":
        agg: dict[str, Any] = {"name": "seq_mean_token_mean", **rows}
    elif loss_type == "dr_grpo":
        agg = {"name": "seq_mean_token_sum_norm", "norm": length, **rows}
    else:
        agg = {"name": "token_mean"}
        if loss_type == "bnpo":
            if int(c["gradient_accumulation_steps"]) > 1:
                out.differs(
                    "loss_type",
                    "bnpo over several micro-batches: token_mean divides by the optimizer "
                    "step's tokens, not each micro-batch's",
                )
        elif loss_type not in ("dapo", "cispo"):
            out.none("loss_type", f"{loss_type}: token_mean used")
        elif int(c["gradient_accumulation_steps"]) < int(steps):
            out.differs(
                "loss_type",
                f"{loss_type} over several optimizer steps of a generation batch: ppokit divides each by its own tokens",
            )
    out.set("policy.aggregation", agg)
    if c["mask_truncated_completions"]:
        out.set("policy.weight", "untruncated")
    if c["entropy_coef"]:
        out.set("policy.entropy_coef", c["entropy_coef"])
        if loss_type != "dapo" or micro < micro * int(c["gradient_accumulation_steps"]):
            out.differs(
                "entropy_coef",
                "TRL's bonus is a token mean of each micro-batch, ppokit's the loss's aggregation over the minibatch",
            )
    if c["beta"]:
        estimator = "k3_is" if c["use_bias_correction_kl"] else "k3"
        if estimator == "k3_is" and c["importance_sampling_level"] == "sequence":
            out.differs(
                "use_bias_correction_kl",
                "TRL weighs k3 by the sequence's ratio here, k3_is by each token's",
            )
        out.set("kl", {"estimator": estimator, "coef": c["beta"], "placement": "loss"})
    else:
        out.set("kl", None)
    if c.get("use_vllm"):
        out.differs(
            "use_vllm", "rollout.engine: vllm is colocated only; the engine is left as it is"
        )
        if c.get("vllm_importance_sampling_correction", True):
            out.set("policy.correction", _trl_correction(c, out))
    else:
        for key in sorted(given & set(VLLM[1:])):
            out.none(key, "TRL reads it only with use_vllm")
    for key in sorted(given - set(TRL) - set(VLLM)):
        out.none(key)
    return variant


#: TRL's vLLM options, read with ``use_vllm``.
VLLM = ("use_vllm", "vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
        "vllm_importance_sampling_clip_max", "vllm_importance_sampling_clip_min")  # fmt: skip


def _trl_correction(c: dict[str, Any], out: _Out) -> dict[str, Any]:
    """``policy.correction`` of TRL's ``vllm_importance_sampling_*`` (TRL's defaults:
    ``sequence_mask``, ``clip_max`` 3.0, no ``clip_min``)."""
    mode = c.get("vllm_importance_sampling_mode", "sequence_mask")
    high = float(c.get("vllm_importance_sampling_clip_max", 3.0))
    low = c.get("vllm_importance_sampling_clip_min")
    if mode in ("token_mask", "sequence_mask"):
        name = "token_mis" if mode == "token_mask" else "seq_mis"
        return {"name": name, "low": low, "high": high, "rejected": "zero"}
    if low is not None:
        out.none("vllm_importance_sampling_clip_min", "ppokit's *_tis truncate from above only")
    return {"name": "token_tis" if mode == "token_truncate" else "seq_tis", "cap": high}


INTERPOLATION = re.compile(r"\$\{(?:oc\.select:)?([\w.]+)(?:,([^}]*))?\}")


def _resolved(flat: dict[str, Any], out: _Out) -> dict[str, Any]:
    """``flat`` without its nulls (unset: the default) and with Hydra's ``${path}`` and
    ``${oc.select:path,default}`` read; any other interpolation is reported and unset."""
    done: dict[str, Any] = {}
    for key, value in flat.items():
        for _ in range(8):  # a chain of interpolations
            if not isinstance(value, str) or not value.startswith("${"):
                break
            found = INTERPOLATION.fullmatch(value)
            if found is None:
                value = None
                out.none(key, "an interpolation not read: the default used")
                break
            path, default = found.groups()
            value = flat.get(path, yaml.safe_load(default) if default is not None else None)
        if value is not None:
            done[key] = value
    return done


def _verl(config: dict[str, Any], out: _Out) -> str:
    flat = _resolved(_flat(config), out)
    c = {**VERL_DEFAULTS, **flat}
    a, r = "actor_rollout_ref.actor.", "actor_rollout_ref.rollout."
    estimator = c["algorithm.adv_estimator"]
    adv = VERL_ADVANTAGE.get(estimator)
    if adv is None:
        out.none("algorithm.adv_estimator", f"{estimator}: grpo used")
        estimator, adv = "grpo", "grpo"
    variant = VERL_VARIANT[estimator]
    if adv == "grpo" and not c["algorithm.norm_adv_by_std_in_grpo"]:
        adv = variant = "dr_grpo"
    gamma, lam = c["algorithm.gamma"], c["algorithm.lam"]
    if adv == "grpo":
        out.set("advantage", {"name": "grpo", "eps": 1e-6})
    elif adv == "reinforce_pp":
        out.set("advantage", {"name": adv, "gamma": gamma})
    elif adv == "gae":
        out.set("advantage", {"name": "gae", "gamma": gamma, "lam": lam, "whiten": True})
        out.set("model.critic", "separate")
        target = {"name": "lambda_return", "gamma": gamma, "lam": lam}
        clip = {"name": "clipped_mse", "clip": c["critic.cliprange_value"]}
        out.set("critic", {"target": target, "loss": clip})
        out.set("train.vf_coef", 1.0)  # verl's value loss has no coefficient
    else:
        out.set("advantage", {"name": adv})
    n = int(c[r + "n"])
    out.set("rollout.n", n)
    out.set("rollout.prompts_per_round", int(c["data.train_batch_size"]))
    length = int(c.get(r + "response_length") or c["data.max_response_length"])
    out.set("rollout.max_new_tokens", length)
    out.set("rollout.temperature", c[r + "temperature"])
    out.set("rollout.top_p", c[r + "top_p"])
    if "actor_rollout_ref.model.path" in c:
        out.set("model.actor", c["actor_rollout_ref.model.path"])
    out.set("train.minibatch_size", int(c[a + "ppo_mini_batch_size"]) * n)
    if a + "ppo_micro_batch_size_per_gpu" in c:
        out.set("train.micro_batch_size", int(c[a + "ppo_micro_batch_size_per_gpu"]))
    out.set("train.ppo_epochs", c[a + "ppo_epochs"])
    out.set("train.actor_lr", c[a + "optim.lr"])
    out.set("policy.loss", _verl_loss(c, out))
    agg = _verl_agg(c, out, a, length)
    out.set("policy.aggregation", agg)
    if adv == "gae":
        for key in ("loss_agg_mode", "loss_scale_factor"):  # verl's defaults: the actor's
            if f"critic.{key}" not in c and a + key in c:
                c[f"critic.{key}"] = c[a + key]
        out.set("critic.aggregation", _verl_agg(c, out, "critic.", length))
    if c[a + "entropy_coeff"]:
        out.set("policy.entropy_coef", c[a + "entropy_coeff"])
    if c[a + "use_kl_loss"]:
        kind = str(c[a + "kl_loss_type"])
        est: Any = VERL_KL.get(kind.removesuffix("+"))
        if est is None:
            out.none(a + "kl_loss_type", f"{kind}: k3 used")
            est = "k3"
        elif kind.endswith("+"):
            est = {"name": est, "straight_through": True}
        out.set("kl", {"estimator": est, "coef": c[a + "kl_loss_coef"], "placement": "loss"})
    elif c["algorithm.use_kl_in_reward"]:
        kind = str(c["algorithm.kl_penalty"])
        est = VERL_KL.get(kind.removesuffix("+"))
        if est is None:
            out.none("algorithm.kl_penalty", f"{kind}: k1 used")
            est = "k1"
        kl: dict[str, Any] = {"estimator": est, "coef": c["algorithm.kl_ctrl.kl_coef"], "placement": "reward"}  # fmt: skip
        if c["algorithm.kl_ctrl.type"] == "adaptive":
            target = c.get("algorithm.kl_ctrl.target_kl", 0.1)
            kl["target"] = target * length  # verl's is a token mean, ppokit's a sequence sum
            kl["horizon"] = c.get("algorithm.kl_ctrl.horizon", 10000)
            out.differs(
                "algorithm.kl_ctrl.target_kl",
                f"verl's target is a response's token-mean KL, ppokit's its token sum: "
                f"{target:g} x {length} written (exact when every response has {length} tokens)",
            )
        out.set("kl", kl)
    else:
        out.set("kl", None)
    for key in sorted(set(flat) - set(VERL) - {"algorithm.kl_ctrl.target_kl", "algorithm.kl_ctrl.horizon"}):  # fmt: skip
        out.none(key)
    return variant


def _verl_agg(c: dict[str, Any], out: _Out, prefix: str, length: int) -> dict[str, Any]:
    """The aggregation of verl's ``{prefix}loss_agg_mode`` and ``loss_scale_factor`` (the
    actor's or the critic's)."""
    mode = c[prefix + "loss_agg_mode"]
    agg: dict[str, Any] = {"name": VERL_AGG.get(mode, "token_mean")}
    if mode not in VERL_AGG:
        out.none(prefix + "loss_agg_mode", f"{mode}: token_mean used")
    if mode == "seq-mean-token-sum-norm":
        factor = c.get(prefix + "loss_scale_factor")
        if factor is None:
            factor = length
            out.differs(
                prefix + "loss_scale_factor",
                f"unset: verl divides by the padded width, norm: {length} (the response "
                "length) written",
            )
        agg["norm"] = factor
    return agg


def _verl_loss(c: dict[str, Any], out: _Out) -> dict[str, Any]:
    """``policy.loss`` of verl's ``policy_loss.loss_mode`` and clip ratios."""
    a = "actor_rollout_ref.actor."
    mode, low, high = c[a + "policy_loss.loss_mode"], c[a + "clip_ratio_low"], c[a + "clip_ratio_high"]  # fmt: skip
    if mode == "gspo":
        return {"name": "gspo", "clip_low": low, "clip_high": high}
    if mode == "cispo":
        if low < 1:
            out.differs(
                a + "clip_ratio_low",
                f"cispo: verl also raises an IS weight below {1 - low:g} to it; ppokit's "
                "cispo truncates from above only",
            )
        return {"name": "cispo", "clip_high": high}
    if mode != "vanilla":
        out.none(a + "policy_loss.loss_mode", f"{mode}: ppo_clip used")
    return {"name": "ppo_clip", "clip_low": low, "clip_high": high, "dual_clip": c[a + "clip_ratio_c"]}  # fmt: skip


def _slot_diff(want: Any, have: Any) -> Any:
    """What to write for a component slot: nothing (None) when the same, its changed
    parameters under the same name, else the whole component."""
    w = {"name": want} if isinstance(want, str) else dict(want)
    h = {"name": have} if isinstance(have, str) else dict(have or {})
    if w.get("name") != h.get("name"):
        return want
    changed = {k: v for k, v in w.items() if k != "name" and h.get(k) != v}
    return {"name": w["name"], **changed} if changed else None


def _minimal(want: dict[str, Any], have: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in want.items():
        base = have.get(key)
        if (isinstance(value, dict) and "name" in value) or (isinstance(value, str) and isinstance(base, (str, dict)) and key not in ("actor",)):  # fmt: skip
            diff = _slot_diff(value, base)
            if diff is not None:
                out[key] = diff
        elif isinstance(value, dict):
            sub = _minimal(value, base if isinstance(base, dict) else {})
            if sub:
                out[key] = sub
        elif value != base or key not in have:
            if value is None and base is None:
                continue
            out[key] = value
    return out


#: The algorithm's settings: where the variant sets one the converted config does not, the
#: spec sets it back to ppokit's default (the peer has no such option, e.g. DAPO's dynamic
#: sampling or PPO's truncation penalty).
ALGORITHM = ("truncation", "kl", "advantage", "policy", "rollout.filter", "rollout.engine")

_MISSING = object()


def _get(data: Any, path: str) -> Any:
    """The value at ``path``; a leaf on the way (a component, None) counts as the value."""
    node = data
    for key in path.split("."):
        if not isinstance(node, dict) or "name" in node:
            return node
        if key not in node:
            return _MISSING
        node = node[key]
    return node


def _reset(want: dict[str, Any], have: dict[str, Any]) -> None:
    """Sets in ``want`` ppokit's default of each algorithm setting the variant (``have``)
    sets and ``want`` does not."""
    from ppokit.spec import validate_spec

    default = validate_spec({"model": {"actor": "demo"}}).model_dump()
    for section in ALGORITHM:
        value = _get(have, section)
        if value is _MISSING:
            continue
        paths = [section]
        if isinstance(value, dict) and "name" not in value and section != "kl":
            paths = [f"{section}.{key}" for key in value]
        for path in paths:
            if _get(want, path) is _MISSING:
                _set(want, path, _get(default, path))


def convert(peer: str, config: Any) -> tuple[dict[str, Any], list[str]]:
    """The spec (a mapping naming a variant) and the notes of a ``peer`` config mapping."""
    from ppokit.spec.compose import compose

    if peer not in ("trl", "verl"):
        raise UserError(f"unknown peer {peer!r}: expected trl or verl")
    if not isinstance(config, dict):
        raise UserError(f"expected a mapping of options, got {type(config).__name__}")
    out = _Out()
    config = {k: v for k, v in config.items() if v is not None} if peer == "trl" else config
    try:
        variant = (_trl if peer == "trl" else _verl)(copy.deepcopy(config), out)
    except (TypeError, ValueError) as exc:
        raise UserError(f"an option of the wrong type: {one_line(exc)}") from None
    have = compose({"variant": variant}).data
    spec: dict[str, Any] = {"variant": variant}
    want = out.spec
    want.setdefault("model", {}).setdefault("actor", "demo")
    _reset(want, have)
    spec.update(_minimal(want, have))
    return spec, out.notes


def convert_command(
    peer: str = typer.Argument(..., help="trl (a GRPOConfig YAML) or verl (a Hydra YAML)"),
    config: Path = typer.Argument(..., help="the config file"),
    out: Path | None = typer.Option(None, "--out", help="write the spec here (never over a file)"),
) -> None:
    """Write the ppokit spec of a TRL or verl config, naming the variant it matches."""
    try:
        try:
            data = yaml.safe_load(config.read_text())
        except yaml.YAMLError as exc:
            raise UserError(f"{config}: not YAML: {one_line(exc)}") from None
        except OSError as exc:
            raise UserError(f"{config}: {one_line(exc)}") from None
        spec, notes = convert(peer, data)
        if out is not None and out.exists():
            raise UserError(f"{out} exists: not overwritten")
    except UserError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    for note in notes:
        typer.echo(note, err=True)
    text = "\n".join(notes) + ("\n" if notes else "")
    text += yaml.safe_dump(spec, sort_keys=False)
    if out is None:
        sys.stdout.write(text)
    else:
        out.write_text(text)
