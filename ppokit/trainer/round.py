"""One PPO round, in the order it runs (docs/design.md):

1. ``collect``: generate → reward → values and reference log-probs → truncation rule → KL in
   the reward → advantages, critic targets, position mask, prompt weights;
2. ``update``: ``ppo_epochs`` passes of shuffled minibatch steps, each the sum of its
   micro-batches' losses (the actor and critic objectives) and one optimizer step per model.

Nothing non-finite reaches the parameters: NaN and inf counts of the rewards and estimates
(per slot) are read back once per round at the end of ``collect``, those of the loss terms,
losses and gradient norms once per optimizer step, before ``opt.step()``. A bad value stops
the run with a :class:`~ppokit.errors.NonFiniteError` naming the round, the slot, the
component and its plugin (``train.on_nonfinite: stop``), or drops the round's update or that
optimizer step and counts it (``skip``, metric ``skipped_steps``; the error after
``train.max_skipped_steps`` in a row).

On several processes (``torchrun``) each process generates and scores its own share of the
round; the estimation runs on the whole round gathered on every process and the update's
denominators, gradients and metrics are those of the whole round (:mod:`ppokit.distributed`).

Apart from those checks, nothing in a round reads a tensor back to the host except the
decoded responses the rewards need and one read of the stacked metric tensors at its end.
"""

from __future__ import annotations

import math
import resource
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ppokit import distributed
from ppokit.batch import FIELDS as BATCH_FIELDS
from ppokit.batch import RolloutBatch
from ppokit.errors import NonFiniteError, UserError
from ppokit.spec import Spec
from ppokit.trainer.assembly import Assembly, aggregate, as_scores, denominator
from ppokit.trainer.logprobs import response_hidden, token_logprobs, trunk_hidden
from ppokit.trainer.metrics import Meter
from ppokit.trainer.models import Models, ValueModel, autocast, trunk_of
from ppokit.trainer.rollout import Rollout, generate

__all__ = [
    "PHASES",
    "Learner",
    "NonFinite",
    "RoundResult",
    "UpdateData",
    "explained_variance",
    "kl_controller_step",
]

#: The phases of a round, in order, as ``Learner.on_phase`` receives them.
PHASES = ("generating", "scoring", "estimating", "updating")


def _no_phase(phase: str) -> None:
    """The default ``Learner.on_phase``: nothing."""


def _linear_warmup(steps: int) -> Callable[[int], float]:
    def factor(step: int) -> float:
        return 1.0 if steps <= 0 else min(1.0, (step + 1) / steps)

    return factor


@contextmanager
def _timed(timings: dict[str, float], key: str) -> Iterator[None]:
    start = time.perf_counter()
    yield
    timings[key] = time.perf_counter() - start


def fit_context(
    ids: Tensor, attn: Tensor, model: nn.Module, spec: Spec, data: Any, max_new: int | None = None
) -> tuple[Tensor, Tensor]:
    """Left-padded prompts that leave room for ``max_new`` (default rollout.max_new_tokens)
    new tokens in the model's context (``config.max_position_embeddings``).

    A longer prompt is an error naming its length and the limit (``data.long_prompts:
    error``), or keeps its last tokens (``truncate``, with a warning). Reads shapes and the
    attention mask on the host only (the prompts are still on the CPU here).
    """
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    room = None if limit is None else int(limit) - (max_new or spec.rollout.max_new_tokens)
    if room is None or ids.shape[1] <= room:
        return ids, attn
    longest = int(attn.sum(dim=1).max())
    if room > 0 and longest <= room:  # only padding is cut
        return ids[:, -room:], attn[:, -room:]
    what = (
        f"a prompt of {longest} tokens plus {max_new or spec.rollout.max_new_tokens} new "
        f"tokens does not fit the model's context of {limit} tokens"
    )
    if room <= 0 or data.long_prompts == "error":
        raise UserError(
            f"data: {what}: shorten the prompts or rollout.max_new_tokens, or set "
            "data.long_prompts: truncate"
        )
    warnings.warn(f"{what}: its first {longest - room} tokens are cut", stacklevel=2)
    return ids[:, -room:], attn[:, -room:]


def explained_variance(target: Tensor, pred: Tensor, mask: Tensor) -> Tensor:
    """1 − Var[Y − V] / Var[Y] over the masked positions.

    NaN when the targets have (next to) no variance, Var[Y] <= 1e-6·mean(Y²) + 1e-12: the
    ratio then says nothing (it reached -200 on the demo once rewards saturate).
    """
    m = mask.float()
    n = m.sum().clamp_min(1.0)

    def var(x: Tensor) -> Tensor:
        mu = (x * m).sum() / n
        return ((x - mu) ** 2 * m).sum() / n

    vy = var(target.float())
    resid = var(target.float() - pred.float())
    second = (target.float() ** 2 * m).sum() / n
    informative = vy > 1e-6 * second + 1e-12
    return torch.where(informative, 1 - resid / vy.clamp_min(1e-30), torch.full_like(vy, math.nan))


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


class NonFinite:
    """NaN and inf counts of named tensors, summed on the device and read back in one
    transfer (:meth:`read_problem`).

    ``add(label, x)`` counts ``x``'s non-finite entries under ``label`` (a component in its
    slot, ``the actor's loss``, ...); labels keep the order they were first added in, the
    order the values arise in a round, so the first bad label is where a NaN appeared
    (everything computed from it is NaN too).
    """

    def __init__(self) -> None:
        self.counts: dict[str, Tensor] = {}
        self.sizes: dict[str, int] = {}
        self.forms: dict[str, tuple[str, str]] = {}

    def add(self, label: str, x: Tensor, unit: str = "positions", source: str = "") -> None:
        """Count ``x``'s NaNs and infs under ``label``. A scalar (a loss, a norm) is
        reported as ``label is NaN (source)``, anything else as ``label produced NaN at n
        of N unit``."""
        x = x.detach()
        count = torch.stack([torch.isnan(x).sum(), torch.isinf(x).sum()])
        previous = self.counts.get(label)
        self.counts[label] = count if previous is None else previous + count
        self.sizes[label] = self.sizes.get(label, 0) + x.numel()
        self.forms[label] = (unit, source)

    def read_problem(self) -> str | None:
        """The first label with a non-finite value, as a message (one host read), or None."""
        if not self.counts:
            return None
        # summed over the processes, so that every process takes the same decision
        values = distributed.all_sum(torch.stack(list(self.counts.values()))).tolist()
        for label, (nan, inf) in zip(self.counts, values, strict=True):
            if nan or inf:
                return self._message(label, nan, inf)
        return None

    def _message(self, label: str, nan: int, inf: int) -> str:
        unit, source = self.forms[label]
        if unit == "scalar":  # a loss or a norm (of its source), or an aggregation's value
            value = "NaN" if nan else "inf"
            return f"{label} is {value} ({source})" if source else f"{label} produced {value}"
        found = " and ".join(f"{name} at {n}" for name, n in (("NaN", nan), ("inf", inf)) if n)
        return f"{label} produced {found} of {self.sizes[label]} {unit}"


def _merge(into: Meter, step: Meter) -> None:
    """Add a step's metric sums and counts to the round's."""
    for name, totals in step.totals.items():
        into.totals.setdefault(name, []).extend(totals)
        into.counts.setdefault(name, []).extend(step.counts[name])


@dataclass
class UpdateData:
    """The tensors of one round the updates read (all ``[B, ...]`` on the device)."""

    rollout: Rollout
    batch: RolloutBatch
    advantages: Tensor
    actor_mask: Tensor  # bool [B, T]: mask' = response mask · [ω > 0]
    policy_weights: Tensor  # ω [B]
    nll_mask: Tensor | None  # bool [B, T]: mask' · [R > 0], when the NLL term is on
    targets: Tensor | None = None
    value_mask: Tensor | None = None  # bool [B, T]
    value_weights: Tensor | None = None
    #: the round had a non-finite reward or estimate and on_nonfinite is skip: no update
    skip: bool = False
    #: on several processes: the round's longest response, the width every process's
    #: masks are gathered at (None: one process)
    round_width: int | None = None

    def own_rows(self, rollout: Rollout, rows: slice) -> UpdateData:
        """This process's ``rows`` of data estimated on the whole round, with its own
        ``rollout`` (whose responses may be shorter than the round's longest)."""
        length = rollout.response_mask.shape[1]

        def cut(x: Tensor | None) -> Tensor | None:
            if x is None:
                return None
            x = x[rows]
            return x[:, :length] if x.dim() >= 2 else x

        batch = RolloutBatch(
            **{f: cut(getattr(self.batch, f)) for f in BATCH_FIELDS}  # type: ignore[arg-type]
        )
        return UpdateData(
            rollout,
            batch,
            cut(self.advantages),  # type: ignore[arg-type]
            cut(self.actor_mask),  # type: ignore[arg-type]
            cut(self.policy_weights),  # type: ignore[arg-type]
            cut(self.nll_mask),
            cut(self.targets),
            cut(self.value_mask),
            cut(self.value_weights),
            self.skip,
            round_width=self.batch.seq_len,
        )


def gather_batch(batch: RolloutBatch, rows: int) -> RolloutBatch:
    """The whole round's batch from every process's ``batch`` (``rows`` rows each), padded
    to the round's longest response; group ids are made unique across processes."""
    length = distributed.max_over_processes(batch.seq_len, batch.device)
    fields: dict[str, Any] = {}
    for name in BATCH_FIELDS:
        x = getattr(batch, name)
        if x is None:
            continue
        if name == "group_ids":
            x = x + distributed.world().rank * rows
        fields[name] = distributed.gather_rows(x, length)
    return RolloutBatch(**fields)


@dataclass
class RoundResult:
    """Metric tensors of a round (read once at its end), host-side measurements (seconds
    per phase ``time_*``; on CUDA ``peak_memory_gb``, the caching allocator's peak of
    allocated memory so far, a host-side counter read without device synchronisation),
    texts for samples and, with ``on_nonfinite: skip``, what was skipped and why."""

    metrics: dict[str, Tensor]
    timings: dict[str, float]
    prompts: list[str] = field(default_factory=list)
    responses: list[str] = field(default_factory=list)
    scores: Tensor | None = None
    skipped: list[str] = field(default_factory=list)


class Learner:
    """Models, components, optimizers and the adaptive KL state of a run.

    ``round`` is the number of the round being run (1-based; ``collect`` advances it or
    takes it from the loop), used in error messages; ``on_phase`` is called with each of
    :data:`PHASES` as the phase starts (a live display's hook; a no-op by default);
    ``bad_in_row`` counts the non-finite rounds and steps in a row (``on_nonfinite: skip``).
    """

    def __init__(self, spec: Spec, models: Models, assembly: Assembly) -> None:
        self.spec = spec
        self.models = models
        self.assembly = assembly
        self.device = models.runtime.device
        t = spec.train
        self.actor_opt = torch.optim.AdamW(
            models.actor_parameters(), lr=t.actor_lr, weight_decay=t.weight_decay
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
        self.on_phase: Callable[[str], None] = _no_phase
        self.round = 0
        self.bad_in_row = 0

    # ------------------------------------------------------------------ forwards
    @property
    def temperature(self) -> float:
        return float(self.spec.rollout.temperature)

    # The trunk and the LM head are run apart (the head in chunks); on several processes
    # they run as the sharded model's forward (distributed.as_forward).
    def _hidden(self, model: nn.Module, ro: Rollout) -> Tensor:
        ids, attn = ro.inputs()
        with autocast(self.models.runtime):
            return response_hidden(trunk_hidden(trunk_of(model), ids, attn), ro.prompt_len)

    def actor_hidden(self, model: nn.Module, ro: Rollout) -> Tensor:
        """The trunk's hidden states ``[B, T+1, H]`` of the responses (no LM head)."""
        return distributed.as_forward(model, lambda: self._hidden(model, ro))

    def _forward(
        self, model: nn.Module, ro: Rollout, entropy: bool
    ) -> tuple[Tensor, Tensor | None, Tensor]:
        """(log π [B,T], entropy [B,T] or None, hidden states [B,T+1,H]) of ``model``."""

        def forward() -> tuple[Tensor, Tensor | None, Tensor]:
            hidden = self._hidden(model, ro)
            with autocast(self.models.runtime):
                logp, ent = token_logprobs(
                    hidden[:, :-1],
                    model.get_output_embeddings(),
                    ro.response_ids,
                    self.temperature,
                    entropy=entropy,
                )
            return logp, ent, hidden

        return distributed.as_forward(model, forward)

    def actor_forward(self, model: nn.Module, ro: Rollout) -> tuple[Tensor, Tensor, Tensor]:
        """(log π [B,T], entropy [B,T], hidden states [B,T+1,H]) of the responses."""
        logp, ent, hidden = self._forward(model, ro, entropy=True)
        assert ent is not None
        return logp, ent, hidden

    def reference_logprobs(self, ro: Rollout) -> Tensor:
        """log π_ref [B,T] of the responses (no entropy pass), from ``Models.reference()``:
        the frozen copy, or with LoRA the actor with its adapters disabled."""
        with torch.no_grad(), self.models.reference() as ref:
            return self._forward(ref, ro, entropy=False)[0]

    def critic_head_out(self, ro: Rollout, shared_hidden: Tensor | None) -> Tensor:
        """The value head's output ``[B, T+1, head_size]`` (state before each token, then the
        state after the last position); ``shared_hidden``: the actor trunk's states, for a
        shared critic."""
        critic = self.models.critic
        assert critic is not None
        if shared_hidden is not None:
            with autocast(self.models.runtime):
                return critic(shared_hidden)

        def forward() -> Tensor:
            ids, attn = ro.inputs()
            with autocast(self.models.runtime):
                hidden = response_hidden(trunk_hidden(critic.trunk, ids, attn), ro.prompt_len)
                if distributed.sharded(critic):  # this function is the critic's forward
                    return ValueModel.forward(critic, hidden)
                return critic(hidden)

        return distributed.as_forward(critic, forward)

    def eval_mode(self) -> None:
        """Actor and critic in eval mode (the reference always is)."""
        self.models.actor.eval()
        if self.models.critic is not None:
            self.models.critic.eval()

    def train_mode(self) -> None:
        self.models.actor.train()
        if self.models.critic is not None:
            self.models.critic.train()

    # ------------------------------------------------------------ 1. collect
    def collect(
        self,
        rows: list[dict[str, Any]],
        formatted: list[str],
        round_no: int | None = None,
        rollout: Rollout | None = None,
        scores: Tensor | None = None,
    ) -> tuple[UpdateData, RoundResult]:
        """Generate, score and estimate: everything up to the updates. ``round_no`` (1-based,
        for messages) defaults to the previous round's plus one; ``rollout``: responses
        already sampled (``rollout.n`` per prompt), used as if generated, and ``scores``
        their combined rewards R (else the spec's rewards score them).

        The rewards and estimates are checked for NaN and inf with one host read at the
        end; a bad one raises :class:`NonFiniteError`, or with ``on_nonfinite: skip`` marks
        the round's update as skipped (``data.skip``) and leaves β as it was."""
        self.round = round_no if round_no is not None else self.round + 1
        n = self.spec.rollout.n
        timings: dict[str, float] = {}
        checks = NonFinite()
        self.eval_mode()  # sampling and scoring see no dropout
        self.on_phase("generating")
        with _timed(timings, "time_generate"):
            ro = rollout if rollout is not None else self.sample(formatted, n)
        self.on_phase("scoring")
        with _timed(timings, "time_score"):
            expanded = [row for row in rows for _ in range(n)]
            texts, lengths, truncated = self.decode(ro)
            if scores is None:
                scores, parts = self.score(expanded, texts, lengths, truncated, checks)
            else:
                scores, parts = scores.to(self.device).float(), {}
            needs_baseline = "baseline_rewards" in self.assembly.requires
            baseline = self.baseline(rows, formatted, checks) if needs_baseline else None
        self.on_phase("estimating")
        kl_coef = self.kl_coef
        with _timed(timings, "time_logprob"):
            batch = self.rollout_batch(ro, scores, baseline)
        world = distributed.world()
        own_scores = scores
        if world.distributed:  # the estimation sees the whole round on every process
            b = batch.batch_size
            batch = gather_batch(batch, b)
            scores = distributed.gather_rows(scores)
            parts = {name: distributed.gather_rows(s) for name, s in parts.items()}
            data, estimates = self.estimate(ro, batch, scores, checks)
            data = data.own_rows(ro, slice(world.rank * b, (world.rank + 1) * b))
        else:
            data, estimates = self.estimate(ro, batch, scores, checks)
        problem = checks.read_problem()  # once per round
        skipped = []
        if problem is not None:
            skipped.append(self._nonfinite(problem, "the round's update is skipped"))
            self.kl_coef = kl_coef  # a skipped round leaves β as it was
            data.skip = True

        lengths_t = batch.response_mask.float().sum(1)
        metrics = {
            "reward_mean": scores.mean(),
            "reward_std": scores.std() if scores.numel() > 1 else scores.new_zeros(()),
            "response_length_mean": lengths_t.mean(),
            "truncated_frac": batch.truncated.float().mean(),  # type: ignore[union-attr]
            "tokens": lengths_t.sum(),
            **estimates,
            "skipped_steps": torch.full((), float(len(skipped)), device=self.device),
        }
        if len(parts) > 1:
            metrics.update({f"reward/{name}": s.mean() for name, s in parts.items()})
        prompts = [row["prompt"] for row in expanded]
        return data, RoundResult(metrics, timings, prompts, texts, own_scores, skipped)

    def _nonfinite(self, problem: str, consequence: str) -> str:
        """A non-finite value was caught before it reached a parameter: raise
        :class:`NonFiniteError` (``on_nonfinite: stop``, or the ``max_skipped_steps``-th in
        a row), else count it and return the message with its ``consequence``."""
        t = self.spec.train
        message = f"round {self.round}: {problem}"
        if t.on_nonfinite == "stop":
            raise NonFiniteError(message)
        self.bad_in_row += 1
        if self.bad_in_row >= t.max_skipped_steps:
            raise NonFiniteError(
                f"{message}; {self.bad_in_row} in a row (train.max_skipped_steps: "
                f"{t.max_skipped_steps})"
            )
        return f"{message}: {consequence}"

    # ------------------------------------------------------------ 1a. generate
    def encode(
        self,
        prompts: list[str],
        n: int = 1,
        data: Any = None,
        max_new: int | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Left-padded prompt ids and attention mask on the device, each prompt ``n`` times
        (the chat template already holds its special tokens). ``data`` (default: the spec's
        data section) and ``max_new`` (default: rollout.max_new_tokens) decide the chat
        template and the room left in the model's context."""
        data = self.spec.data if data is None else data
        enc = self.models.tokenizer(
            prompts,
            padding=True,
            return_tensors="pt",
            add_special_tokens=not data.chat_template,
        )
        ids, attn = fit_context(
            enc["input_ids"], enc["attention_mask"], self.models.actor, self.spec, data, max_new
        )
        ids, attn = ids.to(self.device), attn.to(self.device)
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
        with torch.no_grad(), autocast(self.models.runtime):
            return generate(
                self.models.actor,
                self.models.tokenizer,
                ids,
                attn,
                max_new_tokens=self.spec.rollout.max_new_tokens,
                **sampling,
            )

    # ------------------------------------------------------------ 1b. score
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
        rows: list[dict[str, Any]],
        responses: list[str],
        lengths: list[int],
        truncated: list[bool],
        checks: NonFinite | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """R = Σ_k weight_k · reward_k, float32 [B], and each reward's scores, for one
        response per data row; each reward's scores go into ``checks`` under its slot."""
        columns = sorted({k for row in rows for k in row if k != "prompt"})
        fields: dict[str, list[Any]] = {c: [row.get(c) for row in rows] for c in columns}
        prompts = [row["prompt"] for row in rows]
        total = torch.zeros(len(responses), device=self.device)
        parts = {}
        rewards = self.assembly.rewards
        for i, (name, fn, weight) in enumerate(rewards):
            slot = "reward" if len(rewards) == 1 else f"reward.{i}"
            where = getattr(fn, "where", None) or self.assembly.name(slot)
            out = fn(prompts, responses, **fields, lengths=lengths, truncated=truncated)
            s = as_scores(out, len(responses), where).to(self.device)
            if checks is not None:
                checks.add(str(where), s, "responses")
            parts[name] = s
            total = total + weight * s
        if checks is not None:  # finite scores times their weights may still overflow
            checks.add("the rewards' weighted sum R", total, "responses")
        return total, parts

    def baseline(
        self, rows: list[dict[str, Any]], formatted: list[str], checks: NonFinite | None = None
    ) -> Tensor:
        """R of one greedy response per prompt, repeated for the prompt's ``n`` samples."""
        greedy = self.greedy(formatted)
        scores, _ = self.score(rows, *self.decode(greedy), checks)
        return scores.repeat_interleave(self.spec.rollout.n)

    # ------------------------------------------------------------ 1c. estimate
    def rollout_batch(self, ro: Rollout, scores: Tensor, baseline: Tensor | None) -> RolloutBatch:
        """The round's batch: R on each response's last token, the recorded log π_old, groups
        of ``rollout.n`` responses, and (no-grad forwards) the critic's values with the value
        after each row's last token and log π_ref."""
        mask = ro.response_mask
        b = mask.shape[0]
        batch = RolloutBatch(
            response_mask=mask,
            token_rewards=torch.zeros(mask.shape, dtype=torch.float32, device=self.device),
            logp_old=ro.logp_old,
            group_ids=torch.arange(b, device=self.device) // self.spec.rollout.n,
            truncated=ro.truncated,
            baseline_rewards=baseline,
        )
        batch = batch.replace(token_rewards=torch.where(batch.last_mask, scores[:, None], 0.0))
        models = self.models
        with torch.no_grad():
            if models.critic is not None:
                shared = self.actor_hidden(models.actor, ro) if models.shared_critic else None
                v_all = self.assembly.value(self.critic_head_out(ro, shared))  # [B, T+1]
                batch = batch.replace(
                    values=v_all[:, :-1] * mask,
                    bootstrap_values=v_all.gather(1, batch.last_index[:, None] + 1).squeeze(1),
                )
            if models.has_reference:
                batch = batch.replace(logp_ref=self.reference_logprobs(ro) * mask)
        return batch

    def kl_to_reference(
        self, batch: RolloutBatch, metrics: dict[str, Tensor], checks: NonFinite | None = None
    ) -> RolloutBatch:
        """KL(π_old ‖ π_ref) per sequence (the ``kl`` metric); with the ``reward`` placement
        r_t ← r_t − β·kl_t; then the adaptive controller's step of β."""
        kl = self.spec.kl
        assert kl is not None and self.assembly.kl is not None
        estimate = self.assembly.kl(batch.logp_old, batch.logp_ref).float()
        if checks is not None:
            checks.add(str(self.assembly.name("kl.estimator")), estimate)
        kl_tok = estimate * batch.maskf
        kl_seq = kl_tok.sum(1).mean()
        metrics["kl"] = kl_seq
        metrics["kl_coef"] = self.kl_coef.clone()
        if kl.placement == "reward":
            batch = batch.replace(token_rewards=batch.token_rewards - self.kl_coef * kl_tok)
        if kl.target is not None:
            self.kl_coef = kl_controller_step(
                self.kl_coef, kl_seq, kl.target, kl.horizon, batch.batch_size
            )
        return batch

    def estimate(
        self, ro: Rollout, batch: RolloutBatch, scores: Tensor, checks: NonFinite | None = None
    ) -> tuple[UpdateData, dict[str, Tensor]]:
        """Truncation rule → KL in the reward → what the updates read: advantages A, prompt
        weights ω with the actor's masks mask' = mask·[ω > 0] and mask'·[R > 0]; critic
        targets Y, position mask m^V and weights. Returns them with their metrics; each
        estimate goes into ``checks`` under its slot."""
        parts, metrics = self.assembly, {}
        checks = checks if checks is not None else NonFinite()

        def check(slot: str, x: Tensor, unit: str = "positions") -> Tensor:
            checks.add(str(parts.name(slot)), x, unit)
            return x

        for values in (batch.values, batch.bootstrap_values):
            if values is not None:
                checks.add("the critic's forward pass", values, "values")
        batch = parts.truncation(batch)
        if self.spec.kl is not None:
            batch = self.kl_to_reference(batch, metrics, checks)
        adv = check("advantage", parts.advantage(batch).float().detach())
        weights = check("policy.weight", parts.policy_weight(batch).float().detach(), "responses")
        actor_mask = batch.response_mask & (weights > 0)[:, None]
        nll_mask = actor_mask & (scores > 0)[:, None] if self.spec.policy.nll_coef > 0 else None
        data = UpdateData(ro, batch, adv, actor_mask, weights, nll_mask)
        tokens = batch.lengths.sum().clamp_min(1)  # positions the estimators saw
        metrics["advantage_mean"] = (adv * batch.maskf).sum() / tokens
        if self.models.critic is not None:
            assert parts.critic_target and parts.critic_mask and parts.critic_weight
            data.targets = check("critic.target", parts.critic_target(batch).float().detach())
            data.value_mask = check("critic.mask", parts.critic_mask(batch).detach().float()) > 0
            data.value_weights = check(
                "critic.weight", parts.critic_weight(batch).float().detach(), "responses"
            )
            metrics["explained_variance"] = explained_variance(
                data.targets, batch.values, batch.response_mask
            )
            # mean |Y - V_old|: stays meaningful when Var[Y] is near 0 and EV is not
            value_error = ((data.targets - batch.values).abs() * batch.maskf).sum()
            metrics["value_error"] = value_error / tokens
        return data, metrics

    # ------------------------------------------------------------ 2. update
    def update(self, data: UpdateData, train_actor: bool, result: RoundResult) -> None:
        """``ppo_epochs`` passes of shuffled minibatch steps with gradient accumulation; the
        update's metrics go into ``result``.

        Before each optimizer step the loss terms, the losses and the gradient norms are
        checked for NaN and inf (one host read per step); a bad step changes no parameter
        (no ``opt.step()``, gradients zeroed, schedulers not stepped) and raises
        :class:`NonFiniteError`, or with ``on_nonfinite: skip`` is dropped and counted in
        ``skipped_steps``. A round whose rewards or estimates were bad (``data.skip``) has
        no update at all."""
        self.on_phase("updating")
        start = time.perf_counter()
        t = self.spec.train
        b = data.batch.batch_size  # this process's rows
        processes = distributed.world().size
        mb = t.minibatch_size // processes if t.minibatch_size else b
        micro = t.micro_batch_size or mb
        meter = Meter()
        skipped = 0
        if not data.skip:
            self.train_mode()
            for _epoch in range(t.ppo_epochs):
                perm = torch.randperm(b).to(self.device)
                for s in range(0, b, mb):
                    message = self.step(data, perm[s : s + mb], micro, train_actor, meter)
                    if message is not None:
                        skipped += 1
                        result.skipped.append(message)
            result.metrics["skipped_steps"] = torch.full((), float(skipped), device=self.device)
        result.metrics.update(meter.means(distributed.all_sum))
        result.timings["time_update"] = time.perf_counter() - start
        result.timings["peak_memory_gb"] = peak_memory_gb(self.device)

    def step(
        self, data: UpdateData, idx: Tensor, micro: int, train_actor: bool, meter: Meter
    ) -> str | None:
        """One optimizer step per model on the minibatch ``idx``, if its loss terms, losses
        and gradient norms are finite (one host read); else none, and the message of the
        skipped step (or NonFiniteError). The step's metrics go into ``meter`` only when it
        is taken."""
        checks = NonFinite()
        step_meter = Meter()
        self.accumulate(data, idx, micro, train_actor, step_meter, checks)
        parts = self.assembly
        norms: list[tuple[str, torch.optim.Optimizer, Any, Tensor]] = []
        if train_actor:
            norm = self._clip(self.actor_opt)
            source = parts.name("policy.loss").inline
            checks.add("the actor's gradient norm", norm, "scalar", source)
            norms.append(("grad_norm_actor", self.actor_opt, self.actor_sched, norm))
        if self.critic_opt is not None:
            norm = self._clip(self.critic_opt)
            source = parts.name("critic.loss").inline
            checks.add("the critic's gradient norm", norm, "scalar", source)
            norms.append(("grad_norm_critic", self.critic_opt, self.critic_sched, norm))
        problem = checks.read_problem()  # once per optimizer step
        if problem is not None:
            self._zero_grad()
            return self._nonfinite(problem, "the optimizer step is skipped")
        self.bad_in_row = 0
        for name, opt, sched, norm in norms:
            opt.step()
            sched.step()
            step_meter.mean(name, norm)
        _merge(meter, step_meter)
        return None

    def accumulate(
        self,
        data: UpdateData,
        idx: Tensor,
        micro: int,
        train_actor: bool,
        meter: Meter | None = None,
        checks: NonFinite | None = None,
    ) -> Tensor:
        """Zero the gradients, then accumulate those of the minibatch ``idx`` over
        micro-batches of ``micro`` rows; every micro-batch uses the whole minibatch's
        aggregation denominators, so the sum is exactly the minibatch gradient. Returns the
        minibatch loss, the sum of the micro-batch losses (detached; on several processes
        this process's part of it). The non-finite counts of the loss terms go into
        ``checks``."""
        meter = meter if meter is not None else Meter()
        checks = checks if checks is not None else NonFinite()
        self._zero_grad()
        denoms = self._denominators(data, idx)
        mb = idx.shape[0]
        processes = distributed.world().size
        total = torch.zeros((), device=self.device)
        for u in range(0, mb, micro):
            j = idx[u : u + micro]
            share = j.shape[0] / (mb * processes)  # of the whole minibatch, every process's
            loss = self._micro_loss(data, j, denoms, share, train_actor, meter, checks)
            # the gradient reduction averages over the processes; the sum is the objective's
            (loss * processes if processes > 1 else loss).backward()
            total = total + loss.detach()
        return total

    def _zero_grad(self) -> None:
        self.actor_opt.zero_grad(set_to_none=True)
        if self.critic_opt is not None:
            self.critic_opt.zero_grad(set_to_none=True)

    def _clip(self, opt: torch.optim.Optimizer) -> Tensor:
        """Clip the gradients of ``opt``'s parameters to ``max_grad_norm``; their total norm
        before clipping (non-finite when a gradient is)."""
        params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
        limit = self.spec.train.max_grad_norm
        norm = torch.nn.utils.clip_grad_norm_(params, limit if limit is not None else math.inf)
        return distributed.full_tensor(norm)  # sharded gradients: the norm of the whole

    def _denominators(self, data: UpdateData, idx: Tensor) -> dict[str, Tensor | None]:
        """Each aggregation's denominator over the whole minibatch ``idx``: the policy terms'
        over mask', the NLL term's over mask'·[R > 0], the critic's over m^V."""

        def clamp(d: Tensor | None) -> Tensor | None:
            return None if d is None else d.clamp_min(1e-8)

        def whole(mask: Tensor) -> Tensor:  # every process's rows of the minibatch
            if data.round_width is None:
                return mask
            return distributed.gather_rows(mask, data.round_width)

        parts = self.assembly
        out = {"policy": clamp(denominator(parts.policy_agg, whole(data.actor_mask[idx])))}
        if data.nll_mask is not None:
            out["nll"] = clamp(denominator(parts.policy_agg, whole(data.nll_mask[idx])))
        if data.value_mask is not None and parts.critic_agg is not None:
            out["critic"] = clamp(denominator(parts.critic_agg, whole(data.value_mask[idx])))
        return out

    def _micro_loss(
        self,
        data: UpdateData,
        j: Tensor,
        denoms: dict[str, Tensor | None],
        share: float,
        train_actor: bool,
        meter: Meter,
        checks: NonFinite,
    ) -> Tensor:
        """The loss of the micro-batch ``j``: actor (when it trains) plus critic."""
        models = self.models
        parts = self.assembly
        ro = data.rollout.rows(j)
        loss = torch.zeros((), device=self.device)
        shared = None
        if train_actor:
            logp, ent, hidden = self.actor_forward(models.actor, ro)
            checks.add("the actor's forward pass", torch.stack([logp.detach(), ent]), "values")
            actor = self._actor_loss(data, j, logp, ent, denoms, share, meter, checks)
            checks.add("the actor's loss", actor, "scalar", parts.name("policy.loss").inline)
            loss = loss + actor
            shared = hidden if models.shared_critic else None
        elif models.shared_critic:
            with torch.no_grad():
                shared = self.actor_hidden(models.actor, ro)
        if models.critic is not None:
            critic = self._critic_loss(data, j, ro, shared, denoms, share, meter, checks)
            checks.add("the critic's loss", critic, "scalar", parts.name("critic.loss").inline)
            loss = loss + critic
        return loss

    def _actor_loss(
        self,
        data: UpdateData,
        j: Tensor,
        logp: Tensor,
        ent: Tensor,
        denoms: dict[str, Tensor | None],
        share: float,
        meter: Meter,
        checks: NonFinite,
    ) -> Tensor:
        """L_π of the micro-batch (docs/design.md): with mask' = mask·[ω > 0],
        agg(pl(logp, logp_old, A, mask')·ω, mask') + β·agg(kl(logp, logp_ref), mask')
        − c_H·agg(entropy, mask') + c_NLL·agg(−logp, mask'·[R > 0])."""
        policy = self.spec.policy
        parts = self.assembly
        mask = data.actor_mask[j]
        logp_old = data.batch.logp_old[j].float()  # type: ignore[index]
        adv = data.advantages[j]

        def term(elementwise: Tensor, m: Tensor, denom: Tensor | None) -> Tensor:
            return aggregate(parts.policy_agg, elementwise, m, denom, share)

        elementwise = parts.policy_loss(logp, logp_old, adv, mask)
        checks.add(str(parts.name("policy.loss")), elementwise)
        pg = term(elementwise * data.policy_weights[j][:, None], mask, denoms["policy"])
        checks.add(str(parts.name("policy.aggregation")), pg, "scalar")
        loss = pg
        kl = self.spec.kl
        if kl is not None and kl.placement == "loss":
            assert parts.kl is not None and data.batch.logp_ref is not None
            ref = data.batch.logp_ref[j].float()
            # where the aggregation drops a position (padding, rows of weight 0) log π_ref is
            # compared with itself: KL 0 there, so a huge log-ratio at a dropped position
            # (exp overflows) cannot put 0·inf = NaN into the gradient
            estimate = parts.kl(torch.where(mask, logp, ref), ref)
            checks.add(str(parts.name("kl.estimator")), estimate)
            loss = loss + self.kl_coef * term(estimate, mask, denoms["policy"])
        if policy.entropy_coef > 0:
            loss = loss - policy.entropy_coef * term(ent, mask, denoms["policy"])
        if data.nll_mask is not None:
            loss = loss + policy.nll_coef * term(-logp, data.nll_mask[j], denoms["nll"])

        meter.add("policy_loss", pg, share)
        with torch.no_grad():
            tokens = mask.float().sum()
            log_ratio = torch.where(mask, logp - logp_old, 0.0)
            # (ρ − 1) − log ρ, an estimate of KL(π_old ‖ π) from the sampled tokens
            meter.add("approx_kl", (log_ratio.exp() - 1 - log_ratio).sum(), tokens)
            meter.add("entropy", torch.where(mask, ent, 0.0).sum(), tokens)
            clipped = getattr(parts.policy_loss, "clipped", None)
            if clipped is not None:
                active = clipped(logp, logp_old, adv, mask) & mask
                meter.add("clipfrac", active.float().sum(), tokens)
        return loss

    def _critic_loss(
        self,
        data: UpdateData,
        j: Tensor,
        ro: Rollout,
        shared: Tensor | None,
        denoms: dict[str, Tensor | None],
        share: float,
        meter: Meter,
        checks: NonFinite,
    ) -> Tensor:
        """L_V of the micro-batch (docs/design.md): vf_coef·agg(ℓ(pred, Y, V_old)·ω^V, m^V)."""
        parts = self.assembly
        assert parts.critic_loss is not None and parts.critic_agg is not None
        assert data.targets is not None and data.value_mask is not None
        assert data.value_weights is not None and data.batch.values is not None
        pred = parts.prediction(self.critic_head_out(ro, shared)[:, :-1])
        checks.add("the critic's forward pass", pred, "values")
        target = data.targets[j]
        old = data.batch.values[j].float()
        vmask = data.value_mask[j]
        elementwise = parts.critic_loss(pred, target, old)
        checks.add(str(parts.name("critic.loss")), elementwise)
        weighted = elementwise * data.value_weights[j][:, None]
        value = aggregate(parts.critic_agg, weighted, vmask, denoms.get("critic"), share)
        checks.add(str(parts.name("critic.aggregation")), value, "scalar")

        meter.add("value_loss", value, share)
        clipped = getattr(parts.critic_loss, "clipped", None)
        if clipped is not None:
            with torch.no_grad():
                active = clipped(pred, target, old) & vmask
                meter.add("vf_clipfrac", active.float().sum(), vmask.float().sum())
        return self.spec.train.vf_coef * value
