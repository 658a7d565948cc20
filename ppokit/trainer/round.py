"""One round, as a recipe of numbered steps (docs/design.md, "Order of a round"):

1. **generate**: ``rollout.n`` responses per prompt from the rollout engine, which records
   log μ of each sampled token;
2. **score**: the rewards of the decoded responses (and of a greedy baseline response per
   prompt, when a component requires ``baseline_rewards``);
3. **forward passes** at the weights that sampled, without gradients: log π_old (unless the
   engine's log μ serves, ``rollout.logp_old``), the critic's values V_old, log π_ref;
4. **estimate** on the whole round (gathered on several processes): truncation rule, KL in
   the reward, advantages, critic targets, position mask, prompt weights;
5. **update**: ``ppo_epochs`` passes of minibatch steps (none when step 4 found a NaN);
6. **sync**: the engine follows the updated policy.

:func:`collect` is steps 1-4, :func:`run_round` the whole round. Each step is a call into a
module of one job: :mod:`~ppokit.trainer.rollout` and the engine,
:mod:`~ppokit.trainer.scoring`, :mod:`~ppokit.trainer.estimation`,
:mod:`~ppokit.trainer.update`. :class:`Learner` holds what lasts from round to round.

Nothing non-finite reaches the parameters: the rewards and estimates are checked once per
round at the end of step 4, the loss terms, losses and gradient norms once per optimizer
step (:mod:`~ppokit.trainer.checks`). Apart from those checks, nothing in a round reads a
tensor back to the host except the decoded responses the rewards need and one read of the
stacked metric tensors at its end.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ppokit import distributed
from ppokit.spec import Spec
from ppokit.trainer.assembly import Assembly
from ppokit.trainer.checks import Guard, NonFinite
from ppokit.trainer.estimation import UpdateData, estimate, gather_batch, round_batch
from ppokit.trainer.forwards import Forwards
from ppokit.trainer.models import Models
from ppokit.trainer.rollout import PromptEncoder, Rollout, engine_context, sampling
from ppokit.trainer.scoring import Scorer
from ppokit.trainer.update import optimizers, update

__all__ = ["PHASES", "Learner", "RoundResult", "collect", "run_round"]

#: The phases of a round, in order, as ``Learner.on_phase`` receives them.
PHASES = ("generating", "scoring", "estimating", "updating")


def _no_phase(phase: str) -> None:
    """The default ``Learner.on_phase``: nothing."""


@contextmanager
def _timed(timings: dict[str, float], key: str) -> Iterator[None]:
    start = time.perf_counter()
    yield
    timings[key] = time.perf_counter() - start


@dataclass
class RoundResult:
    """Metric tensors of a round (read once at its end), host-side measurements (seconds
    per phase ``time_*``; ``peak_memory_gb``), texts for samples and, with
    ``on_nonfinite: skip``, what was skipped and why."""

    metrics: dict[str, Tensor]
    timings: dict[str, float]
    prompts: list[str] = field(default_factory=list)
    responses: list[str] = field(default_factory=list)
    scores: Tensor | None = None
    skipped: list[str] = field(default_factory=list)


class Learner:
    """What lasts from round to round: the spec, the models, the components (the started
    rollout engine among them), the optimizers, β of the KL term and the non-finite guard.

    ``round`` is the number of the round being run (1-based), for messages; ``on_phase`` is
    called with each of :data:`PHASES` as the phase starts (a live display's hook).
    """

    def __init__(self, spec: Spec, models: Models, assembly: Assembly) -> None:
        self.spec = spec
        self.models = models
        self.assembly = assembly
        self.device = models.runtime.device
        self.forwards = Forwards(models, spec.rollout.temperature)
        self.scorer = Scorer(assembly, models.tokenizer, self.device)
        self.encode = PromptEncoder(models.tokenizer, models.actor, self.device)
        self.actor_opt, self.actor_sched, self.critic_opt, self.critic_sched = optimizers(
            spec, models
        )
        coef = spec.kl.coef if spec.kl is not None else 0.0
        self.kl_coef = torch.tensor(coef, dtype=torch.float32, device=self.device)
        self.guard = Guard(spec.train.on_nonfinite, spec.train.max_skipped_steps)
        self.on_phase: Callable[[str], None] = _no_phase
        self.round = 0
        self.engine = assembly.engine
        world = distributed.world()
        self.engine.start(engine_context(models, spec.model, world.rank, world.size))
        mode = spec.rollout.logp_old
        self.recompute_logp_old = mode == "forward" or (
            mode == "auto" and not self.engine.samples_from_policy
        )

    def sample(self, prompts: list[str], n: int, **changes: Any) -> Rollout:
        """``n`` responses per prompt from the engine under the spec's sampling settings
        (``changes``: e.g. ``greedy=True``), with the seed of (seed, process, round)."""
        ids, attn = self.encode(prompts, self.spec.data, self.spec.rollout.max_new_tokens)
        seed = distributed.round_seed(self.spec.seed, distributed.world().rank, self.round)
        out = self.engine.generate(ids, attn, sampling(self.spec.rollout, n, seed, **changes))
        return Rollout.of(ids, attn, n, out)

    def collect(
        self,
        rows: list[dict[str, Any]],
        formatted: list[str],
        round_no: int | None = None,
        rollout: Rollout | None = None,
        scores: Tensor | None = None,
    ) -> tuple[UpdateData, RoundResult]:
        """Steps 1-4 (:func:`collect`)."""
        return collect(self, rows, formatted, round_no, rollout, scores)

    def update(self, data: UpdateData, train_actor: bool, result: RoundResult) -> None:
        """Step 5 (:func:`ppokit.trainer.update.update`), its metrics into ``result``."""
        self.on_phase("updating")
        done = update(self, data, train_actor)
        result.metrics.update(done.metrics)
        result.timings.update(done.timings)
        result.skipped.extend(done.skipped)

    def close(self) -> None:
        """The end of the run: the engine closes."""
        self.engine.close()


def run_round(
    lrn: Learner,
    rows: list[dict[str, Any]],
    formatted: list[str],
    *,
    round_no: int,
    train_actor: bool = True,
) -> RoundResult:
    """Round ``round_no`` (1-based) on the data ``rows`` and their ``formatted`` prompts;
    ``train_actor`` False: a critic-only round (``train.critic_warmup_rounds``)."""
    data, result = collect(lrn, rows, formatted, round_no=round_no)  # steps 1-4
    lrn.update(data, train_actor, result)  # 5. update
    with _timed(result.timings, "time_sync"):  # 6. the engine follows the policy
        lrn.engine.sync()
    return result


def collect(
    lrn: Learner,
    rows: list[dict[str, Any]],
    formatted: list[str],
    round_no: int | None = None,
    rollout: Rollout | None = None,
    scores: Tensor | None = None,
) -> tuple[UpdateData, RoundResult]:
    """Steps 1-4 of round ``round_no`` (default: the previous one plus one): everything up to
    the update. ``rollout``: responses already sampled (``rollout.n`` per prompt), used as if
    generated, and ``scores`` their combined rewards R (else the spec's rewards score them).

    A non-finite reward or estimate raises :class:`~ppokit.errors.NonFiniteError`, or with
    ``on_nonfinite: skip`` marks the round's update as skipped (``data.skip``) and leaves β
    as it was."""
    lrn.round = round_no if round_no is not None else lrn.round + 1
    spec, n = lrn.spec, lrn.spec.rollout.n
    timings: dict[str, float] = {}
    checks = NonFinite()
    lrn.forwards.eval_mode()  # sampling and scoring see no dropout

    # 1. generate
    lrn.on_phase("generating")
    with _timed(timings, "time_generate"):
        ro = rollout if rollout is not None else lrn.sample(formatted, n)

    # 2. score
    lrn.on_phase("scoring")
    with _timed(timings, "time_score"):
        if scores is None:
            scores, parts, texts = lrn.scorer.rollout(rows, ro, checks)
        else:
            texts, parts = lrn.scorer.decode(ro)[0], {}
            scores = scores.to(lrn.device).float()
        baseline = None
        if "baseline_rewards" in lrn.assembly.requires:  # one greedy response per prompt
            greedy = lrn.sample(formatted, 1, greedy=True)
            baseline = lrn.scorer.rollout(rows, greedy, checks)[0].repeat_interleave(n)

    # 3. forward passes at the weights that sampled
    lrn.on_phase("estimating")
    with _timed(timings, "time_logprob"):
        batch = round_batch(
            ro,
            scores,
            baseline,
            n=n,
            forwards=lrn.forwards,
            assembly=lrn.assembly,
            recompute_logp_old=lrn.recompute_logp_old,
        )

    # 4. estimate, on the whole round
    kl_coef = lrn.kl_coef
    world = distributed.world()
    own_scores = scores
    if world.distributed:  # every process estimates the gathered round, keeps its rows
        b = batch.batch_size
        batch = gather_batch(batch, b)
        scores = distributed.gather_rows(scores)
        parts = {name: distributed.gather_rows(s) for name, s in parts.items()}
    data, estimates, lrn.kl_coef = estimate(
        ro, batch, scores, spec=spec, assembly=lrn.assembly, kl_coef=kl_coef, checks=checks
    )
    if world.distributed:
        data = data.own_rows(ro, slice(world.rank * b, (world.rank + 1) * b))
    skipped = []
    problem = checks.read_problem()  # once per round
    if problem is not None:
        skipped.append(lrn.guard(lrn.round, problem, "the round's update is skipped"))
        lrn.kl_coef = kl_coef  # a skipped round leaves β as it was
        data.skip = True

    lengths = batch.response_mask.float().sum(1)
    metrics = {
        "reward_mean": scores.mean(),
        "reward_std": scores.std() if scores.numel() > 1 else scores.new_zeros(()),
        "response_length_mean": lengths.mean(),
        "truncated_frac": batch.truncated.float().mean(),  # type: ignore[union-attr]
        "tokens": lengths.sum(),
        **estimates,
        "skipped_steps": torch.full((), float(len(skipped)), device=lrn.device),
    }
    if len(parts) > 1:
        metrics.update({f"reward/{name}": s.mean() for name, s in parts.items()})
    prompts = [row["prompt"] for row in rows for _ in range(n)]
    return data, RoundResult(metrics, timings, prompts, texts, own_scores, skipped)
