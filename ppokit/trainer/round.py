"""One PPO round: generate → reward → truncation rule → KL in the reward → advantages,
critic targets, position mask, prompt weights → ``ppo_epochs`` passes of minibatch updates.

Nothing in a round reads a tensor back to the host except the decoded responses the rewards
need and one read of the stacked metric tensors at its end.
"""

from __future__ import annotations

import math
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ppokit.batch import RolloutBatch
from ppokit.trainer.components import Components, aggregate, as_scores, denominator
from ppokit.trainer.logprobs import (
    response_hidden,
    sampled_logprobs,
    token_logprobs,
    trunk_hidden,
)
from ppokit.trainer.models import Models, autocast, trunk_of
from ppokit.trainer.rollout import Rollout, generate

__all__ = ["Learner", "RoundResult", "UpdateData", "explained_variance", "kl_controller_step"]


def _linear_warmup(steps: int) -> Callable[[int], float]:
    def factor(step: int) -> float:
        return 1.0 if steps <= 0 else min(1.0, (step + 1) / steps)

    return factor


def _ignore(name: str, value: Tensor) -> None:
    pass


def explained_variance(target: Tensor, pred: Tensor, mask: Tensor) -> Tensor:
    """1 − Var[Y − V] / Var[Y] over the masked positions (NaN when Var[Y] = 0)."""
    m = mask.float()
    n = m.sum().clamp_min(1.0)

    def var(x: Tensor) -> Tensor:
        mu = (x * m).sum() / n
        return ((x - mu) ** 2 * m).sum() / n

    vy = var(target.float())
    resid = var(target.float() - pred.float())
    return torch.where(vy > 0, 1 - resid / vy.clamp_min(1e-30), torch.full_like(vy, math.nan))


def peak_memory_gb(device: torch.device) -> float:
    """Peak memory so far: the CUDA caching allocator's peak, else the process's max RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


def kl_controller_step(
    beta: Tensor, kl: Tensor, target: float, horizon: int, n_samples: int
) -> Tensor:
    """Adaptive KL coefficient (Ziegler et al., 2019): β ← β·(1 + clip(KL/target − 1,
    −0.2, 0.2)·n/horizon), with KL the mean per-sequence KL of the last rollout."""
    error = (kl / target - 1.0).clamp(-0.2, 0.2)
    return beta * (1.0 + error * n_samples / horizon)


@dataclass
class UpdateData:
    """The tensors of one round the updates read (all ``[B, ...]`` on the device)."""

    rollout: Rollout
    batch: RolloutBatch
    advantages: Tensor
    actor_mask: Tensor  # bool [B, T]: response mask of rows with a positive policy weight
    policy_weights: Tensor  # [B]
    nll_mask: Tensor | None
    targets: Tensor | None = None
    value_mask: Tensor | None = None  # bool [B, T]
    value_weights: Tensor | None = None


@dataclass
class RoundResult:
    """Metric tensors of a round (read once at its end), host-side measurements (seconds
    per phase ``time_*``; on CUDA ``peak_memory_gb``, the caching allocator's peak of
    allocated memory so far, a host-side counter read without device synchronisation) and
    texts for samples."""

    metrics: dict[str, Tensor]
    timings: dict[str, float]
    prompts: list[str] = field(default_factory=list)
    responses: list[str] = field(default_factory=list)
    scores: Tensor | None = None


class Learner:
    """Models, components, optimizers and the adaptive KL state of a run."""

    def __init__(self, spec: Any, models: Models, comps: Components) -> None:
        self.spec = spec
        self.models = models
        self.comps = comps
        self.device = models.runtime.device
        t = spec.train
        self.actor_opt = torch.optim.AdamW(
            models.actor.parameters(), lr=t.actor_lr, weight_decay=t.weight_decay
        )
        self.actor_sched = torch.optim.lr_scheduler.LambdaLR(
            self.actor_opt, _linear_warmup(t.warmup_steps)
        )
        self.critic_opt: torch.optim.Optimizer | None = None
        self.critic_sched: torch.optim.lr_scheduler.LambdaLR | None = None
        if models.critic is not None:
            self.critic_opt = torch.optim.AdamW(
                list(models.critic_parameters()), lr=t.critic_lr, weight_decay=t.weight_decay
            )
            self.critic_sched = torch.optim.lr_scheduler.LambdaLR(
                self.critic_opt, _linear_warmup(t.warmup_steps)
            )
        coef = spec.kl.coef if spec.kl is not None else 0.0
        self.kl_coef = torch.tensor(coef, dtype=torch.float32, device=self.device)

    # ------------------------------------------------------------------ forwards
    @property
    def temperature(self) -> float:
        return float(self.spec.rollout.temperature)

    def actor_hidden(self, model: nn.Module, ro: Rollout) -> Tensor:
        """The trunk's hidden states ``[B, T+1, H]`` of the responses (no LM head)."""
        ids, attn = ro.inputs()
        with autocast(self.models.runtime):
            return response_hidden(trunk_hidden(trunk_of(model), ids, attn), ro.prompt_len)

    def actor_forward(self, model: nn.Module, ro: Rollout) -> tuple[Tensor, Tensor, Tensor]:
        """(log π [B,T], entropy [B,T], hidden states [B,T+1,H]) of the responses."""
        hidden = self.actor_hidden(model, ro)
        with autocast(self.models.runtime):
            logp, ent = token_logprobs(
                hidden[:, :-1], model.get_output_embeddings(), ro.response_ids, self.temperature
            )
        return logp, ent, hidden

    def reference_logprobs(self, ro: Rollout) -> Tensor:
        """log π_ref [B,T] of the responses (no entropy pass)."""
        ref = self.models.ref
        assert ref is not None
        hidden = self.actor_hidden(ref, ro)
        with autocast(self.models.runtime):
            return sampled_logprobs(
                hidden[:, :-1], ref.get_output_embeddings(), ro.response_ids, self.temperature
            )

    def critic_head_out(self, ro: Rollout, shared_hidden: Tensor | None) -> Tensor:
        """The value head's output ``[B, T+1, head_size]`` (state before each token, then the
        state after the last position)."""
        critic = self.models.critic
        assert critic is not None
        with autocast(self.models.runtime):
            if shared_hidden is None:
                ids, attn = ro.inputs()
                shared_hidden = response_hidden(
                    trunk_hidden(critic.trunk, ids, attn), ro.prompt_len
                )
            return critic(shared_hidden)

    def eval_mode(self) -> None:
        """Actor and critic in eval mode (the reference always is)."""
        self.models.actor.eval()
        if self.models.critic is not None:
            self.models.critic.eval()

    # ------------------------------------------------------------------ rollout
    def encode(self, prompts: list[str], n: int = 1) -> tuple[Tensor, Tensor]:
        """Left-padded prompt ids and attention mask on the device, each prompt ``n`` times
        (the chat template already holds its special tokens)."""
        enc = self.models.tokenizer(
            prompts,
            padding=True,
            return_tensors="pt",
            add_special_tokens=not self.spec.data.chat_template,
        )
        ids, attn = enc["input_ids"].to(self.device), enc["attention_mask"].to(self.device)
        if n > 1:
            ids, attn = ids.repeat_interleave(n, 0), attn.repeat_interleave(n, 0)
        return ids, attn

    def sample(self, prompts: list[str], n: int) -> Rollout:
        """``n`` sampled responses per prompt, under the spec's sampling settings."""
        r = self.spec.rollout
        return self._generate(prompts, n, temperature=r.temperature, top_k=r.top_k, top_p=r.top_p)

    def greedy(self, prompts: list[str]) -> Rollout:
        """One greedy response per prompt (the baseline of ``baseline_rewards``)."""
        return self._generate(prompts, 1, greedy=True)

    def _generate(self, prompts: list[str], n: int, **sampling: Any) -> Rollout:
        ids, attn = self.encode(prompts, n)
        with autocast(self.models.runtime):
            return generate(
                self.models.actor,
                self.models.tokenizer,
                ids,
                attn,
                max_new_tokens=self.spec.rollout.max_new_tokens,
                **sampling,
            )

    def decode(self, ro: Rollout) -> tuple[list[str], list[int], list[bool]]:
        """Response texts, lengths and truncation flags (one host read)."""
        tok = self.models.tokenizer
        ids = ro.response_ids.masked_fill(~ro.response_mask, tok.pad_token_id)
        packed = torch.cat(
            [ids, ro.response_mask.sum(1, keepdim=True), ro.truncated.long()[:, None]], 1
        ).cpu()
        texts = tok.batch_decode(packed[:, :-2], skip_special_tokens=True)
        return texts, packed[:, -2].tolist(), [bool(x) for x in packed[:, -1].tolist()]

    def score(
        self,
        prompts: list[str],
        responses: list[str],
        rows: list[dict[str, Any]],
        lengths: list[int],
        truncated: list[bool],
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Σ_k weight_k · reward_k, float32 [B], and each reward's scores."""
        columns = sorted({k for row in rows for k in row if k != "prompt"})
        fields: dict[str, list[Any]] = {c: [row.get(c) for row in rows] for c in columns}
        fields["lengths"] = lengths
        fields["truncated"] = truncated
        total = torch.zeros(len(responses), device=self.device)
        parts = {}
        for name, fn, weight in self.comps.rewards:
            s = as_scores(fn(prompts, responses, **fields), self.device)
            parts[name] = s
            total = total + weight * s
        return total, parts

    # ------------------------------------------------------------------ round
    def collect(
        self, rows: list[dict[str, Any]], formatted: list[str]
    ) -> tuple[UpdateData, RoundResult]:
        """Generate, score and estimate: everything up to the updates."""
        spec, comps, models = self.spec, self.comps, self.models
        n = spec.rollout.n
        timings: dict[str, float] = {}
        metrics: dict[str, Tensor] = {}
        self.eval_mode()  # sampling and scoring see no dropout
        start = time.perf_counter()
        with torch.no_grad():
            ro = self.sample(formatted, n)
        timings["time_generate"] = time.perf_counter() - start

        start = time.perf_counter()
        texts, lengths, truncated = self.decode(ro)
        expanded = [row for row in rows for _ in range(n)]
        raw_prompts = [row["prompt"] for row in expanded]
        scores, parts = self.score(raw_prompts, texts, expanded, lengths, truncated)
        baseline = None
        if "baseline_rewards" in comps.requires:
            with torch.no_grad():
                greedy = self.greedy(formatted)
            g_texts, g_len, g_trunc = self.decode(greedy)
            g_scores, _ = self.score([r["prompt"] for r in rows], g_texts, rows, g_len, g_trunc)
            baseline = g_scores.repeat_interleave(n)
        timings["time_score"] = time.perf_counter() - start

        start = time.perf_counter()
        mask = ro.response_mask
        b = mask.shape[0]
        token_rewards = torch.zeros(mask.shape, dtype=torch.float32, device=self.device)
        fields: dict[str, Tensor | None] = {
            "response_mask": mask,
            "token_rewards": token_rewards,
            "logp_old": ro.logp_old,
            "group_ids": torch.arange(b, device=self.device) // n,
            "truncated": ro.truncated,
            "baseline_rewards": baseline,
        }
        batch = RolloutBatch(**fields)  # type: ignore[arg-type]
        batch = batch.replace(token_rewards=torch.where(batch.last_mask, scores[:, None], 0.0))
        with torch.no_grad():
            if models.critic is not None:
                shared = None
                if models.shared_critic:
                    shared = self.actor_hidden(models.actor, ro)  # the trunk only
                head_out = self.critic_head_out(ro, shared)
                v_all = comps.value(head_out)
                rows_idx = torch.arange(b, device=self.device)
                batch = batch.replace(
                    values=v_all[:, :-1] * mask,
                    bootstrap_values=v_all[rows_idx, batch.last_index + 1],
                )
            if models.ref is not None:
                batch = batch.replace(logp_ref=self.reference_logprobs(ro) * mask)
        timings["time_logprob"] = time.perf_counter() - start

        batch = comps.truncation(batch)
        if comps.kl is not None:
            kl_tok = comps.kl(batch.logp_old, batch.logp_ref).float() * batch.maskf
            kl_seq = kl_tok.sum(1).mean()
            metrics["kl"] = kl_seq
            if spec.kl.placement == "reward":
                batch = batch.replace(token_rewards=batch.token_rewards - self.kl_coef * kl_tok)
            metrics["kl_coef"] = self.kl_coef.clone()
            if spec.kl.target is not None:
                self.kl_coef = kl_controller_step(
                    self.kl_coef, kl_seq, spec.kl.target, spec.kl.horizon, b
                )
        adv = comps.advantage(batch).float().detach()
        w_pol = comps.policy_weight(batch).float().detach()
        actor_mask = batch.response_mask & (w_pol > 0)[:, None]
        nll_mask = None
        if spec.policy.nll_coef > 0:
            nll_mask = actor_mask & (scores > 0)[:, None]
        data = UpdateData(ro, batch, adv, actor_mask, w_pol, nll_mask)
        batch_tokens = batch.lengths.sum().clamp_min(1)  # positions the estimators saw
        if models.critic is not None:
            assert comps.critic_target and comps.critic_mask and comps.critic_weight
            data.targets = comps.critic_target(batch).float().detach()
            data.value_mask = comps.critic_mask(batch).detach() > 0
            data.value_weights = comps.critic_weight(batch).float().detach()
            metrics["explained_variance"] = explained_variance(
                data.targets, batch.values, batch.response_mask
            )
            # mean |Y - V_old|: stays meaningful when Var[Y] is near 0 and EV is not
            value_error = ((data.targets - batch.values).abs() * batch.maskf).sum()
            metrics["value_error"] = value_error / batch_tokens
        maskf = mask.float()
        metrics["reward_mean"] = scores.mean()
        metrics["reward_std"] = scores.std() if b > 1 else torch.zeros((), device=self.device)
        metrics["response_length_mean"] = maskf.sum(1).mean()
        metrics["truncated_frac"] = ro.truncated.float().mean()
        metrics["advantage_mean"] = (adv * batch.maskf).sum() / batch_tokens
        metrics["tokens"] = maskf.sum()
        if len(parts) > 1:
            for name, s in parts.items():
                metrics[f"reward/{name}"] = s.mean()
        result = RoundResult(metrics, timings, raw_prompts, texts, scores)
        return data, result

    # ------------------------------------------------------------------ updates
    def update(self, data: UpdateData, train_actor: bool, result: RoundResult) -> None:
        """``ppo_epochs`` passes of shuffled minibatch steps with gradient accumulation."""
        start = time.perf_counter()
        t = self.spec.train
        models = self.models
        b = data.batch.batch_size
        mb = t.minibatch_size or b
        micro = t.micro_batch_size or mb
        has_critic = models.critic is not None
        acc: dict[str, list[Tensor]] = {}

        def add(name: str, value: Tensor) -> None:
            acc.setdefault(name, []).append(value.detach().float())

        models.actor.train()
        if has_critic:
            models.critic.train()  # type: ignore[union-attr]
        for _epoch in range(t.ppo_epochs):
            perm = torch.randperm(b).to(self.device)
            for s in range(0, b, mb):
                idx = perm[s : s + mb]
                self.accumulate(data, idx, micro, train_actor, add)
                if train_actor:
                    add("grad_norm_actor", self._step(self.actor_opt, self.actor_sched))
                if self.critic_opt is not None:
                    add("grad_norm_critic", self._step(self.critic_opt, self.critic_sched))
        for name, values in acc.items():
            if name.endswith("_count"):
                continue
            if name.endswith("_num"):
                key = name[: -len("_num")]
                result.metrics[key] = torch.stack(values).sum() / torch.stack(
                    acc[key + "_count"]
                ).sum().clamp_min(1)
            else:
                result.metrics[name] = torch.stack(values).mean()
        result.timings["time_update"] = time.perf_counter() - start
        result.timings["peak_memory_gb"] = peak_memory_gb(self.device)

    def accumulate(
        self,
        data: UpdateData,
        idx: Tensor,
        micro: int,
        train_actor: bool,
        add: Callable[[str, Tensor], None] | None = None,
    ) -> None:
        """Zero the gradients, then accumulate those of the minibatch ``idx`` over
        micro-batches of ``micro`` rows; every micro-batch uses the whole minibatch's
        aggregation denominators, so the sum is exactly the minibatch gradient."""
        self.actor_opt.zero_grad(set_to_none=True)
        if self.critic_opt is not None:
            self.critic_opt.zero_grad(set_to_none=True)
        denoms = self._denominators(data, idx)
        mb = idx.shape[0]
        for u in range(0, mb, micro):
            j = idx[u : u + micro]
            share = j.shape[0] / mb
            loss = self._micro_loss(data, j, denoms, share, train_actor, add or _ignore)
            loss.backward()

    def _step(self, opt: torch.optim.Optimizer, sched: Any) -> Tensor:
        params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
        limit = self.spec.train.max_grad_norm
        norm = torch.nn.utils.clip_grad_norm_(params, limit if limit is not None else math.inf)
        opt.step()
        sched.step()
        return norm

    def _denominators(self, data: UpdateData, idx: Tensor) -> dict[str, Tensor | None]:
        def clamp(d: Tensor | None) -> Tensor | None:
            return None if d is None else d.clamp_min(1e-8)

        comps = self.comps
        out = {"policy": clamp(denominator(comps.policy_agg, data.actor_mask[idx]))}
        if data.nll_mask is not None:
            out["nll"] = clamp(denominator(comps.policy_agg, data.nll_mask[idx]))
        if data.value_mask is not None and comps.critic_agg is not None:
            out["critic"] = clamp(denominator(comps.critic_agg, data.value_mask[idx]))
        return out

    def _micro_loss(
        self,
        data: UpdateData,
        j: Tensor,
        denoms: dict[str, Tensor | None],
        share: float,
        train_actor: bool,
        add: Callable[[str, Tensor], None],
    ) -> Tensor:
        models = self.models
        ro = data.rollout.rows(j)
        batch = data.batch.rows(j)
        loss = torch.zeros((), device=self.device)
        shared_hidden = None
        if train_actor or models.shared_critic:
            grad_ctx = torch.enable_grad() if train_actor else torch.no_grad()
            with grad_ctx:
                logp, ent, hidden = self.actor_forward(models.actor, ro)
            if models.shared_critic:
                shared_hidden = hidden if train_actor else hidden.detach()
        if train_actor:
            loss = loss + self._actor_loss(data, j, batch, logp, ent, denoms, share, add)
        if models.critic is not None:
            loss = loss + self._critic_loss(data, j, ro, batch, shared_hidden, denoms, share, add)
        return loss

    def _actor_loss(
        self,
        data: UpdateData,
        j: Tensor,
        batch: RolloutBatch,
        logp: Tensor,
        ent: Tensor,
        denoms: dict[str, Tensor | None],
        share: float,
        add: Callable[[str, Tensor], None],
    ) -> Tensor:
        spec, comps = self.spec, self.comps
        mask = data.actor_mask[j]
        agg = comps.policy_agg
        logp_old = batch.logp_old.float()
        adv = data.advantages[j]
        pl = comps.policy_loss(logp, logp_old, adv, mask) * data.policy_weights[j][:, None]
        policy_term = aggregate(agg, pl, mask, denoms["policy"], share)
        add("policy_loss_num", policy_term)
        add("policy_loss_count", torch.full((), share, device=self.device))
        loss = policy_term
        if spec.kl is not None and spec.kl.placement == "loss":
            kl = comps.kl(logp, batch.logp_ref.float())  # type: ignore[misc]
            loss = loss + self.kl_coef * aggregate(agg, kl, mask, denoms["policy"], share)
        ent_term = aggregate(agg, ent, mask, denoms["policy"], share)
        if spec.policy.entropy_coef > 0:
            loss = loss - spec.policy.entropy_coef * ent_term
        if data.nll_mask is not None:
            nll = aggregate(agg, -logp, data.nll_mask[j], denoms["nll"], share)
            loss = loss + spec.policy.nll_coef * nll
        maskf = mask.float()
        with torch.no_grad():
            log_ratio = (logp - logp_old) * maskf
            add("approx_kl_num", ((log_ratio.exp() - 1) - log_ratio).mul(maskf).sum())
            add("approx_kl_count", maskf.sum())
            add("entropy_num", (ent * maskf).sum())
            add("entropy_count", maskf.sum())
            clipped = getattr(comps.policy_loss, "clipped", None)
            if clipped is not None:
                add("clipfrac_num", (clipped(logp, logp_old, adv, mask) & mask).float().sum())
                add("clipfrac_count", maskf.sum())
        return loss

    def _critic_loss(
        self,
        data: UpdateData,
        j: Tensor,
        ro: Rollout,
        batch: RolloutBatch,
        shared_hidden: Tensor | None,
        denoms: dict[str, Tensor | None],
        share: float,
        add: Callable[[str, Tensor], None],
    ) -> Tensor:
        comps = self.comps
        assert comps.critic_loss is not None and comps.critic_agg is not None
        assert data.targets is not None and data.value_mask is not None
        assert data.value_weights is not None
        head_out = self.critic_head_out(ro, shared_hidden)[:, :-1]
        pred = comps.prediction(head_out)
        target = data.targets[j]
        old = batch.values.float()  # type: ignore[union-attr]
        vmask = data.value_mask[j]
        elem = comps.critic_loss(pred, target, old) * data.value_weights[j][:, None]
        value_term = aggregate(comps.critic_agg, elem, vmask, denoms.get("critic"), share)
        add("value_loss_num", value_term)
        add("value_loss_count", torch.full((), share, device=self.device))
        clipped = getattr(comps.critic_loss, "clipped", None)
        if clipped is not None:
            with torch.no_grad():
                add("vf_clipfrac_num", (clipped(pred, target, old) & vmask).float().sum())
                add("vf_clipfrac_count", vmask.float().sum())
        return self.spec.train.vf_coef * value_term
