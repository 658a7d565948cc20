"""Benchmark of a PPO round: ppokit's ``run_round`` against the bare model passes it needs.

A ppokit round is :func:`ppokit.trainer.round.run_round` (generate on the rollout engine,
score, forward passes, estimate, update, engine sync) + the one metrics read. The bare
round runs, with copies of the same models, the same prompts and sizes and the same sampling
settings, only what any PPO implementation has to run:

- ``model.generate`` (no-grad, KV cache) with the spec's temperature / top-k / top-p, and a
  greedy ``model.generate`` when the advantage needs a baseline rollout (ReMax);
- the decode of the responses and the spec's reward functions (the same user code);
- a no-grad critic forward (its trunk is the actor's for a shared critic) and, when the
  spec has a KL section, a reference forward; log π_old is not recomputed (ppokit records
  it while sampling);
- for each of the ``ppo_epochs`` passes and each minibatch: the actor forward (full logits,
  ``log_softmax``), a clipped-ratio loss with an entropy bonus on plain tensors, the critic
  forward and squared error, backward, gradient clipping and the optimizer steps.

The two are interleaved (ppokit round, bare round, ppokit round, ...) after one warm-up
round each, so load from other processes hits both alike; every figure is the median over
the rounds. The overhead ratio is ppokit round time / bare round time.

    python benchmarks/round.py [--rounds N] [--spec PATH] [--set KEY=VALUE ...]
                               [--device cpu|cuda] [--threads N] [--profile]

``--profile`` prints the top of a cProfile of one extra ppokit round. ``--threads 1`` keeps
CPU figures stable when other processes load the machine (oversubscribed intra-op threads
make single rounds up to ten times slower at random).
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import math
import pstats
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ppokit.data import make_prompt_source
from ppokit.spec import Spec, SpecError, load_spec
from ppokit.trainer.assembly import Assembly
from ppokit.trainer.logprobs import position_ids
from ppokit.trainer.metrics import read_once
from ppokit.trainer.models import Models, autocast, trunk_of
from ppokit.trainer.producers import Inline, starting_with
from ppokit.trainer.prompts import format_prompts
from ppokit.trainer.rollout import eos_ids
from ppokit.trainer.round import run_round
from ppokit.trainer.run import build
from ppokit.trainer.setup import Setup, State

DEMO = Path(__file__).resolve().parents[1] / "ppokit" / "specs" / "demo.yaml"
PHASES = ("generate", "score", "logprob", "update")


class Clock:
    """perf_counter that synchronises the device first on CUDA."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __call__(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()


# ----------------------------------------------------------------------------- ppokit
def ppokit_round(
    learner: tuple[Setup, State], rows: list[dict[str, Any]], formatted: list[str], clock: Clock
) -> dict[str, float]:
    """One ppokit round (as the training loop runs it); seconds per phase and in total."""
    setup, state = learner
    begin = clock()
    round_no = state.round + 1
    producer = Inline(setup, starting_with(rows, formatted), refills=False)
    result = run_round(setup, state, producer.next(round_no), round_no=round_no)
    result.timings.update(producer.trained(round_no))
    read_once(result.metrics)
    total = clock() - begin
    times = {p: result.timings.get(f"time_{p}", 0.0) for p in PHASES}
    times["round"] = total
    return times


# ----------------------------------------------------------------------------- bare
@dataclass
class Bare:
    """Copies of a run's models and plain optimizers, used without ppokit's bookkeeping."""

    spec: Spec
    models: Models
    assembly: Assembly
    actor_opt: torch.optim.Optimizer
    critic_opt: torch.optim.Optimizer | None
    eos: list[int] = field(default_factory=list)

    @classmethod
    def from_setup(cls, learner: Setup) -> Bare:
        m = learner.models
        models = Models(
            m.tokenizer,
            copy.deepcopy(m.actor),
            copy.deepcopy(m.critic),
            m.ref,  # frozen: read only
            m.runtime,
            m.shared_critic,
        )
        t = learner.spec.train
        actor_opt = torch.optim.AdamW(
            models.actor.parameters(), lr=t.actor_lr, weight_decay=t.weight_decay
        )
        critic_opt = None
        if models.critic is not None:
            critic_opt = torch.optim.AdamW(
                list(models.critic_parameters()), lr=t.critic_lr, weight_decay=t.weight_decay
            )
        eos = eos_ids(m.tokenizer, m.actor)
        return cls(learner.spec, models, learner.assembly, actor_opt, critic_opt, eos)

    # ------------------------------------------------------------------ passes
    def _generate(self, ids: Tensor, attn: Tensor, greedy: bool) -> Tensor:
        r = self.spec.rollout
        tok = self.models.tokenizer
        sampling: dict[str, Any] = {"do_sample": False}
        if not greedy:
            sampling = {
                "do_sample": True,
                "temperature": r.temperature,
                "top_k": r.top_k,
                "top_p": r.top_p,
            }
        self.models.actor.eval()
        with torch.no_grad(), autocast(self.models.runtime):
            out = self.models.actor.generate(
                input_ids=ids,
                attention_mask=attn,
                max_new_tokens=r.max_new_tokens,
                pad_token_id=tok.pad_token_id,
                eos_token_id=self.eos,
                use_cache=True,
                **sampling,
            )
        return out[:, ids.shape[1] :]

    def _hidden(self, trunk: nn.Module, ids: Tensor, attn: Tensor, p: int) -> Tensor:
        out = trunk(
            input_ids=ids, attention_mask=attn, position_ids=position_ids(attn), use_cache=False
        )
        return out.last_hidden_state[:, p - 1 :]

    def _logp(self, model: nn.Module, ids: Tensor, attn: Tensor, p: int) -> tuple[Tensor, ...]:
        """(log π, entropy, trunk states) of the response tokens, full logits at once."""
        hidden = self._hidden(trunk_of(model), ids, attn, p)
        logits = model.get_output_embeddings()(hidden[:, :-1]).float()
        logsm = F.log_softmax(logits / self.spec.rollout.temperature, -1)
        logp = logsm.gather(-1, ids[:, p:, None]).squeeze(-1)
        entropy = -(logsm.exp() * logsm).sum(-1)
        return logp, entropy, hidden

    def _values(self, ids: Tensor, attn: Tensor, p: int, shared: Tensor | None) -> Tensor:
        critic = self.models.critic
        assert critic is not None
        hidden = shared if shared is not None else self._hidden(critic.trunk, ids, attn, p)
        return critic(hidden)[..., 0]

    # ------------------------------------------------------------------ round
    def round(
        self, rows: list[dict[str, Any]], formatted: list[str], clock: Clock
    ) -> dict[str, float]:
        spec, models = self.spec, self.models
        r, t = spec.rollout, spec.train
        device = models.runtime.device
        tok = models.tokenizer
        times: dict[str, float] = {}
        begin = clock()

        enc = tok(
            formatted,
            padding=True,
            return_tensors="pt",
            add_special_tokens=not spec.data.chat_template,
        )
        prompt_ids = enc["input_ids"].to(device).repeat_interleave(r.n, 0)
        prompt_attn = enc["attention_mask"].to(device).repeat_interleave(r.n, 0)
        responses = self._generate(prompt_ids, prompt_attn, greedy=False)
        times["generate"] = clock() - begin

        start = clock()
        eos = torch.tensor(self.eos, device=device)
        is_eos = torch.isin(responses, eos).long()
        mask = (is_eos.cumsum(1) - is_eos) == 0
        texts = tok.batch_decode(responses.masked_fill(~mask, tok.pad_token_id).cpu(), True)
        expanded = [row for row in rows for _ in range(r.n)]
        answers = {k: [row.get(k) for row in expanded] for k in expanded[0] if k != "prompt"}
        lengths = mask.sum(1).tolist()
        truncated = (is_eos.sum(1) == 0).tolist()
        scores = torch.zeros(len(texts), device=device)
        for _name, fn, weight in self.assembly.rewards:
            s = fn(
                [row["prompt"] for row in expanded],
                texts,
                **answers,
                lengths=lengths,
                truncated=truncated,
            )
            scores = scores + weight * torch.as_tensor(s, dtype=torch.float32).to(device)
        if "baseline_rewards" in self.assembly.requires:
            g_ids = self._generate(
                enc["input_ids"].to(device), enc["attention_mask"].to(device), greedy=True
            )
            g_texts = tok.batch_decode(g_ids.cpu(), True)
            g_fields = {k: [row.get(k) for row in rows] for k in answers}
            for _name, fn, _weight in self.assembly.rewards:
                fn([row["prompt"] for row in rows], g_texts, **g_fields)
        times["score"] = clock() - start

        start = clock()
        p = prompt_ids.shape[1]
        ids = torch.cat([prompt_ids, responses], 1)
        attn = torch.cat([prompt_attn, mask.long()], 1)
        maskf = mask.float()
        # log π_old is not recomputed: as in ppokit it is taken as recorded at sampling time
        # (here a placeholder of the same shape, since plain generate records nothing)
        logp_old = torch.zeros(maskf.shape, device=device)
        with torch.no_grad(), autocast(models.runtime):
            values = None
            if models.critic is not None:
                shared = None
                if models.shared_critic:
                    shared = self._hidden(trunk_of(models.actor), ids, attn, p)
                values = self._values(ids, attn, p, shared)
            if models.ref is not None:
                self._logp(models.ref, ids, attn, p)
        times["logprob"] = clock() - start

        start = clock()
        adv = (scores - scores.mean())[:, None] * maskf
        returns = scores[:, None] * maskf
        b = ids.shape[0]
        mb = t.minibatch_size or b
        limit = t.max_grad_norm if t.max_grad_norm is not None else math.inf
        models.actor.train()
        if models.critic is not None:
            models.critic.train()
        for _epoch in range(t.ppo_epochs):
            perm = torch.randperm(b).to(device)
            for s in range(0, b, mb):
                j = perm[s : s + mb]
                self.actor_opt.zero_grad(set_to_none=True)
                if self.critic_opt is not None:
                    self.critic_opt.zero_grad(set_to_none=True)
                m = maskf[j]
                n_tok = m.sum().clamp_min(1)
                with autocast(models.runtime):
                    logp, entropy, hidden = self._logp(models.actor, ids[j], attn[j], p)
                    ratio = (logp - logp_old[j]).exp()
                    a = adv[j]
                    pg = -torch.min(ratio * a, ratio.clamp(0.8, 1.2) * a)
                    loss = ((pg - spec.policy.entropy_coef * entropy) * m).sum() / n_tok
                    if models.critic is not None:
                        assert values is not None
                        v = self._values(
                            ids[j], attn[j], p, hidden if models.shared_critic else None
                        )
                        v_loss = ((v[:, :-1] - returns[j]) ** 2 * m).sum() / n_tok
                        loss = loss + t.vf_coef * v_loss
                loss.backward()
                torch.nn.utils.clip_grad_norm_(models.actor.parameters(), limit)
                self.actor_opt.step()
                if self.critic_opt is not None:
                    torch.nn.utils.clip_grad_norm_(list(models.critic_parameters()), limit)
                    self.critic_opt.step()
        loss.detach().float().cpu()  # the bare round's one read
        times["update"] = clock() - start
        times["round"] = clock() - begin
        return times


# ----------------------------------------------------------------------------- driver
def make_learner(spec: Spec) -> tuple[Setup, State]:
    run = build(spec, threads=False)  # the threads the benchmark set
    return run.setup, run.state


def median_times(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def profile(fn: Callable[[], object], top: int = 25) -> None:
    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(top)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds of each")
    parser.add_argument("--spec", default=str(DEMO), help="spec file (default: the demo)")
    parser.add_argument("--set", action="append", default=[], help="spec override KEY=VALUE")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--profile", action="store_true", help="cProfile one ppokit round")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.rounds < 3:
        parser.error("--rounds must be at least 3")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    try:
        spec = load_spec(args.spec, [*args.set, f"model.device={args.device}"])
    except SpecError as exc:
        parser.error(str(exc))
    learner = make_learner(spec)
    setup = learner[0]
    bare = Bare.from_setup(setup)
    source = make_prompt_source(spec.data, spec.seed)
    clock = Clock(setup.device)
    r = spec.rollout
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, device {args.device}, "
        f"spec {args.spec}, actor {spec.model.actor}, {r.prompts_per_round} prompts x {r.n} "
        f"samples, max_new_tokens {r.max_new_tokens}, ppo_epochs {spec.train.ppo_epochs}, "
        f"minibatch {spec.train.minibatch_size}; median of {args.rounds} interleaved rounds "
        "after one warm-up round each"
    )
    ours: list[dict[str, float]] = []
    plain: list[dict[str, float]] = []
    for i in range(args.rounds + 1):
        rows = source.next_rows(r.prompts_per_round)
        formatted = format_prompts(rows, setup.models.tokenizer, spec.data)
        torch.manual_seed(spec.seed + i)
        a = ppokit_round(learner, rows, formatted, clock)
        torch.manual_seed(spec.seed + i)
        b = bare.round(rows, formatted, clock)
        if i > 0:  # round 0 is the warm-up
            ours.append(a)
            plain.append(b)
    med_ours, med_bare = median_times(ours), median_times(plain)
    print(f"{'phase':<10}{'ppokit ms':>12}{'bare ms':>12}{'ratio':>8}")
    for key in (*PHASES, "round"):
        o, p = 1e3 * med_ours[key], 1e3 * med_bare[key]
        print(f"{key:<10}{o:>12.1f}{p:>12.1f}{o / p if p > 0 else math.nan:>8.2f}")
    per_round = [o["round"] / p["round"] for o, p in zip(ours, plain, strict=True)]
    print(
        "per-round ratios: "
        + " ".join(f"{x:.2f}" for x in per_round)
        + f" (median {statistics.median(per_round):.3f})"
    )
    ratio = med_ours["round"] / med_bare["round"]
    print(f"overhead ratio (median ppokit round / median bare round): {ratio:.3f}")
    if args.profile:
        rows = source.next_rows(r.prompts_per_round)
        formatted = format_prompts(rows, setup.models.tokenizer, spec.data)
        profile(lambda: ppokit_round(learner, rows, formatted, clock))


if __name__ == "__main__":
    main()
