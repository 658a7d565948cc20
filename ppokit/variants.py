"""The built-in variants: every paper method as the part of a spec its paper sets.

A variant is a :class:`~ppokit.catalogue.Variant` entry, registered by the default plugin
through ``register(entry)`` as a plugin's variant is. Its settings are the algorithm (the
slots, the rollout settings the method defines, the training settings its paper prescribes);
the task (prompts, reward, generation length), the model and the budget are the spec's. A
spec names one (``variant: dapo``) and sets only what differs; ``ppokit variants`` lists
them, ``ppokit show variant NAME`` shows one, docs/variants.md is generated from them.

The paper settings are those of a GPU-sized run of a small model (``scaled`` says what each
scales down from its paper). ``ppo_demo`` is the packaged demo's PPO, sized for the tiny model
on the demo task.

Nothing here imports torch.
"""

from __future__ import annotations

from ppokit import papers
from ppokit.catalogue import Variant

__all__ = ["ENTRIES"]

#: The generation budget, read from the merged spec (the task's, or the spec's own).
BUDGET = "${rollout.max_new_tokens}"

#: A round of a GPU-sized run of a small model: what most paper variants share.
_ROUND = {"rounds": 200, "ppo_epochs": 1}

PPO_DEMO = Variant(
    "ppo_demo",
    "PPO with GAE and a separate critic, sized for the tiny model on the demo task",
    {
        "model": {"critic": "separate"},
        "rollout": {"prompts_per_round": 16, "n": 8},
        "advantage": {"name": "gae", "gamma": 1.0, "lam": 0.95},
        "critic": {"target": {"name": "lambda_return", "gamma": 1.0, "lam": 0.95}, "loss": "mse"},
        "truncation": "terminal",
        "policy": {"loss": "ppo_clip", "aggregation": "token_mean", "entropy_coef": 0.03},
        "train": {
            "rounds": 100,
            "ppo_epochs": 2,
            "minibatch_size": 64,
            "actor_lr": 0.001,
            "lr_schedule": "cosine",
            "min_lr_ratio": 0.1,
            "critic_lr": 0.003,
            "max_grad_norm": 1.0,
        },
    },
    papers=(papers.PPO, papers.GAE),
    choices="GAE (gamma 1, lambda 0.95) with a separate critic trained on lambda-returns (MSE); "
    "PPO clip 0.2; token-mean loss; an entropy bonus of 0.03; truncated responses end the "
    "episode (truncation: terminal); two epochs over one minibatch; cosine learning rate.",
    scaled="Learning rates of 1e-3 (actor) and 3e-3 (critic) and 100 rounds: what a randomly "
    "initialised tiny model needs to learn the demo in about 25 s on a CPU.",
)

PPO = Variant(
    "ppo",
    "PPO for RLHF with the well-known implementation details",
    {
        "model": {"critic": "separate"},
        "rollout": {"prompts_per_round": 64, "n": 1, "temperature": 0.7},
        "truncation": {"name": "penalty", "value": -1.0},
        "kl": {"estimator": "k1", "coef": 0.05, "placement": "reward"},
        "advantage": {"name": "gae", "gamma": 1.0, "lam": 0.95, "whiten": True},
        "critic": {
            "target": {"name": "lambda_return", "gamma": 1.0, "lam": 0.95},
            "loss": {"name": "clipped_mse", "clip": 0.2},
        },
        "policy": {
            "loss": {"name": "ppo_clip", "clip_low": 0.2, "clip_high": 0.2},
            "aggregation": "token_mean",
        },
        "train": {
            "rounds": 200,
            "ppo_epochs": 4,
            "minibatch_size": 16,
            "actor_lr": 3.0e-6,
            "critic_lr": 3.0e-6,
            "vf_coef": 0.1,
        },
    },
    papers=(papers.N_PLUS, papers.PPO, papers.GAE),
    choices="GAE with gamma 1 and lambda 0.95, advantages whitened over the batch; the KL to "
    "the reference policy added to the per-token reward (k1, beta 0.05); responses that hit "
    "the length limit without EOS get a fixed penalty score; clipped value loss (0.2); PPO "
    "clip 0.2; 4 PPO epochs over minibatches; token-mean loss.",
    scaled="64 prompts a round with one response each and learning rates of 3e-6: a round a "
    "GPU runs quickly with a model of about 100M parameters.",
)

VC_PPO = Variant(
    "vc_ppo",
    "VC-PPO: value-calibrated PPO for long chain-of-thought",
    {
        "model": {"critic": "separate"},
        "rollout": {"prompts_per_round": 32, "n": 4},
        "advantage": {"name": "gae", "gamma": 1.0, "lam": 0.95, "whiten": True},
        "critic": {"target": {"name": "lambda_return", "gamma": 1.0, "lam": 1.0}, "loss": "mse"},
        "policy": {
            "loss": {"name": "ppo_clip", "clip_low": 0.2, "clip_high": 0.2},
            "aggregation": "token_mean",
        },
        "train": {
            **_ROUND,
            "minibatch_size": 32,
            "actor_lr": 1.0e-6,
            "critic_lr": 2.0e-6,
            "critic_warmup_rounds": 20,
        },
    },
    papers=(papers.VC_PPO,),
    choices="value pretraining (critic-only rounds before the actor moves, from a critic "
    "initialised from the policy); decoupled GAE: the actor uses lambda 0.95, the critic's "
    "target lambda 1.0 (unbiased Monte-Carlo-like returns); gamma 1; no KL; PPO clip 0.2.",
    scaled="20 critic-only rounds of a 200-round run; 32 prompts a round with 4 samples each.",
)

VAPO = Variant(
    "vapo",
    "VAPO: value-based augmented PPO for reasoning",
    {
        "model": {"critic": "separate"},
        "rollout": {"prompts_per_round": 16, "n": 8},
        "advantage": {"name": "length_adaptive_gae", "gamma": 1.0, "alpha": 0.05, "whiten": True},
        "critic": {"target": {"name": "lambda_return", "gamma": 1.0, "lam": 1.0}, "loss": "mse"},
        "policy": {
            "loss": {"name": "ppo_clip", "clip_low": 0.2, "clip_high": 0.28},
            "aggregation": "token_mean",
            "nll_coef": 0.1,
        },
        "train": {
            **_ROUND,
            "minibatch_size": 32,
            "actor_lr": 1.0e-6,
            "critic_lr": 2.0e-6,
            "critic_warmup_rounds": 20,
        },
    },
    papers=(papers.VAPO,),
    choices="value pretraining; decoupled GAE (critic lambda 1.0); length-adaptive GAE for the "
    "actor, lambda = 1 - 1/(alpha * length) with alpha 0.05; clip-higher (0.2 / 0.28); "
    "token-level loss (token_mean); an NLL term on positive examples (weight 0.1); group "
    "sampling; actor lr 1e-6, critic lr 2e-6; no KL.",
    scaled="16 prompts a round with 8 samples each, and 20 critic-only rounds of a 200-round run.",
)

GRPO = Variant(
    "grpo",
    "GRPO: group relative policy optimisation, no critic",
    {
        "rollout": {"prompts_per_round": 16, "n": 16},
        "advantage": {"name": "grpo", "eps": 1.0e-6},
        "kl": {"estimator": "k3", "coef": 0.04, "placement": "loss"},
        "policy": {
            "loss": {"name": "ppo_clip", "clip_low": 0.2, "clip_high": 0.2},
            "aggregation": "seq_mean_token_mean",
        },
        "train": {**_ROUND, "minibatch_size": 64, "actor_lr": 1.0e-6},
    },
    papers=(papers.GRPO,),
    choices="advantage = (R - group mean) / group std over the responses to one prompt; PPO "
    "clip 0.2; the KL to the reference as a loss term with the k3 estimator, beta 0.04; "
    "per-sequence mean of per-token losses (seq_mean_token_mean); lr 1e-6.",
    scaled="16 samples per prompt (the paper's 64), to fit one GPU's round time.",
)

GRPO_TIS = Variant(
    "grpo_tis",
    "GRPO with truncated importance sampling (TIS) against the rollout mismatch",
    {
        "rollout": {"engine": {"name": "hf", "dtype": "bfloat16"}},
        "policy": {"correction": {"name": "token_tis", "cap": 2.0}},
    },
    papers=(papers.GRPO, papers.OFF_POLICY),
    choices="GRPO (its variant, extended); the rollout engine samples in bfloat16 while the "
    "trainer computes in float32, as a fast inference engine does, so log π_old is recomputed "
    "by the trainer (rollout.logp_old: auto) and each token's policy-gradient term is weighted "
    "by min(π_old/μ, 2), the cap of the paper and of verl's and TRL's defaults.",
    scaled="As grpo.",
    base="grpo",
)

DR_GRPO = Variant(
    "dr_grpo",
    "Dr. GRPO: GRPO done right",
    {
        "rollout": {"prompts_per_round": 16, "n": 8},
        "advantage": "dr_grpo",
        "policy": {
            "loss": {"name": "ppo_clip", "clip_low": 0.2, "clip_high": 0.2},
            "aggregation": {"name": "seq_mean_token_sum_norm", "norm": BUDGET},
        },
        "train": {**_ROUND, "minibatch_size": 32, "actor_lr": 1.0e-6},
    },
    papers=(papers.DR_GRPO,),
    choices="advantage R - group mean without dividing by the group std (no question-level "
    "difficulty bias); token sums normalised by a constant, the generation budget "
    "(rollout.max_new_tokens), instead of each response's length (no length bias); no KL; "
    "PPO clip 0.2; 8 samples per prompt.",
    scaled="The paper's settings, at a small model's round size.",
)

DAPO = Variant(
    "dapo",
    "DAPO: decoupled clip and dynamic sampling policy optimisation",
    {
        "rollout": {
            "prompts_per_round": 16,
            "n": 16,
            "filter": "informative",
            "max_generation_batches": 10,
            "filter_exhausted": "train",
        },
        "truncation": {
            "name": "soft_overlong",
            "max_length": BUDGET,
            "buffer": "${(rollout.max_new_tokens + 4) // 5}",
            "factor": 1.0,
        },
        "advantage": "grpo",
        "policy": {
            "loss": {"name": "ppo_clip", "clip_low": 0.2, "clip_high": 0.28},
            "aggregation": "token_mean",
        },
        "train": {**_ROUND, "minibatch_size": 64, "actor_lr": 1.0e-6},
    },
    papers=(papers.DAPO,),
    choices="group-normalised advantages; clip-higher (eps_low 0.2, eps_high 0.28); token-level "
    "policy loss (token_mean over the batch); dynamic sampling (section 3.2): the round "
    "over-samples, drawing batches of prompts until prompts_per_round groups whose rewards "
    "are not all equal have been generated (rollout.filter: informative; at most 10 batches a "
    "round, then it trains on the groups it has, as verl's DAPO recipe bounds its generation "
    "batches); soft overlong punishment over the last fifth of the generation budget (the "
    "paper's 4096 of 20480 tokens); no KL; 16 samples per prompt; lr 1e-6. The zero-weighting "
    "alternative keeps one batch and gives the uninformative groups weight 0 instead "
    "(rollout.filter: none, policy.weight: informative_groups).",
    scaled="16 prompts a round (the paper's 512); the overlong buffer a fifth of the "
    "generation budget, as in the paper.",
)

RLOO = Variant(
    "rloo",
    "RLOO: REINFORCE with a leave-one-out baseline",
    {
        "rollout": {"prompts_per_round": 32, "n": 4},
        "kl": {"estimator": "k1", "coef": 0.05, "placement": "reward"},
        "advantage": "rloo",
        "policy": {"loss": "reinforce", "aggregation": "seq_mean_token_sum"},
        "train": {**_ROUND, "actor_lr": 1.0e-6},
    },
    papers=(papers.RLOO,),
    choices="k = 4 samples per prompt, each baselined by the mean score of the other k - 1; "
    "the whole response is one action (sequence-level REINFORCE: token log-probs summed); "
    "on-policy, one update per batch; KL to the reference in the reward (beta 0.05).",
    scaled="The paper's k = 4, at a small model's round size.",
)

REINFORCE_PP = Variant(
    "reinforce_pp",
    "REINFORCE++: REINFORCE with PPO's stabilisers and global advantage normalisation",
    {
        "rollout": {"prompts_per_round": 128, "n": 1},
        "kl": {"estimator": "k1", "coef": 0.01, "placement": "reward"},
        "advantage": {"name": "reinforce_pp", "gamma": 1.0},
        "policy": {
            "loss": {"name": "ppo_clip", "clip_low": 0.2, "clip_high": 0.2},
            "aggregation": "token_mean",
        },
        "train": {**_ROUND, "minibatch_size": 64, "actor_lr": 5.0e-7},
    },
    papers=(papers.REINFORCE_PP,),
    choices="no critic; the token-level KL penalty in the reward (k1, beta 0.01); discounted "
    "reward-to-go (gamma 1) whitened over the whole batch; PPO clip 0.2; token-mean loss; "
    "one response per prompt.",
    scaled="128 prompts a round, at a small model's learning rate.",
)

REINFORCE_PP_BASELINE = Variant(
    "reinforce_pp_baseline",
    "REINFORCE++-baseline: group-mean baseline, then global normalisation",
    {
        "rollout": {"prompts_per_round": 16, "n": 8},
        "kl": {"estimator": "k2", "coef": 0.001, "placement": "loss"},
        "advantage": "reinforce_pp_baseline",
        "policy": {
            "loss": {"name": "ppo_clip", "clip_low": 0.2, "clip_high": 0.2},
            "aggregation": "token_mean",
        },
        "train": {**_ROUND, "minibatch_size": 64, "actor_lr": 1.0e-6},
    },
    papers=(papers.REINFORCE_PP,),
    choices="the variant for reasoning tasks: several samples per prompt; advantage = R - "
    "group mean, whitened over the batch; the KL as a loss term with the k2 estimator (its "
    "gradient is the unbiased KL gradient), beta 0.001; PPO clip 0.2; token-mean loss.",
    scaled="8 samples per prompt, at a small model's round size.",
)

REMAX = Variant(
    "remax",
    "ReMax: REINFORCE with the greedy response's reward as baseline",
    {
        "rollout": {"prompts_per_round": 64, "n": 1},
        "kl": {"estimator": "k1", "coef": 0.05, "placement": "reward"},
        "advantage": "remax",
        "policy": {"loss": "reinforce", "aggregation": "seq_mean_token_sum"},
        "train": {**_ROUND, "actor_lr": 1.0e-6},
    },
    papers=(papers.REMAX,),
    choices="no critic; one sampled response per prompt plus one greedy response whose score "
    "is the baseline (the trainer adds the greedy rollout because the estimator requires "
    "baseline_rewards); sequence-level REINFORCE (token log-probs summed); on-policy; KL to "
    "the reference in the reward.",
    scaled="64 prompts a round, at a small model's learning rate.",
)

OPO = Variant(
    "opo",
    "OPO: on-policy RL with the optimal reward baseline",
    {
        "rollout": {"prompts_per_round": 16, "n": 8},
        "advantage": "opo",
        "policy": {"loss": "reinforce", "aggregation": "token_mean"},
        "train": {**_ROUND, "actor_lr": 1.0e-6},
    },
    papers=(papers.OPO,),
    choices="exact on-policy training (one update per batch, no ratio clipping needed: plain "
    "REINFORCE); the length-weighted group baseline sum_j(l_j R_j) / sum_j(l_j), the "
    "variance-minimising baseline under the paper's assumptions; no KL; 8 samples per prompt.",
    scaled="8 samples per prompt, at a small model's round size.",
)

GSPO = Variant(
    "gspo",
    "GSPO: group sequence policy optimisation",
    {
        "rollout": {"prompts_per_round": 16, "n": 8},
        "advantage": "grpo",
        "policy": {
            "loss": {"name": "gspo", "clip_low": 3.0e-4, "clip_high": 4.0e-4},
            "aggregation": "seq_mean_token_mean",
        },
        "train": {**_ROUND, "minibatch_size": 32, "actor_lr": 1.0e-6},
    },
    papers=(papers.GSPO,),
    choices="the importance ratio is defined per sequence, exp(mean_t log(pi/mu)), and clipped "
    "per sequence with a tight band (3e-4 below, 4e-4 above); group-normalised advantages; "
    "per-sequence loss averaging; no KL; minibatches so that later ones are off-policy.",
    scaled="8 samples per prompt, at a small model's round size.",
)

CISPO = Variant(
    "cispo",
    "CISPO: clipped importance-sampling-weight policy optimisation",
    {
        "rollout": {"prompts_per_round": 16, "n": 8},
        "advantage": "grpo",
        "policy": {"loss": {"name": "cispo", "clip_high": 4.0}, "aggregation": "token_mean"},
        "train": {**_ROUND, "minibatch_size": 32, "actor_lr": 1.0e-6},
    },
    papers=(papers.CISPO,),
    choices="instead of clipping the update, clip the (stop-gradient) importance weight from "
    "above and keep every token's gradient, -sg(min(rho, 1 + eps_high)) A log pi; no lower "
    "clip; group-normalised advantages; token-level averaging; no KL; minibatches.",
    scaled="8 samples per prompt, at a small model's round size.",
)

GDPO = Variant(
    "gdpo",
    "GDPO: several rewards, each normalised within its group apart, then summed and "
    "batch-normalised",
    {
        "rollout": {
            "prompts_per_round": 16,
            "n": 8,
            "filter": "informative",
            "max_generation_batches": 4,
            "filter_exhausted": "train",
        },
        "advantage": {"name": "gdpo", "eps": 1.0e-6},
        "policy": {
            "loss": {"name": "ppo_clip", "clip_low": 0.2, "clip_high": 0.2},
            "aggregation": "token_mean",
        },
        "train": {**_ROUND, "minibatch_size": 64, "actor_lr": 1.0e-6},
    },
    papers=(papers.GDPO,),
    choices="each reward of the task's list is group-normalised apart, weighted and summed, "
    "then whitened over the batch, so a group where the correct replies are the badly formed "
    "ones still has a signal (GRPO on their sum would see a flat group); dynamic sampling "
    "keeps the groups that vary in either reward (rollout.filter: informative reads the parts "
    "when the advantage does); PPO clip 0.2; token-level loss; no KL; lr 1e-6, as the paper's "
    "GRPO baseline. It needs a task (or spec) with several rewards.",
    scaled="8 samples per prompt, at a small model's round size.",
)

#: Every built-in variant, in the order docs/variants.md lists them.
ENTRIES: tuple[Variant, ...] = (
    PPO_DEMO,
    PPO,
    VC_PPO,
    VAPO,
    GRPO,
    GRPO_TIS,
    DR_GRPO,
    DAPO,
    RLOO,
    REINFORCE_PP,
    REINFORCE_PP_BASELINE,
    REMAX,
    OPO,
    GSPO,
    CISPO,
    GDPO,
)
