"""One round, as a recipe of numbered steps (docs/design.md, "Order of a round"):

1. **generate**: ``rollout.n`` responses per prompt from the rollout engine, which records
   log μ of each sampled token (with ``rollout.environment``: episodes, turn by turn,
   :mod:`~ppokit.trainer.episodes`);
2. **score** the decoded responses and **filter** their groups (``rollout.filter``): steps 1
   and 2 repeat on more prompts until ``prompts_per_round`` groups have passed
   (:mod:`~ppokit.trainer.groups`, at most ``rollout.max_generation_batches`` batches); then
   the rewards of a greedy baseline response per kept prompt, when a component requires
   ``baseline_rewards``;
3. **forward passes** at the weights that sampled, without gradients: log π_old (unless the
   engine's log μ serves, ``rollout.logp_old``), the critic's values V_old, log π_ref;
4. **estimate** on the whole round (gathered on several processes): truncation rule, KL in
   the reward, advantages, critic targets, position mask, prompt weights;
5. **update**: ``ppo_epochs`` passes of minibatch steps (none when step 4 found a NaN);
6. **sync**: the engine follows the updated policy.

:func:`collect` is steps 1-4, :func:`run_round` the whole round. Each step is a call into a
module of one job: :mod:`~ppokit.trainer.rollout` and the engine,
:mod:`~ppokit.trainer.scoring`, :mod:`~ppokit.trainer.groups`,
:mod:`~ppokit.trainer.estimation`,
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
from ppokit.trainer.episodes import Sampler, episode_metrics
from ppokit.trainer.estimation import UpdateData, estimate, gather_batch, round_batch
from ppokit.trainer.forwards import Forwards
from ppokit.trainer.groups import Draw, fill
from ppokit.trainer.models import Models
from ppokit.trainer.rollout import PromptEncoder, Rollout, engine_context, sampling
from ppokit.trainer.scoring import Scorer
from ppokit.trainer.update import optimizers, update

__all__ = ["PHASES", "Learner", "RoundResult", "collect", "run_round"]

#: The phases of a round, in order, as ``Learner.on_phase`` receives them.
PHASES = ("generating", "scoring", "estimating", "updating")


def _no_phase(phase: str) -> None:
    """The default ``Learner.on_phase``: nothing."""


def _no_progress(step: int, steps: int, rows: int) -> None:
    """The default ``Learner.on_progress``: nothing."""


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
    called with each of :data:`PHASES` as the phase starts (a live display's hook), and
    ``on_progress(step, steps, rows)`` after each decoding step of an engine that reports
    them (the ``hf`` engine does), in a round or an evaluation.
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
        self.on_progress: Callable[[int, int, int], None] = _no_progress
        self.round = 0
        self.engine = assembly.engine
        world = distributed.world()
        context = engine_context(
            models, spec.model, world.rank, world.size, lambda *step: self.on_progress(*step)
        )
        self.engine.start(context)
        self.sampler = Sampler(
            self.engine, assembly.environment, self.encode, models.tokenizer, spec.rollout
        )
        mode = spec.rollout.logp_old
        self.recompute_logp_old = mode == "forward" or (
            mode == "auto" and not self.engine.samples_from_policy
        )

    def sample(
        self,
        prompts: list[str],
        n: int,
        batch: int = 0,
        rows: list[dict[str, Any]] | None = None,
        **changes: Any,
    ) -> Rollout:
        """``n`` responses per prompt (episodes with an environment, which reads the
        prompts' data ``rows``) under the spec's sampling settings (``changes``: e.g.
        ``greedy=True``), with the seed of (seed, process, round) and, for the round's
        generation batch number ``batch`` > 0, that seed xor ``batch``."""
        seed = distributed.round_seed(self.spec.seed, distributed.world().rank, self.round)
        seed ^= batch
        asked = sampling(self.spec.rollout, n, seed, **changes)
        return self.sampler(rows, prompts, self.spec.data, asked)

    def collect(
        self,
        rows: list[dict[str, Any]],
        formatted: list[str],
        round_no: int | None = None,
        rollout: Rollout | None = None,
        scores: Tensor | None = None,
        draw: Draw | None = None,
    ) -> tuple[UpdateData | None, RoundResult]:
        """Steps 1-4 (:func:`collect`)."""
        return collect(self, rows, formatted, round_no, rollout, scores, draw)

    def update(self, data: UpdateData | None, train_actor: bool, result: RoundResult) -> None:
        """Step 5 (:func:`ppokit.trainer.update.update`), its metrics into ``result``; none
        when no group entered the round (``data`` None)."""
        if data is None:
            return
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
    draw: Draw | None = None,
) -> RoundResult:
    """Round ``round_no`` (1-based) on the data ``rows`` and their ``formatted`` prompts,
    and the batches ``draw`` gives while ``rollout.filter`` has passed too few groups;
    ``train_actor`` False: a critic-only round (``train.critic_warmup_rounds``)."""
    data, result = collect(lrn, rows, formatted, round_no=round_no, draw=draw)  # steps 1-4
    if data is not None:  # a round without groups has no update
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
    draw: Draw | None = None,
) -> tuple[UpdateData | None, RoundResult]:
    """Steps 1-4 of round ``round_no`` (default: the previous one plus one): everything up to
    the update. ``rollout``: responses already sampled (``rollout.n`` per prompt), used as if
    generated, and ``scores`` their combined rewards R (else the spec's rewards score them).
    ``draw``: the next batch of prompts, while ``rollout.filter`` has passed too few groups
    (None: the first batch is all there is).

    Returns no data (None) when no group passed the filter: the round has no update.
    A non-finite reward or estimate raises :class:`~ppokit.errors.NonFiniteError`, or with
    ``on_nonfinite: skip`` marks the round's update as skipped (``data.skip``) and leaves β
    as it was."""
    lrn.round = round_no if round_no is not None else lrn.round + 1
    spec, n = lrn.spec, lrn.spec.rollout.n
    timings: dict[str, float] = {}
    checks = NonFinite()
    lrn.forwards.eval_mode()  # sampling and scoring see no dropout

    # 1. generate and 2. score, batch after batch until the filter has passed a round's groups
    got = fill(lrn, rows, formatted, checks, timings, draw, rollout, scores)
    groups = n if n > 1 and "group_ids" in lrn.assembly.requires else None
    metrics = _generated_metrics(got.generated, got.generated_parts, groups)
    metrics.update(got.metrics(lrn.device))
    rows, formatted, ro, scores = got.rows, got.formatted, got.rollout, got.scores
    if ro is None:  # nothing to estimate or update
        problem = checks.read_problem()
        skipped = [] if problem is None else [lrn.guard(lrn.round, problem, "no update")]
        skipped.append(
            f"round {lrn.round}: no generated group passed rollout.filter "
            f"({lrn.assembly.name('rollout.filter').inline}) in {got.batches} generation "
            "batch(es): no update"
        )
        return None, RoundResult(metrics, timings, skipped=skipped)

    baseline = None
    if "baseline_rewards" in lrn.assembly.requires:  # one greedy response per kept prompt
        start = time.perf_counter()
        greedy = lrn.sample(formatted, 1, rows=rows, greedy=True)
        baseline = lrn.scorer.rollout(rows, greedy, checks)[0].repeat_interleave(n)
        timings["time_score"] += time.perf_counter() - start

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

    metrics.update(estimates)
    metrics.update(episode_metrics(ro))
    metrics["rollout/kept_reward_mean"] = scores.mean()
    metrics["skipped_steps"] = torch.full((), float(len(skipped)), device=lrn.device)
    prompts = [row["prompt"] for row in rows for _ in range(n)]
    return data, RoundResult(metrics, timings, prompts, got.texts, own_scores, skipped)


def _generated_metrics(
    generated: dict[str, Tensor], parts: dict[str, Tensor], n: int | None = None
) -> dict[str, Tensor]:
    """What the policy generated this round, every response of every generation batch
    (gathered over the processes): reward mean and std (each reward's mean when there are
    several), response length, truncated fraction and tokens; with ``n``, the size of a
    group (a prompt's responses, side by side), the fraction of groups whose rewards are
    all equal (``rollout/zero_variance_groups``: a group baseline gives them advantage 0)."""
    if distributed.world().distributed:
        generated = {k: distributed.gather_rows(v) for k, v in generated.items()}
        parts = {k: distributed.gather_rows(v) for k, v in parts.items()}
    scores, lengths = generated["scores"], generated["lengths"].float()
    metrics = {
        "reward_mean": scores.mean(),
        "reward_std": scores.std() if scores.numel() > 1 else scores.new_zeros(()),
        "response_length_mean": lengths.mean(),
        "truncated_frac": generated["truncated"].float().mean(),
        "tokens": lengths.sum(),
    }
    if n is not None and scores.numel():
        groups = scores.view(-1, n)
        equal = groups.amax(1) == groups.amin(1)
        metrics["rollout/zero_variance_groups"] = equal.float().mean()
    if len(parts) > 1:
        metrics.update({f"reward/{name}": s.mean() for name, s in parts.items()})
    return metrics
