"""Dynamic sampling: the round's groups, generated and scored batch after batch until
``rollout.filter`` has passed ``rollout.prompts_per_round`` of them (DAPO, arXiv:2503.14476,
section 3.2). A group is one prompt's ``rollout.n`` responses.

:func:`fill` generates the batch of prompts it is given, scores it and asks the filter which
groups enter the round; while fewer than the round's groups have passed and fewer than
``rollout.max_generation_batches`` batches were generated, it draws the next batch of
``prompts_per_round`` prompts (this process's share on several processes) from the data
stream. Groups past the round's count are dropped, and so is every group the filter
rejects: neither reaches the estimation or the update. Every prompt drawn is consumed from
the data stream, kept or not, so the data position after a round is the prompts drawn.

On several processes the rule is whole-round: after each batch the processes agree on the
smallest number of passed groups any of them holds (one all-reduce); they stop when every
process holds its share (``prompts_per_round / processes``) or at the bound, and each keeps
its first ``min(that number, share)`` passed groups. So every process draws the same number
of batches and ends with the same number of groups (the update gathers equal shares), and
the counts are the whole round's.

A filter that declares ``keeps_all`` (``none``) is not called: the first batch fills the
round, nothing else is drawn and nothing is read back to the host. Any other filter's flags
are read back once per batch (which groups to keep).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ppokit import distributed
from ppokit.components.group_filter import GroupFilter, Groups
from ppokit.errors import UserError
from ppokit.spec import RolloutSpec
from ppokit.trainer.assembly import optional
from ppokit.trainer.rollout import Rollout
from ppokit.trainer.scoring import Scorer, Scores, reads_parts

__all__ = ["Draw", "Filled", "GroupBatch", "Sample", "fill"]

#: The next batch of prompts: this process's data rows and their formatted prompts.
Draw = Callable[[], tuple[list[dict[str, Any]], list[str]]]

#: ``sample(prompts, n, batch=k, rows=rows)``: ``n`` responses per prompt for the round's
#: generation batch ``k`` (:meth:`~ppokit.trainer.setup.Setup.sample` of the round).
Sample = Callable[..., Rollout]


@dataclass
class GroupBatch:
    """Groups of ``rollout.n`` responses, in order: their data ``rows`` and ``formatted``
    prompts, the responses, their rewards (R [B], each reward's scores and flags) and
    texts, and ``keep``: the indices of the groups that passed the filter."""

    rows: list[dict[str, Any]]
    formatted: list[str]
    rollout: Rollout
    scores: Scores
    texts: list[str]
    keep: list[int]


@dataclass
class Filled:
    """The round's kept groups (``kept``: None when no group passed) and what was generated
    to find them."""

    kept: GroupBatch | None
    #: every generated response of this process: R, lengths, truncation; each reward's
    #: scores; the rewards' flags
    generated: dict[str, Tensor] = field(default_factory=dict)
    generated_parts: dict[str, Tensor] = field(default_factory=dict)
    generated_flags: dict[str, Tensor] = field(default_factory=dict)
    #: whole-round counts, the same on every process
    kept_groups: int = 0
    passed_groups: int = 0
    generated_groups: int = 0
    batches: int = 0
    #: the bound stopped the drawing before the round was full
    exhausted: bool = False
    #: a filter ran (False for one that keeps every group: no counts to report)
    filtered: bool = True

    def metrics(self, device: torch.device) -> dict[str, Tensor]:
        """``rollout/kept_groups``, ``_passed_groups``, ``_generated_groups``,
        ``_generation_batches`` and ``_exhausted`` (whole-round), when a filter ran."""
        if not self.filtered:
            return {}
        values = {
            "rollout/kept_groups": self.kept_groups,
            "rollout/passed_groups": self.passed_groups,
            "rollout/generated_groups": self.generated_groups,
            "rollout/generation_batches": self.batches,
            "rollout/exhausted": float(self.exhausted),
        }
        return {k: torch.full((), float(v), device=device) for k, v in values.items()}


def fill(
    rows: list[dict[str, Any]],
    formatted: list[str],
    *,
    sample: Sample,
    scorer: Scorer,
    group_filter: GroupFilter,
    settings: RolloutSpec,
    timings: dict[str, float],
    phase: Callable[[str], None],
    draw: Draw | None = None,
    rollout: Rollout | None = None,
    scores: Tensor | Scores | None = None,
) -> Filled:
    """The round's groups from the first batch (``rows``, ``formatted``) and, while
    ``group_filter`` has passed too few, the batches ``draw`` gives (see the module's
    docstring), generated by ``sample`` and scored by ``scorer`` under the ``rollout``
    section ``settings``. ``rollout`` and ``scores``: the first batch's responses and
    rewards, already made. The seconds spent generating and scoring add up in ``timings``
    (``time_generate``, ``time_score``); ``phase`` hears each phase begin."""
    timings.setdefault("time_generate", 0.0)
    timings.setdefault("time_score", 0.0)
    world = distributed.world()
    share = settings.prompts_per_round // world.size
    device = scorer.device
    keeps_all = bool(optional(group_filter, "group_filter", "keeps_all"))
    # a filter sees the reward parts when a component reads them (gdpo)
    with_parts = reads_parts(scorer.assembly.requires)
    batches: list[GroupBatch] = []
    passed = 0
    while True:
        if batches:
            assert draw is not None
            rows, formatted = draw()
        phase("generating")
        start = time.perf_counter()
        ro = (
            rollout
            if rollout is not None
            else sample(formatted, settings.n, batch=len(batches), rows=rows)
        )
        phase("scoring")
        middle = time.perf_counter()
        batch = _scored(rows, formatted, ro, scorer, scores)
        if not keeps_all:  # a filter that keeps every group is not called
            groups = _groups(batch, settings.n, with_parts)
            batch.keep = group_filter(groups).nonzero().flatten().tolist()
        timings["time_generate"] += middle - start
        timings["time_score"] += time.perf_counter() - middle
        batches.append(batch)
        rollout = scores = None
        mine = sum(len(b.keep) for b in batches)
        # the fewest passed groups of any process (keeps_all: every process holds its share)
        passed = mine if keeps_all else -distributed.max_over_processes(-mine, device)
        if passed >= share or len(batches) >= settings.max_generation_batches or draw is None:
            break
    take = min(passed, share)
    exhausted = passed < share
    if keeps_all or not world.distributed:
        total = mine * world.size
    else:
        total = _passed_sum(batches, device)
    if exhausted and settings.filter_exhausted == "error":
        raise UserError(
            f"rollout.filter: {getattr(group_filter, 'where', 'rollout.filter')} passed "
            f"{total} of the round's {settings.prompts_per_round} groups in {len(batches)} "
            "generation batches (rollout.max_generation_batches); rollout.filter_exhausted: "
            "error stops the run (set it to train to train on the groups that passed)"
        )
    got = _gather(batches, take, exhausted, settings.n, total, scorer)
    got.filtered = not keeps_all
    return got


def _scored(
    rows: list[dict[str, Any]],
    formatted: list[str],
    ro: Rollout,
    scorer: Scorer,
    scores: Tensor | Scores | None,
) -> GroupBatch:
    """One batch's responses scored (unless ``scores`` are given), every group kept."""
    if scores is None:
        scored, texts = scorer.rollout(rows, ro)
    else:
        texts = scorer.decode(ro)[0]
        scored = scores if isinstance(scores, Scores) else Scores(scores.to(scorer.device).float())
    return GroupBatch(rows, formatted, ro, scored, texts, list(range(len(rows))))


def _groups(batch: GroupBatch, n: int, with_parts: bool) -> Groups:
    """What a group filter sees of a batch: [G, n] rewards, lengths and truncation; with
    ``with_parts`` each reward's scores [G, n, K] and weights [K]."""
    g, ro = len(batch.rows), batch.rollout
    parts = weights = None
    if with_parts:
        columns, row_weights = batch.scores.columns()
        parts, weights = columns.view(g, n, -1), row_weights[0]
    return Groups(
        rows=batch.rows,
        responses=batch.texts,
        rewards=batch.scores.total.view(g, n),
        lengths=ro.response_mask.sum(1).view(g, n),
        truncated=ro.truncated.view(g, n),
        parts=parts,
        weights=weights,
    )


def _passed_sum(batches: list[GroupBatch], device: torch.device) -> int:
    """The groups that passed on every process, summed (whole-round)."""
    mine = torch.tensor(float(sum(len(b.keep) for b in batches)), device=device)
    return int(distributed.all_sum(mine).item())


def _gather(
    batches: list[GroupBatch], take: int, exhausted: bool, n: int, passed: int, scorer: Scorer
) -> Filled:
    """The first ``take`` passed groups of ``batches``, in order, as one batch."""
    rows: list[dict[str, Any]] = []
    formatted: list[str] = []
    texts: list[str] = []
    parts: list[Rollout] = []
    scores: list[Scores] = []
    left = take
    for b in batches:
        chosen = b.keep[:left]
        left -= len(chosen)
        if not chosen:
            continue
        index = [g * n + i for g in chosen for i in range(n)]
        at = torch.tensor(index, device=scorer.device)
        rows += [b.rows[g] for g in chosen]
        formatted += [b.formatted[g] for g in chosen]
        texts += [b.texts[i] for i in index]
        parts.append(b.rollout.rows(at))
        scores.append(b.scores.rows(at))
    pad = scorer.tokenizer.pad_token_id
    world = distributed.world().size
    every = Scores.cat([b.scores for b in batches])
    generated = {
        "scores": every.total,
        "lengths": torch.cat([b.rollout.response_mask.sum(1) for b in batches]),
        "truncated": torch.cat([b.rollout.truncated for b in batches]),
    }
    kept = None
    if parts:
        ro = Rollout.cat(parts, pad_id=int(pad or 0))
        kept = GroupBatch(rows, formatted, ro, Scores.cat(scores), texts, list(range(take)))
    return Filled(
        kept=kept,
        generated=generated,
        generated_parts=every.parts,
        generated_flags=every.flags,
        kept_groups=take * world,
        passed_groups=passed,
        generated_groups=sum(len(b.rows) for b in batches) * world,
        batches=len(batches),
        exhausted=exhausted,
    )
