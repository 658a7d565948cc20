"""Dynamic sampling over a producer's batches: the round's groups, generated and scored
batch after batch until ``rollout.filter`` has passed ``rollout.prompts_per_round`` of them
(DAPO, arXiv:2503.14476, section 3.2). A group is one prompt's ``rollout.n`` responses.

:func:`fill` takes its batches from a :class:`Source` (a producer's), scores each and asks
the filter which groups enter the round; while fewer than the round's groups have passed
and fewer than ``rollout.max_generation_batches`` batches were generated, it asks the source
for the next batch of ``prompts_per_round`` prompts (this process's share on several
processes), when the source can draw more (``refills``). Groups past the round's count are
dropped, and so is every group the filter rejects: neither reaches the estimation or the
update. Every prompt drawn is consumed from the data stream, kept or not, so the data
position after a round is the prompts drawn.

On several processes the rule is whole-round: after each batch the processes agree on the
smallest number of passed groups any of them holds (one all-reduce); they stop when every
process holds its share (``prompts_per_round / processes``) or at the bound, and each keeps
its first ``min(that number, share)`` passed groups. So every process draws the same number
of batches and ends with the same number of groups (the update gathers equal shares), and
the counts are the whole round's.

A filter that declares ``keeps_all`` (``none``) is not called: the first batch fills the
round, nothing else is drawn and nothing is read back to the host. Any other filter's flags
are read back once per batch (which groups to keep).

A source that ``overlaps`` (:mod:`~ppokit.trainer.producers.overlapped`; when a reward
waits on something else: :attr:`~ppokit.trainer.scoring.Scorer.waits`, and no environment
of several turns) may generate the next batch while batch k's waiting rewards are called on
the scoring threads, when it judges that batch ``worth`` it; then batch k's scores are
finished and filtered as above. When the round needs no further batch, the source gives
back what it generated ahead (:meth:`Source.give_back`), as if it never was. ``time_score``
counts the scoring that generation did not hide, ``time_discarded`` the generation that
went back.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from ppokit import distributed
from ppokit.components.group_filter import GroupFilter, Groups
from ppokit.errors import UserError
from ppokit.spec import RolloutSpec
from ppokit.trainer.assembly import optional
from ppokit.trainer.flops import generation_positions
from ppokit.trainer.groups import Filled, Generated, GroupBatch
from ppokit.trainer.rollout import Rollout
from ppokit.trainer.scoring import Pending, Scorer, Scores, reads_parts

__all__ = ["Batch", "Source", "fill"]


@dataclass
class Batch:
    """One generated batch: its data ``rows``, ``formatted`` prompts, responses and, when
    they were scored elsewhere, their rewards (``scores``)."""

    rows: list[dict[str, Any]]
    formatted: list[str]
    rollout: Rollout
    scores: Tensor | Scores | None = None


class Source(Protocol):
    """Where :func:`fill` takes a round's batches from (a producer's)."""

    #: whether batches after the first can be drawn
    refills: bool
    #: whether a batch may be generated ahead while the one before it is scored
    overlaps: bool

    def held(self) -> Batch | None:
        """The batch generated ahead (taken: held no more), or None."""
        ...

    def generate(self, number: int) -> Batch:
        """Batch ``number`` (0-based) of the round, drawn and generated."""
        ...

    def worth(self, passed: int, share: int) -> bool:
        """Whether a batch ahead is likely needed, ``passed`` of ``share`` groups passed."""
        ...

    def generate_ahead(self, number: int) -> float:
        """Batch ``number`` drawn and generated ahead (held); the seconds it took."""
        ...

    def counted(self, passed: int, drawn: int) -> None:
        """A batch's whole-round counts: groups passed and drawn."""
        ...

    def give_back(self) -> float | None:
        """The batch held, if any, back as if it never was; the seconds it took."""
        ...


def fill(
    source: Source,
    *,
    scorer: Scorer,
    group_filter: GroupFilter,
    settings: RolloutSpec,
    timings: dict[str, float],
    phase: Callable[[str], None],
) -> Filled:
    """The round's groups from the batches of ``source`` (see the module's docstring),
    scored by ``scorer`` and passed by ``group_filter`` under the ``rollout`` section
    ``settings``. The seconds spent generating and scoring add up in ``timings``
    (``time_generate``, ``time_score``, and ``time_discarded`` for a batch generated ahead
    that went back); ``phase`` hears each phase begin."""
    timings.setdefault("time_generate", 0.0)
    timings.setdefault("time_score", 0.0)
    world = distributed.world()
    share = settings.prompts_per_round // world.size
    device = scorer.device
    limit = settings.max_generation_batches
    keeps_all = bool(optional(group_filter, "group_filter", "keeps_all"))
    overlap = (
        source.overlaps
        and not keeps_all
        and settings.overlap_scoring
        and scorer.waits
        and not _multi_turn(scorer)
    )
    # a filter sees the reward parts when a component reads them (gdpo)
    with_parts = reads_parts(scorer.assembly.requires)
    kept: list[GroupBatch] = []  # the passed groups, at most this process's share
    generated: Generated | None = None
    batches = mine = drawn = passed = 0
    try:
        while True:
            got = source.held()
            if got is None:
                if batches:
                    phase(
                        f"generating batch {batches + 1} of at most {limit} ({passed} of "
                        f"{share} groups passed so far)"
                    )
                else:
                    phase("generating")
                start = time.perf_counter()
                got = source.generate(batches)
                timings["time_generate"] += time.perf_counter() - start
            phase("scoring")
            begin = time.perf_counter()
            pending: Pending | None = None
            texts: list[str] = []
            hidden = 0.0
            if overlap and got.scores is None:
                pending, texts = scorer.start_rollout(got.rows, got.rollout, overlap=True)
            if pending is not None and batches + 1 < limit and source.worth(passed, share):
                phase(
                    f"generating batch {batches + 2} of at most {limit} while batch "
                    f"{batches + 1} is scored"
                )
                hidden = source.generate_ahead(batches + 1)
                timings["time_generate"] += hidden
                phase("scoring")
            batch = _scored(got, scorer, pending, texts)
            del got
            if not keeps_all:  # a filter that keeps every group is not called
                groups = _groups(batch, settings.n, with_parts)
                batch.keep = group_filter(groups).nonzero().flatten().tolist()
            timings["time_score"] += time.perf_counter() - begin - hidden
            if generated is None:
                made = batch.scores
                generated = Generated(settings.n, list(made.parts), list(made.flags), device)
            ro = batch.rollout
            positions = generation_positions(ro.prompt_mask.sum(1), ro.present.sum(1))
            generated.add(batch.scores, ro.response_mask.sum(1), ro.truncated, positions)
            batches += 1
            drawn += len(batch.rows)
            mine += len(batch.keep)
            held = sum(len(b.keep) for b in kept)
            if batch.keep[: share - held]:  # only what the round can take stays
                kept.append(_only(batch, batch.keep[: share - held], settings.n, device))
            del batch, ro
            # the fewest passed groups of any process (keeps_all: every process holds its share)
            before = passed
            passed = mine if keeps_all else -distributed.max_over_processes(-mine, device)
            source.counted(passed - before, share)
            if passed >= share or batches >= limit or not source.refills:
                break
    finally:
        seconds = source.give_back()  # generated ahead, not needed: as if it never was
        if seconds is not None:
            timings["time_generate"] -= seconds
            timings["time_discarded"] = timings.get("time_discarded", 0.0) + seconds
    assert generated is not None
    take = min(passed, share)
    exhausted = passed < share
    whole = keeps_all or not world.distributed
    total = mine * world.size if whole else _passed_sum(mine, device)
    if exhausted and settings.filter_exhausted == "error":
        raise UserError(
            f"rollout.filter: {getattr(group_filter, 'where', 'rollout.filter')} passed "
            f"{total} of the round's {settings.prompts_per_round} groups in {batches} "
            "generation batches (rollout.max_generation_batches); rollout.filter_exhausted: "
            "error stops the run (set it to train to train on the groups that passed)"
        )
    return Filled(
        kept=_gather(kept, take, scorer),
        generated=generated,
        kept_groups=take * world.size,
        passed_groups=total,
        generated_groups=drawn * world.size,
        batches=batches,
        exhausted=exhausted,
        filtered=not keeps_all,
    )


def _multi_turn(scorer: Scorer) -> bool:
    """Whether the round's episodes have several turns (an environment that is not
    ``single_turn``)."""
    environment = scorer.assembly.environment
    return environment is not None and not optional(environment, "environment", "single_turn")


def _only(batch: GroupBatch, groups: list[int], n: int, device: torch.device) -> GroupBatch:
    """The batch cut to ``groups`` (its passed groups the round can take), in order."""
    index = [g * n + i for g in groups for i in range(n)]
    at = torch.tensor(index, device=device)
    return GroupBatch(
        rows=[batch.rows[g] for g in groups],
        formatted=[batch.formatted[g] for g in groups],
        rollout=batch.rollout.rows(at),
        scores=batch.scores.rows(at),
        texts=[batch.texts[i] for i in index],
        keep=list(range(len(groups))),
    )


def _scored(
    got: Batch, scorer: Scorer, pending: Pending | None = None, texts: list[str] | None = None
) -> GroupBatch:
    """One batch's responses scored (``pending``: its scoring begun, with its ``texts``;
    its ``scores``: given), every group kept."""
    rows, ro, scores = got.rows, got.rollout, got.scores
    if pending is not None:
        assert texts is not None
        scored = scorer.rollout_scores(ro, pending.result())
    elif scores is None:
        scored, texts = scorer.rollout(rows, ro)
    else:
        texts = scorer.decode(ro)[3]
        scored = scores if isinstance(scores, Scores) else Scores(scores.to(scorer.device).float())
    return GroupBatch(rows, got.formatted, ro, scored, texts, list(range(len(rows))))


def _groups(batch: GroupBatch, n: int, with_parts: bool) -> Groups:
    """What a group filter sees of a batch: [G, n] rewards, lengths and truncation; with
    ``with_parts`` each reward's scores [G, n, K] and weights [K]."""
    g, ro = len(batch.rows), batch.rollout
    parts = weights = None
    if with_parts:
        columns, row_weights = batch.scores.columns()
        parts, weights = columns.view(g, n, -1), row_weights[0]
    return Groups(  # its own copies of the rows and texts (the tensors are read-only)
        rows=copy.deepcopy(batch.rows),
        responses=list(batch.texts),
        rewards=batch.scores.total.view(g, n),
        lengths=ro.response_mask.sum(1).view(g, n),
        truncated=ro.truncated.view(g, n),
        parts=parts,
        weights=weights,
    )


def _passed_sum(mine: int, device: torch.device) -> int:
    """The groups that passed on every process, summed (whole-round)."""
    return int(distributed.all_sum(torch.tensor(float(mine), device=device)).item())


def _gather(kept: list[GroupBatch], take: int, scorer: Scorer) -> GroupBatch | None:
    """The first ``take`` groups of ``kept`` (passed groups, in order), as one batch."""
    rows: list[dict[str, Any]] = []
    formatted: list[str] = []
    texts: list[str] = []
    parts: list[Rollout] = []
    scores: list[Scores] = []
    left = take
    for b in kept:
        chosen = b.keep[:left]
        left -= len(chosen)
        if not chosen:
            continue
        n = len(b.texts) // len(b.rows)
        index = [g * n + i for g in chosen for i in range(n)]
        at = torch.tensor(index, device=scorer.device)
        rows += [b.rows[g] for g in chosen]
        formatted += [b.formatted[g] for g in chosen]
        texts += [b.texts[i] for i in index]
        parts.append(b.rollout.rows(at))
        scores.append(b.scores.rows(at))
    if not parts:
        return None
    ro = Rollout.cat(parts, pad_id=int(scorer.tokenizer.pad_token_id or 0))
    return GroupBatch(rows, formatted, ro, Scores.cat(scores), texts, list(range(take)))
