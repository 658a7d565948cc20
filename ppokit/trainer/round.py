"""One round (docs/design.md, "Order of a round"), written out in :func:`run_round`:

1. **generate**: ``rollout.n`` responses per prompt from the rollout engine, which records
   log μ of each sampled token (with ``rollout.environment``: episodes, turn by turn,
   :mod:`~ppokit.trainer.episodes`);
2. **score** the decoded responses and **filter** their groups (``rollout.filter``): steps 1
   and 2 repeat on more prompts until ``prompts_per_round`` groups have passed
   (:mod:`~ppokit.trainer.producers.filling`, at most ``rollout.max_generation_batches``
   batches); then the rewards of a greedy baseline response per kept prompt, when a
   component requires ``baseline_rewards``. Steps 1 and 2 are a producer's
   (:mod:`~ppokit.trainer.producers`, one per schedule): :func:`run_round` is given their
   result and runs steps 3 to 5;
3. **forward passes** at the weights that sampled, without gradients: log π_old (unless the
   engine's log μ serves, ``rollout.logp_old``), the critic's values V_old, log π_ref;
4. **estimate** on the whole round (gathered on several processes): truncation rule, KL in
   the reward, advantages, critic targets, position mask, prompt weights;
5. **update**: ``ppo_epochs`` passes of shuffled minibatches, each the sum of its
   micro-batches' losses (:mod:`~ppokit.trainer.objective`; micro-batches of rows or of a
   token budget, :mod:`~ppokit.trainer.microbatches`, which step 3's passes use too) and one
   clipped optimizer step per model (:mod:`~ppokit.trainer.optim`); none when step 4 found
   a NaN;
6. **sync**: the engine follows the updated policy (the producer's
   :meth:`~ppokit.trainer.producers.base.Producer.trained`, as its schedule says).

It works on the run's two objects (:mod:`~ppokit.trainer.setup`): the :class:`Setup` a spec
assembled once and the :class:`State` the rounds change.

Nothing non-finite reaches the parameters: steps 1-4 and each optimizer step run under a
non-finite counter (:func:`~ppokit.trainer.checks.counting`) that every component counts its
results into, read once at the end of step 4 and once per optimizer step. Apart from those
reads, nothing in a round reads a tensor back to the host except the decoded responses the
rewards need and one read of the stacked metric tensors at its end.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ppokit import distributed
from ppokit.metrics_table import FLOPS
from ppokit.trainer.checks import count, counting
from ppokit.trainer.episodes import episode_metrics
from ppokit.trainer.estimation import UpdateData, estimate_round, round_batch
from ppokit.trainer.flops import Shape
from ppokit.trainer.groups import Filled
from ppokit.trainer.metrics import Meter, peak_memory_gb
from ppokit.trainer.microbatches import MicroBatches
from ppokit.trainer.producers.base import Produced
from ppokit.trainer.scoring import reads_parts
from ppokit.trainer.setup import Setup, State

__all__ = ["PHASES", "RoundResult", "run_round"]

#: The phases of a round, in order, as the setup's reporter hears them.
PHASES = ("generating", "scoring", "estimating", "updating")

#: The label of each model's gradient norm, and the slot whose loss it is the gradient of.
GRAD_NORMS = {
    "actor": ("the actor's gradient norm", "policy.loss"),
    "critic": ("the critic's gradient norm", "critic.loss"),
}


@dataclass(frozen=True)
class RoundResult:
    """Metric tensors of a round (read once at its end), host-side measurements (seconds
    per phase ``time_*``; ``peak_memory_gb``), texts for samples, what was skipped and why
    (``on_nonfinite: skip``, a round without groups) and ``data``: what the update read
    (None when no group entered the round). Made once, when the round is over."""

    metrics: dict[str, Tensor]
    timings: dict[str, float]
    prompts: list[str] = field(default_factory=list)
    responses: list[str] = field(default_factory=list)
    scores: Tensor | None = None
    skipped: list[str] = field(default_factory=list)
    data: UpdateData | None = None


def run_round(
    setup: Setup,
    state: State,
    produced: Produced,
    *,
    round_no: int,
    train_actor: bool = True,
    update: bool = True,
) -> RoundResult:
    """Round ``round_no`` (1-based) on ``produced``, its scored batch (steps 1 and 2, made by
    a producer: :mod:`~ppokit.trainer.producers`), from the forward passes on.
    ``train_actor`` False: a critic-only round (``train.critic_warmup_rounds``). ``update``
    False: steps 3 and 4 only. The engine's sync (step 6) is the producer's
    (:meth:`~ppokit.trainer.producers.base.Producer.trained`).

    A non-finite reward or estimate raises :class:`~ppokit.errors.NonFiniteError`, or with
    ``on_nonfinite: skip`` skips the round's update and leaves β as it was; a non-finite
    loss or gradient norm does the same to its optimizer step."""
    spec, parts, device = setup.spec, setup.assembly, setup.device
    n, t = spec.rollout.n, spec.train
    state.round = round_no
    timings = produced.timings
    setup.forwards.eval_mode()  # the forward passes see no dropout

    with counting(produced.checks) as checks:  # it counted the rewards already
        got = produced.filled
        groups = n if n > 1 and "group_ids" in parts.requires else None
        metrics = generated_metrics(got, groups, device, setup.passes.actor)
        kept = got.kept
        if kept is None:  # nothing to estimate or update
            problem = checks.read_problem()
            skipped = [] if problem is None else [state.guard(round_no, problem, "no update")]
            name = parts.name("rollout.filter").inline
            skipped.append(
                f"round {round_no}: no generated group passed rollout.filter ({name}) in "
                f"{got.batches} generation batch(es): no update"
            )
            metrics.update(produced.metrics)
            return RoundResult(metrics, timings, skipped=skipped)
        baseline = produced.baseline

        # 3. forward passes at the weights that sampled
        setup.reporter.phase("estimating")
        with _timed(timings, "time_logprob"):
            micro = MicroBatches.of(t, kept.rollout)
            batch = round_batch(
                kept.rollout, kept.scores.total, baseline, n=n, forwards=setup.forwards,
                assembly=parts, recompute_logp_old=setup.recompute_logp_old, micro=micro,
                parts=kept.scores.columns() if reads_parts(parts.requires) else None,
            )  # fmt: skip

        # 4. estimate, on the whole round
        data, estimates, beta, round_scores = estimate_round(
            kept.rollout, batch, kept.scores.total, spec=spec, assembly=parts,
            kl_coef=state.kl_coef,
        )  # fmt: skip
        problem = checks.read_problem()  # once per round
    skipped = []
    if problem is None:
        state.kl_coef = beta
    else:  # a skipped round leaves β as it was
        skipped.append(state.guard(round_no, problem, "the round's update is skipped"))
    metrics.update(estimates)
    metrics.update(episode_metrics(kept.rollout))
    # the rows' tokens, padding left out: the passes' model FLOPs (docs/speed.md)
    lengths = kept.rollout.prompt_mask.sum(1) + kept.rollout.present.sum(1)
    counted = [setup.passes.no_grad(lengths)]
    metrics["rollout/kept_reward_mean"] = round_scores.mean()

    # 5. update: ppo_epochs passes of shuffled minibatches, one optimizer step each
    meter, ro = Meter(), data.rollout  # the steps' metrics; the rollout the passes read
    assert ro is not None
    if update:
        setup.reporter.phase("updating")
    with _timed(timings, "time_update") if update else nullcontext():
        processes = distributed.world().size
        b = data.batch.batch_size  # this process's rows
        mb = t.minibatch_size // processes if t.minibatch_size else b
        if update and problem is None:
            counted.append(setup.passes.update(lengths, t.ppo_epochs, train_actor))
            setup.forwards.train_mode()
            for _epoch in range(t.ppo_epochs):
                for idx, micros in micro.minibatches(torch.randperm(b), mb, device):
                    step = Meter()  # the step's metrics count only if it is taken
                    with counting() as checks:
                        state.optimizers.zero_grad()
                        denoms = setup.objective.denominators(data, idx)
                        for m in micros:  # micro-batches: the minibatch's gradient
                            share = m.index.shape[0] / (idx.shape[0] * processes)
                            loss = setup.objective.micro_loss(
                                data, m.index, denoms, share, state.kl_coef, train_actor,
                                step, m.rollout(ro),
                            )  # fmt: skip
                            # the gradient reduction averages over the processes
                            (loss * processes if processes > 1 else loss).backward()
                        norms = state.optimizers.clip(t.max_grad_norm, train_actor)
                        for name, norm in norms.items():
                            label, slot = GRAD_NORMS[name]
                            count(label, norm, "scalar", parts.name(slot).inline)
                        bad = checks.read_problem()  # once per optimizer step
                    if bad is not None:  # the step changes no parameter
                        state.optimizers.zero_grad()
                        skipped.append(state.guard(round_no, bad, "the optimizer step is skipped"))
                        continue
                    state.guard.good()
                    state.optimizers.step(norms)
                    for name, norm in norms.items():
                        step.mean(f"grad_norm_{name}", norm)
                    meter.merge(step)
        means = meter.means(distributed.all_sum)
    if update:
        timings["peak_memory_gb"] = peak_memory_gb(device)
    metrics["skipped_steps"] = torch.full((), float(len(skipped)), device=device)
    metrics.update(means)
    flops = distributed.all_sum(torch.stack(counted).float())  # the whole round's
    metrics.update(zip((FLOPS["logprob"], FLOPS["update"]), flops, strict=False))
    metrics.update(produced.metrics)
    prompts = [row["prompt"] for row in kept.rows for _ in range(n)]
    return RoundResult(metrics, timings, prompts, kept.texts, kept.scores.total, skipped, data)


@contextmanager
def _timed(timings: dict[str, float], key: str, add: bool = False) -> Iterator[None]:
    """The block's seconds in ``timings[key]`` (``add``: added to what is there)."""
    start = time.perf_counter()
    yield
    timings[key] = (timings.get(key, 0.0) if add else 0.0) + time.perf_counter() - start


def generated_metrics(
    got: Filled, n: int | None, device: torch.device, shape: Shape | None = None
) -> dict[str, Tensor]:
    """What the policy generated this round, every response of every generation batch
    (over the processes): reward mean and std (each reward's mean when there are several;
    each flag a reward raised as ``reward/<name>/<flag>_frac``), response length,
    truncated fraction and tokens; with ``n``, the size of a group (a
    prompt's responses, side by side), the fraction of groups whose rewards are all equal
    (``rollout/zero_variance_groups``: a group baseline gives them advantage 0); and the
    filter's counts (:meth:`~ppokit.trainer.groups.Filled.metrics`); with the actor's
    ``shape``, generation's model FLOPs."""
    metrics = got.generated.metrics(groups=n is not None, shape=shape)
    metrics.update(got.metrics(device))
    return metrics
