"""TRL 1.16's ``GRPOTrainer`` without a model: the trainer object made with
``object.__new__`` and the attributes its ``__init__`` sets from a ``GRPOConfig``; its model
forward (``_get_per_token_logps_and_entropies``), generation (``_generate``) and reward
functions (``_calculate_rewards``) replaced by a :class:`~tests.helpers.peers.Case`'s
log-probs, responses and rewards. Everything else (the advantage in
``_generate_and_score_completions``, the loss in ``_compute_loss``) is TRL's own code."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor

from tests.helpers.peers import Case

EOS, PAD = 1, 0


class Accelerator:
    """One process."""

    num_processes, process_index, device, sync_gradients = 1, 0, torch.device("cpu"), True

    def gather(self, t: Tensor) -> Tensor:
        return t.reshape(-1) if t.dim() == 0 else t

    gather_for_metrics = gather

    def reduce(self, t: Tensor, reduction: str = "sum") -> Tensor:
        return t

    def unwrap_model(self, model: Any) -> Any:
        return model


def trainer(config: Any, case: Case) -> Any:
    """A ``GRPOTrainer`` of ``config`` whose model gives ``case``'s log-probs."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    tr: Any = object.__new__(GRPOTrainer)
    a = config
    tr.args = a
    for name in (
        "use_vllm", "vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
        "vllm_importance_sampling_clip_max", "vllm_importance_sampling_clip_min", "loss_type",
        "multi_objective_aggregation", "scale_rewards", "importance_sampling_level",
        "off_policy_mask_threshold", "mask_truncated_completions", "top_entropy_quantile",
        "entropy_coef", "use_adaptive_entropy", "max_completion_length", "num_iterations",
        "beta", "num_generations", "pad_to_multiple_of",
    ):  # fmt: skip
        setattr(tr, name, getattr(a, name))
    tr.epsilon_low = a.epsilon
    tr.epsilon_high = a.epsilon_high if a.epsilon_high is not None else a.epsilon
    tr._entropy_bonus_enabled = a.entropy_coef != 0.0 or a.use_adaptive_entropy
    tr._last_world_entropy, tr._entropy_window_stats = float("inf"), None
    tr.aux_loss_enabled = False
    tr.num_generations_eval = a.num_generations
    tr._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    tr._logs = {k: [] for k in ("prompt", "completion", "advantages", "images")}
    tr._logs.update(rewards=defaultdict(list), extra=defaultdict(list))
    tr._pending_extra_logs, tr._pending_metrics = defaultdict(list), defaultdict(list)
    tr.accelerator = Accelerator()
    tr.model = SimpleNamespace(training=True, is_gradient_checkpointing=False)
    tr.ref_model = SimpleNamespace(training=False)
    tr.current_gradient_accumulation_steps = a.gradient_accumulation_steps
    tr.eos_token_ids = [EOS]
    tr._tokenizer = SimpleNamespace(pad_token_id=PAD)
    tr.reward_weights = torch.ones(1)
    tr.reward_func_names = ["r"]
    tr.reward_funcs = [None]
    return tr


def completions(case: Case) -> list[list[int]]:
    """Token ids: an EOS last unless the response is truncated."""
    out = []
    for n, cut in zip(case.lengths.tolist(), case.truncated.tolist(), strict=True):
        out.append([2] * n if cut else [2] * (n - 1) + [EOS])
    return out


def generation_batch(tr: Any, case: Case) -> dict[str, Any]:
    """TRL's ``_generate_and_score_completions`` on ``case``: its advantages, masks, π_old,
    π_ref and vLLM importance weights (μ = ``case.logp_rollout``)."""
    ids = completions(case)
    rows = [[float(x) for x in row[:n]] for row, n in zip(case.logp_rollout.tolist(), case.lengths.tolist(), strict=True)]  # fmt: skip

    def generate(prompts: list[Any]) -> tuple[Any, ...]:
        return [[5, 6]] * len(prompts), ids, None, ["x"] * len(prompts), rows, {}, None, None

    def forward(model: Any, ids: Tensor, attn: Tensor, width: int, **kw: Any) -> tuple[Any, ...]:
        return (case.logp_ref if model is tr.ref_model else case.logp_old)[:, :width], None, None

    tr._generate = generate
    tr._get_per_token_logps_and_entropies = forward
    tr._calculate_rewards = lambda *args: case.rewards[:, None].clone()
    tr.tools, tr.environment_factories, tr.log_multimodal = None, None, False
    tr.environments = None
    inputs = [{"prompt": "p"} for _ in range(case.b)]
    out = tr._generate_and_score_completions(inputs)
    # TRL skips π_old when the batch's first iteration is on-policy (its log-probs detached):
    # a later iteration (num_iterations > 1) reads the generating weights', the case's here
    out.setdefault("old_per_token_logps", case.logp_old[:, : out["completion_ids"].shape[1]])
    return out


def loss(tr: Any, case: Case, out: dict[str, Any], logp: Tensor, rows: Tensor) -> Tensor:
    """TRL's ``_compute_loss`` of the micro-batch ``rows`` with the policy's ``logp``."""
    t = out["completion_ids"].shape[1]
    inputs = {k: (v[rows] if torch.is_tensor(v) and v.dim() > 0 else v) for k, v in out.items()}

    def forward(model: Any, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor, None]:
        return logp[rows][:, :t], case.entropy[rows][:, :t], None

    tr._get_per_token_logps_and_entropies = forward
    return tr._compute_loss(tr.model, inputs)
