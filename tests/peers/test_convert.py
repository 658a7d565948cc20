"""``ppokit convert``: the spec converted from a TRL or verl config computes the peer's own
loss (tests/peers/test_trl.py's and test_verl.py's machinery), validates, and reports every
option it does not carry over."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import yaml
from typer.testing import CliRunner

from ppokit.cli import app
from ppokit.convert import convert
from ppokit.spec import validate_spec
from ppokit.spec.compose import compose
from tests.helpers.peers import fixed, ppokit_loss, update_data

pytest.importorskip("trl", minversion="1.16")
from tests.peers import test_trl, test_verl

SET = ("num_generations", "max_completion_length")  # the peer test's config sets them


def spec_of(peer: str, config: dict[str, Any], t: int) -> Any:
    spec, _ = convert(peer, config)
    data = compose(spec).data
    data["rollout"]["max_new_tokens"] = t
    return validate_spec(data)


def test_trl_dr_grpo_masked_converts_to_trls_loss() -> None:
    """The check case: dr_grpo, beta 0.04, scale_rewards none, 4 generations, truncated
    completions masked."""
    case = fixed([6, 2, 3, 4, 1, 6, 6, 2])
    config = {"loss_type": "dr_grpo", "beta": 0.04, "scale_rewards": "none",
              "num_generations": 4, "mask_truncated_completions": True,
              "max_completion_length": case.t}  # fmt: skip
    spec, notes = convert("trl", config)
    assert spec["variant"] == "dr_grpo" and notes == []
    theirs = test_trl.trl_loss(case, 4, **{k: v for k, v in config.items() if k not in SET})
    logp = case.fresh()
    mine = ppokit_loss(spec_of("trl", config, case.t), case, logp, 4)
    torch.testing.assert_close(theirs[0], mine.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_trl_configs_convert_to_trls_loss(loss_type: str) -> None:
    case = fixed()
    config = {"loss_type": loss_type, "beta": 0.04, "epsilon_high": 0.28,
              "max_completion_length": case.t, "num_generations": 4}  # fmt: skip
    theirs = test_trl.trl_loss(case, 4, **{k: v for k, v in config.items() if k not in SET})
    mine = ppokit_loss(spec_of("trl", config, case.t), case, case.fresh(), 4)
    torch.testing.assert_close(theirs[0], mine.detach(), rtol=1e-5, atol=1e-6)


def test_trl_batch_scaled_rewards_convert_to_trls_loss() -> None:
    """``scale_rewards: batch`` converts to grpo with the batch's std, never dropped."""
    case = fixed()
    config = {"loss_type": "grpo", "scale_rewards": "batch", "num_generations": 4,
              "max_completion_length": case.t}  # fmt: skip
    spec, notes = convert("trl", config)
    assert spec["advantage"] == {"name": "grpo", "eps": 1e-4, "std": "batch"}
    assert not any("scale_rewards" in note for note in notes)
    theirs = test_trl.trl_loss(case, 4, **{k: v for k, v in config.items() if k not in SET})
    mine = ppokit_loss(spec_of("trl", config, case.t), case, case.fresh(), 4)
    torch.testing.assert_close(theirs[0], mine.detach(), rtol=1e-5, atol=1e-6)


def test_verl_config_converts_to_verls_loss() -> None:
    case = fixed()
    config = {"algorithm": {"adv_estimator": "grpo"},
              "actor_rollout_ref": {"actor": {"clip_ratio_high": 0.28, "use_kl_loss": True,
                                              "kl_loss_coef": 0.1, "kl_loss_type": "low_var_kl",
                                              "loss_agg_mode": "seq-mean-token-mean"},
                                    "rollout": {"n": 4}}}  # fmt: skip
    theirs = test_verl.verl_loss(case, 4, "seq-mean-token-mean", kl="low_var_kl", kl_coef=0.1)
    mine = ppokit_loss(spec_of("verl", config, case.t), case, case.fresh(), 4)
    torch.testing.assert_close(theirs[0], mine.detach(), rtol=1e-5, atol=1e-6)


def test_unknown_options_are_reported(tmp_path: Any) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"loss_type": "grpo", "frobnicate": 3}))
    result = CliRunner().invoke(app, ["convert", "trl", str(path)])
    assert result.exit_code == 0
    assert "# no equivalent: frobnicate" in result.stdout
    out = tmp_path / "spec.yaml"
    out.write_text("x")
    assert CliRunner().invoke(app, ["convert", "trl", str(path), "--out", str(out)]).exit_code == 1
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a\n- b\n")
    result = CliRunner().invoke(app, ["convert", "verl", str(bad)])
    assert result.exit_code == 1
    result = CliRunner().invoke(app, ["convert", "nope", str(path)])
    assert result.exit_code == 1


def test_page_rows_are_the_mapping() -> None:
    """Every option of the module's mapping is named on docs/from-trl-verl.md."""
    from pathlib import Path

    from ppokit.convert import TRL, VERL

    text = (Path(__file__).resolve().parents[2] / "docs" / "from-trl-verl.md").read_text()
    missing = [k for k in TRL if f"`{k}" not in text]
    missing += [k for k in VERL if f"{k.rsplit('.', 1)[-1]}`" not in text]
    assert not missing, missing


def test_differs_lines_go_to_stderr_too(tmp_path: Any) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "loss_type": "bnpo",
                "gradient_accumulation_steps": 2,
                "vllm_importance_sampling_clip_min": 0.5,
                "use_vllm": True,
                "vllm_importance_sampling_mode": "token_truncate",
            }
        )
    )
    result = CliRunner().invoke(app, ["convert", "trl", str(path)])
    assert result.exit_code == 0
    for line in ("# differs: loss_type", "# no equivalent: vllm_importance_sampling_clip_min"):
        assert line in result.stdout and line in result.stderr


@pytest.mark.parametrize("mode", ["token_mask", "sequence_mask"])
def test_trl_vllm_mask_modes_convert_to_trls_loss(mode: str) -> None:
    case = fixed()
    config = {"loss_type": "dapo", "use_vllm": True, "vllm_importance_sampling_mode": mode,
              "vllm_importance_sampling_clip_max": 1.5, "num_generations": 4,
              "max_completion_length": case.t}  # fmt: skip
    theirs = test_trl.trl_loss(case, 4, **{k: v for k, v in config.items() if k not in SET})
    mine = ppokit_loss(spec_of("trl", config, case.t), case, case.fresh(), 4)
    torch.testing.assert_close(theirs[0], mine.detach(), rtol=1e-5, atol=1e-6)


def test_the_written_spec_validates(tmp_path: Any) -> None:
    """The check case through the command: ``ppokit convert trl`` of a GRPOConfig YAML with
    ``loss_type: dr_grpo``, ``beta: 0.04``, ``scale_rewards: none``, ``num_generations: 4``,
    ``mask_truncated_completions: true`` writes a spec that composes, validates and computes
    TRL's loss (``max_completion_length`` TRL's default, 512, on both sides)."""
    path = tmp_path / "c.yaml"
    path.write_text("loss_type: dr_grpo\nbeta: 0.04\nscale_rewards: none\nnum_generations: 4\n"
                    "mask_truncated_completions: true\n")  # fmt: skip
    out = tmp_path / "spec.yaml"
    result = CliRunner().invoke(app, ["convert", "trl", str(path), "--out", str(out)])
    assert result.exit_code == 0, result.output
    spec = validate_spec(compose(yaml.safe_load(out.read_text())).data)
    assert spec.policy.weight.name == "untruncated"
    assert spec.kl is not None and spec.kl.estimator.name == "k3_is"
    case = fixed([6, 2, 3, 4, 1, 6, 6, 2])
    options = {k: v for k, v in yaml.safe_load(path.read_text()).items() if k != "num_generations"}
    theirs = test_trl.trl_loss(case, 4, max_completion_length=512, **options)
    logp = case.fresh()
    mine = ppokit_loss(spec, case, logp, 4)
    mine.backward()
    close(theirs, mine)
    torch.testing.assert_close(theirs[1], logp.grad, rtol=1e-5, atol=1e-6)


def test_verl_interpolations_are_read_or_reported() -> None:
    config = {"data": {"max_response_length": 64},
              "actor_rollout_ref": {"rollout": {"response_length": "${oc.select:data.max_response_length,512}",
                                                "n": "${oc.env:N}"},
                                    "actor": {"ppo_micro_batch_size_per_gpu": None}}}  # fmt: skip
    spec, notes = convert("verl", config)
    assert spec["rollout"]["max_new_tokens"] == 64
    assert (
        "# no equivalent: actor_rollout_ref.rollout.n: an interpolation not read: the default used"
        in notes
    )


def close(theirs: tuple[torch.Tensor, torch.Tensor], mine: torch.Tensor) -> None:
    torch.testing.assert_close(theirs[0], mine.detach(), rtol=1e-5, atol=1e-6)


#: the configs of tests/peers/test_trl.py's rows: (config, micro-batch rows, policy spread)
TRL_CONFIGS: dict[str, tuple[dict[str, Any], int, float]] = {
    "cispo": ({"loss_type": "cispo", "epsilon_high": 1.3}, 4, 0.5),
    "gspo": ({"loss_type": "grpo", "importance_sampling_level": "sequence", "epsilon": 3e-3,
              "epsilon_high": 4e-3}, 4, 0.01),
    "delta": ({"loss_type": "dapo", "delta": 1.5}, 4, 1.0),
    "k3": ({"loss_type": "dapo", "beta": 0.04, "use_bias_correction_kl": False}, 4, 0.3),
    "k3_is": ({"loss_type": "dapo", "beta": 0.04}, 4, 0.3),
    "bnpo": ({"loss_type": "bnpo"}, 8, 0.3),
    "entropy": ({"loss_type": "dapo", "entropy_coef": 0.1}, 8, 0.3),
    "masked grpo": ({"loss_type": "grpo", "mask_truncated_completions": True}, 4, 0.3),
    "token_truncate": ({"loss_type": "dapo", "use_vllm": True,
                        "vllm_importance_sampling_mode": "token_truncate",
                        "vllm_importance_sampling_clip_max": 1.5}, 4, 0.3),
    "sequence_truncate": ({"loss_type": "dapo", "use_vllm": True,
                           "vllm_importance_sampling_mode": "sequence_truncate",
                           "vllm_importance_sampling_clip_max": 1.5}, 4, 0.3),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(TRL_CONFIGS))
def test_trl_rows_convert_to_trls_loss(name: str) -> None:
    """Each config of a TRL row: the converted spec, exactly as written (no note but the
    engine's), computes TRL's loss; the variant is the method's."""
    options, micro, spread = TRL_CONFIGS[name]
    case = fixed(spread=spread)
    config = {**options, "num_generations": 4, "max_completion_length": case.t}
    spec, notes = convert("trl", config)
    assert [n for n in notes if not n.startswith("# differs: use_vllm")] == [], notes
    variant = {"cispo": "cispo", "gspo": "gspo"}.get(name, "grpo")
    assert spec["variant"] == variant
    theirs = test_trl.trl_loss(case, micro, **options)
    close(theirs, ppokit_loss(spec_of("trl", config, case.t), case, case.fresh(), micro))


def test_trl_dapo_clip_higher_is_the_dapo_variant() -> None:
    """``loss_type: dapo`` with ``epsilon_high``: the ``dapo`` variant, its dynamic sampling
    and overlong punishment set back (TRL has neither)."""
    spec, notes = convert("trl", {"loss_type": "dapo", "epsilon_high": 0.28})
    assert spec["variant"] == "dapo" and notes == []
    assert spec["rollout"]["filter"] == "none" and spec["truncation"] == "terminal"


VERL_ESTIMATORS = ["rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax",
                   "opo", "gae", "grpo"]  # fmt: skip


@pytest.mark.parametrize("estimator", VERL_ESTIMATORS)
def test_verl_adv_estimators_convert_to_verls_loss(estimator: str) -> None:
    """``algorithm.adv_estimator``: the variant of the estimator (``gae``: ``ppo``, with a
    critic), its settings that differ written out; the spec computes verl's advantage and
    loss (``grpo`` here with ``norm_adv_by_std_in_grpo: false``: ``dr_grpo``)."""
    from tests.peers import test_verl_advantage as adv

    case = fixed()
    algorithm: dict[str, Any] = {"adv_estimator": estimator, "gamma": 0.9, "lam": 0.95}
    if estimator == "grpo":
        algorithm["norm_adv_by_std_in_grpo"] = False
    config = {"algorithm": algorithm,
              "actor_rollout_ref": {"rollout": {"n": 4}, "actor": {"clip_ratio_high": 0.28}}}  # fmt: skip
    spec, notes = convert("verl", config)
    assert notes == [], notes
    assert spec["variant"] == {"gae": "ppo", "grpo": "dr_grpo", "reinforce_plus_plus": "reinforce_pp", "reinforce_plus_plus_baseline": "reinforce_pp_baseline"}.get(estimator, estimator)  # fmt: skip
    advantage, _ = adv.verl_advantage(case, estimator, gamma=0.9, lam=0.95, norm_by_std=False)
    theirs = test_verl.verl_loss(case, 4, "token-mean", adv=advantage)
    fields = {"values": adv.values_of(case), "baseline_rewards": adv.baselines_of(case)}
    close(theirs, ppokit_loss(spec_of("verl", config, case.t), case, case.fresh(), 4, **fields))


#: a gae config's critic and actor options, and the critic's ``loss_agg_mode`` and
#: ``loss_scale_factor`` verl uses (unset: the actor's)
VALUE_CONFIGS: dict[str, tuple[dict[str, Any], str, float | None]] = {
    "default": ({}, "token-mean", None),
    "actor's mode": ({"actor_rollout_ref": {"actor": {"loss_agg_mode": "seq-mean-token-mean"}}},
                     "seq-mean-token-mean", None),
    "actor's norm": ({"actor_rollout_ref": {"actor": {"loss_agg_mode": "seq-mean-token-sum-norm",
                                                      "loss_scale_factor": 8}}},
                     "seq-mean-token-sum-norm", 8.0),
    "critic's mode": ({"actor_rollout_ref": {"actor": {"loss_agg_mode": "seq-mean-token-mean"}},
                       "critic": {"loss_agg_mode": "seq-mean-token-sum"}}, "seq-mean-token-sum", None),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(VALUE_CONFIGS))
def test_verl_gae_converts_to_verls_value_loss(name: str) -> None:
    """``adv_estimator: gae`` with ``critic.cliprange_value`` and the critic's
    ``loss_agg_mode`` and ``loss_scale_factor`` (unset: the actor's): the converted spec's
    critic loss, ``vf_coef`` included, is verl's value loss on verl's returns, and so is its
    gradient w.r.t. the values."""
    options, mode, scale = VALUE_CONFIGS[name]
    case = fixed()
    config = {**options, "algorithm": {"adv_estimator": "gae", "gamma": 0.9, "lam": 0.95}}
    config.setdefault("critic", {})["cliprange_value"] = 0.2
    _, notes = convert("verl", config)
    assert notes == [], notes
    spec = spec_of("verl", config, case.t)
    assert spec.critic.loss.name == "clipped_mse" and spec.critic.loss.params["clip"] == 0.2
    theirs = test_verl.verl_value_loss(case, 4, mode, 0.2, gamma=0.9, lam=0.95, scale=scale)
    test_verl.same(theirs, test_verl.our_value_loss(case, 4, spec))


@pytest.mark.parametrize("kind", ["kl", "low_var_kl", "mse"])
def test_verl_kl_in_reward_converts_to_verls_rewards(kind: str) -> None:
    """``adv_estimator: gae`` with ``use_kl_in_reward``, ``kl_penalty`` and
    ``kl_ctrl.kl_coef``: the converted spec's token rewards after its KL in the reward are
    verl's ``apply_kl_penalty``'s, and its actor's and critic's losses are verl's on the
    GAE advantage and returns of those rewards."""
    from tests.peers.test_verl_advantage import values_of

    case = fixed()
    algorithm = {"adv_estimator": "gae", "gamma": 0.9, "lam": 0.95, "use_kl_in_reward": True,
                 "kl_penalty": kind, "kl_ctrl": {"kl_coef": 0.1}}  # fmt: skip
    config = {"algorithm": algorithm,
              "actor_rollout_ref": {"rollout": {"n": 4}, "actor": {"clip_ratio_high": 0.28}}}  # fmt: skip
    _, notes = convert("verl", config)
    assert notes == [], notes
    spec = spec_of("verl", config, case.t)
    assert spec.kl is not None and spec.kl.placement == "reward"
    data = test_verl.Data(case)
    test_verl.apply_kl_penalty()(data, test_verl.core_algos.FixedKLController(0.1), kind)
    penalised = data.batch["token_level_rewards"]
    values = values_of(case)
    _, mine, _ = update_data(spec, case, values=values)
    torch.testing.assert_close(mine.batch.token_rewards * case.mask, penalised, rtol=1e-5, atol=1e-6)  # fmt: skip
    adv, _ = test_verl.core_algos.compute_gae_advantage_return(
        penalised, values, case.mask.float(), 0.9, 0.95
    )
    theirs = test_verl.verl_loss(case, 4, "token-mean", adv=adv)
    close(theirs, ppokit_loss(spec, case, case.fresh(), 4, values=values))
    theirs = test_verl.verl_value_loss(case, 4, "token-mean", 0.5, 0.9, 0.95, rewards=penalised)
    test_verl.same(theirs, test_verl.our_value_loss(case, 4, spec))


def test_verl_adaptive_kl_converts_to_verls_beta() -> None:
    """``kl_ctrl.type: adaptive`` with ``target_kl: t``: ``kl.target: t × L`` (L the
    response length) with a ``# differs`` line; on responses of L tokens β after the round
    is verl's ``AdaptiveKLController``'s."""
    case = fixed([4] * 8, seed=3)
    k2 = 0.5 * (case.logp_old - case.logp_ref).square() * case.mask
    target = 1.1 * float(k2.sum(1).div(case.lengths).mean())  # inside the ±20% band
    kl_ctrl = {"type": "adaptive", "kl_coef": 0.1, "target_kl": target, "horizon": 100}
    config = {"algorithm": {"adv_estimator": "grpo", "use_kl_in_reward": True,
                            "kl_penalty": "mse", "kl_ctrl": kl_ctrl},
              "data": {"max_response_length": 4}, "actor_rollout_ref": {"rollout": {"n": 4}}}  # fmt: skip
    _, notes = convert("verl", config)
    assert [n.split(":")[1] for n in notes] == [" algorithm.kl_ctrl.target_kl"], notes
    control = test_verl.core_algos.AdaptiveKLController(0.1, target, 100)
    test_verl.apply_kl_penalty()(test_verl.Data(case), control, "mse")
    assert control.value != 0.1
    _, _, beta = update_data(spec_of("verl", config, case.t), case)
    assert float(beta) == pytest.approx(control.value, abs=1e-7)


#: the actor options of tests/peers/test_verl.py's rows and verl_loss's arguments
VERL_CONFIGS: dict[str, tuple[dict[str, Any], dict[str, Any], float]] = {
    "gspo": ({"policy_loss": {"loss_mode": "gspo"}, "clip_ratio_low": 3e-3,
              "clip_ratio_high": 4e-3, "loss_agg_mode": "seq-mean-token-mean"},
             {"loss_mode": "gspo", "clip_ratio_low": 3e-3, "clip_ratio_high": 4e-3}, 0.01),
    "cispo": ({"policy_loss": {"loss_mode": "cispo"}, "clip_ratio_low": 1.0,
               "clip_ratio_high": 0.3},
              {"loss_mode": "cispo", "clip_ratio_low": 1.0, "clip_ratio_high": 0.3}, 0.5),
    "k3+": ({"use_kl_loss": True, "kl_loss_type": "k3+", "kl_loss_coef": 0.1},
            {"kl": "k3+", "kl_coef": 0.1}, 0.3),
    "abs": ({"use_kl_loss": True, "kl_loss_type": "abs", "kl_loss_coef": 0.1},
            {"kl": "abs", "kl_coef": 0.1}, 0.3),
    "norm": ({"loss_agg_mode": "seq-mean-token-sum-norm", "loss_scale_factor": 8},
             {"scale": 8}, 0.3),
    "seq-mean-token-sum": ({"loss_agg_mode": "seq-mean-token-sum"}, {}, 0.3),
    "entropy": ({"entropy_coeff": 0.05}, {"entropy_coeff": 0.05}, 0.3),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(VERL_CONFIGS))
def test_verl_rows_convert_to_verls_loss(name: str) -> None:
    """Each actor config of a verl row: the converted spec, exactly as written (no note),
    computes verl's loss."""
    actor, kw, spread = VERL_CONFIGS[name]
    case = fixed(spread=spread)
    config = {"algorithm": {"adv_estimator": "grpo"},
              "actor_rollout_ref": {"rollout": {"n": 4}, "actor": {"clip_ratio_high": 0.28, **actor}}}  # fmt: skip
    _, notes = convert("verl", config)
    assert notes == [], notes
    mode = actor.get("loss_agg_mode", "token-mean")
    theirs = test_verl.verl_loss(case, 4, mode, **kw)
    close(theirs, ppokit_loss(spec_of("verl", config, case.t), case, case.fresh(), 4))


def test_verl_options_without_equivalent_are_one_line_each() -> None:
    config = {"algorithm": {"adv_estimator": "gpg"},
              "actor_rollout_ref": {"rollout": {"n": 4},
                                    "actor": {"policy_loss": {"loss_mode": "clip_cov"},
                                              "loss_agg_mode": "token-sum"}}}  # fmt: skip
    spec, notes = convert("verl", config)
    assert spec["variant"] == "grpo"
    a = "actor_rollout_ref.actor."
    assert notes == [
        "# no equivalent: algorithm.adv_estimator: gpg: grpo used",
        f"# no equivalent: {a}policy_loss.loss_mode: clip_cov: ppo_clip used",
        f"# no equivalent: {a}loss_agg_mode: token-sum: token_mean used",
    ]
    cispo = {"policy_loss": {"loss_mode": "cispo"}}
    _, notes = convert("verl", {"actor_rollout_ref": {"actor": cispo}})
    assert any(n.startswith(f"# differs: {a}clip_ratio_low: cispo") for n in notes)
