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

Scoring overlapped with generation (``rollout.overlap_scoring``, when a reward waits on
something else: :attr:`~ppokit.trainer.scoring.Scorer.waits`, and no environment of several
turns): while batch k's waiting rewards are called on the scoring threads, the next batch is
drawn and generated ahead, when batch k is expected to leave the round short
(:class:`Lookahead`: at the run's share of passed groups so far); then batch k's scores are
finished and filtered as above. When
the round needs no further batch, the batch generated ahead goes back: its prompts to the
data stream (``put_back``) and torch's random state (the ``hf`` engine draws from it) to
what it was before it. So the batches that enter the round, their scores and the data
position are those of the same round without the overlap. ``time_score`` counts the
scoring that generation did not hide, ``time_discarded`` the generation that went back.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ppokit import distributed
from ppokit.components.group_filter import GroupFilter, Groups
from ppokit.errors import UserError
from ppokit.spec import RolloutSpec
from ppokit.trainer.assembly import optional
from ppokit.trainer.rollout import Rollout
from ppokit.trainer.scoring import Pending, Scorer, Scores, reads_parts

__all__ = [
    "Draw",
    "Filled",
    "Generated",
    "GroupBatch",
    "Lookahead",
    "PutBack",
    "Sample",
    "fill",
]

#: The next batch of prompts: this process's data rows and their formatted prompts.
Draw = Callable[[], tuple[list[dict[str, Any]], list[str]]]

#: The last batch :data:`Draw` gave, not used: its prompts back into the data stream.
PutBack = Callable[[], None]

#: ``sample(prompts, n, batch=k, rows=rows)``: ``n`` responses per prompt for the round's
#: generation batch ``k`` (:meth:`~ppokit.trainer.setup.Setup.sample` of the round).
Sample = Callable[..., Rollout]


@dataclass
class Lookahead:
    """Whether to generate the next batch while one is scored: when the groups that passed
    so far plus those the batch being scored is expected to pass, at the run's share so far
    (``passed / drawn``, whole-round counts, so every process decides alike; 0 before any
    batch), fall short of the round's. Which batches are generated ahead changes no
    result, only how much generation goes back unused."""

    passed: int = 0
    drawn: int = 0

    def worth(self, passed: int, share: int) -> bool:
        """Whether a batch ahead is likely needed: ``passed`` of ``share`` groups passed
        before the batch being scored."""
        rate = self.passed / self.drawn if self.drawn else 0.0
        return passed + rate * share < share

    def add(self, passed: int, drawn: int) -> None:
        """A batch's whole-round counts: groups passed and drawn."""
        self.passed += passed
        self.drawn += drawn


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


class Generated:
    """What every generated response of a round's batches adds up to, on this process, in
    sums of fixed size (memory stays flat over any number of generation batches): how
    many, R's sum and its sum of squares about the first score (its shift), R's least and
    largest values, the lengths and truncations summed, the groups and those whose rewards
    are all equal, each reward's scores summed and each flag a reward raised counted
    (``names``, ``flags``: those of the first batch). :meth:`metrics` combines the
    processes' sums (one gather) into the round's statistics."""

    #: The sums' fields, then one sum per reward.
    FIELDS = ("count", "shift", "sum", "sumsq", "min", "max", "length", "truncated")
    GROUP_FIELDS = ("groups", "equal")

    def __init__(self, n: int, names: list[str], flags: list[str], device: torch.device) -> None:
        self.n = n
        self.names = names
        self.flags = flags
        dtype = torch.float32 if device.type == "mps" else torch.float64
        width = len(self.FIELDS) + len(self.GROUP_FIELDS) + len(names) + len(flags)
        self.sums = torch.zeros(width, dtype=dtype, device=device)
        self.first = True

    def add(self, scores: Scores, lengths: Tensor, truncated: Tensor) -> None:
        """Fold one batch's responses in (no host read)."""
        s = scores.total.detach().to(self.sums.dtype)
        if self.first:
            self.sums[1] = s[0]
            self.sums[4], self.sums[5] = s.min(), s.max()
            self.first = False
        shifted = s - self.sums[1]
        groups = s.view(-1, self.n)
        equal = (groups.amax(1) == groups.amin(1)).sum()
        batch = [
            s.new_tensor(float(s.numel())),
            s.new_zeros(()),
            shifted.sum(),
            (shifted * shifted).sum(),
            s.new_zeros(()),
            s.new_zeros(()),
            lengths.to(s.dtype).sum(),
            truncated.to(s.dtype).sum(),
            s.new_tensor(float(groups.shape[0])),
            equal.to(s.dtype),
            *(scores.parts[name].detach().to(s.dtype).sum() for name in self.names),
            *(
                scores.flags[name].detach().to(s.dtype).sum()
                if name in scores.flags
                else s.new_zeros(())
                for name in self.flags
            ),
        ]
        self.sums += torch.stack(batch)
        self.sums[4] = torch.minimum(self.sums[4], s.min())
        self.sums[5] = torch.maximum(self.sums[5], s.max())

    def metrics(self, groups: bool) -> dict[str, Tensor]:
        """The round's ``reward_mean``, ``reward_std``, ``response_length_mean``,
        ``truncated_frac``, ``tokens``; with ``groups`` ``rollout/zero_variance_groups``;
        with several rewards each one's mean (``reward/<name>``); each flag a reward raised,
        the fraction of the responses it was raised on (``reward/<name>/<flag>_frac``): over
        every process."""
        rows = self.sums[None]
        if distributed.world().distributed:
            rows = distributed.gather_rows(rows)
        count, shift, total, squares, low, high = (rows[:, i] for i in range(6))
        n = count.sum()
        means = shift + total / count
        mean = (count * means).sum() / n
        within = squares - total * total / count
        spread = (within + count * (means - mean) ** 2).sum().clamp(min=0)
        std = (spread / (n - 1).clamp(min=1)).sqrt()
        std = torch.where(low.min() == high.max(), std.new_zeros(()), std)
        summed = rows[:, 6:].sum(0)
        metrics = {
            "reward_mean": mean,
            "reward_std": std,
            "response_length_mean": summed[0] / n,
            "truncated_frac": summed[1] / n,
            "tokens": summed[0],
        }
        if groups:
            metrics["rollout/zero_variance_groups"] = summed[3] / summed[2]
        if len(self.names) > 1:
            for i, name in enumerate(self.names):
                metrics[f"reward/{name}"] = summed[4 + i] / n
        for i, name in enumerate(self.flags):
            metrics[f"reward/{name}_frac"] = summed[4 + len(self.names) + i] / n
        return {k: v.float() for k, v in metrics.items()}


@dataclass
class Filled:
    """The round's kept groups (``kept``: None when no group passed) and what was generated
    to find them."""

    kept: GroupBatch | None
    #: every generated response of this process: R, each reward's scores, lengths, truncation
    generated: Generated
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
    put_back: PutBack | None = None,
    lookahead: Lookahead | None = None,
    rollout: Rollout | None = None,
    scores: Tensor | Scores | None = None,
) -> Filled:
    """The round's groups from the first batch (``rows``, ``formatted``) and, while
    ``group_filter`` has passed too few, the batches ``draw`` gives (see the module's
    docstring), generated by ``sample`` and scored by ``scorer`` under the ``rollout``
    section ``settings``; with ``put_back`` a batch may be generated ahead while the one
    before it is scored (``rollout.overlap_scoring``; ``lookahead``: when, learnt over the
    run's rounds). ``rollout`` and ``scores``: the
    first batch's responses and rewards, already made. The seconds spent generating and
    scoring add up in ``timings`` (``time_generate``, ``time_score``, and
    ``time_discarded`` for a batch generated ahead that went back); ``phase`` hears each
    phase begin."""
    timings.setdefault("time_generate", 0.0)
    timings.setdefault("time_score", 0.0)
    world = distributed.world()
    share = settings.prompts_per_round // world.size
    device = scorer.device
    keeps_all = bool(optional(group_filter, "group_filter", "keeps_all"))
    overlap = (
        draw is not None
        and put_back is not None
        and not keeps_all
        and settings.overlap_scoring
        and scorer.waits
        and not _multi_turn(scorer)
    )
    lookahead = lookahead if lookahead is not None else Lookahead()
    # a filter sees the reward parts when a component reads them (gdpo)
    with_parts = reads_parts(scorer.assembly.requires)
    kept: list[GroupBatch] = []  # the passed groups, at most this process's share
    generated: Generated | None = None
    ahead: _Ahead | None = None  # the next batch, generated while this one was scored
    batches = mine = drawn = passed = 0
    try:
        while True:
            if ahead is not None:
                rows, formatted, ro = ahead.rows, ahead.formatted, ahead.rollout
                ahead = None
            else:
                if batches:
                    assert draw is not None
                    rows, formatted = draw()
                    phase(
                        f"generating batch {batches + 1} of at most "
                        f"{settings.max_generation_batches} ({passed} of {share} groups "
                        "passed so far)"
                    )
                else:
                    phase("generating")
                start = time.perf_counter()
                ro = (
                    rollout
                    if rollout is not None
                    else sample(formatted, settings.n, batch=batches, rows=rows)
                )
                timings["time_generate"] += time.perf_counter() - start
            phase("scoring")
            begin = time.perf_counter()
            pending: Pending | None = None
            texts: list[str] = []
            if overlap and scores is None:
                pending, texts = scorer.start_rollout(rows, ro, overlap=True)
            if (
                pending is not None
                and batches + 1 < settings.max_generation_batches
                and lookahead.worth(passed, share)
            ):
                assert draw is not None
                ahead = _generate_ahead(draw, sample, settings, batches + 1, device, phase)
                timings["time_generate"] += ahead.seconds
                phase("scoring")
            batch = _scored(rows, formatted, ro, scorer, scores, pending, texts)
            if not keeps_all:  # a filter that keeps every group is not called
                groups = _groups(batch, settings.n, with_parts)
                batch.keep = group_filter(groups).nonzero().flatten().tolist()
            hidden = ahead.seconds if ahead is not None else 0.0
            timings["time_score"] += time.perf_counter() - begin - hidden
            if generated is None:
                got = batch.scores
                generated = Generated(settings.n, list(got.parts), list(got.flags), device)
            ro = batch.rollout
            generated.add(batch.scores, ro.response_mask.sum(1), ro.truncated)
            batches += 1
            drawn += len(batch.rows)
            mine += len(batch.keep)
            held = sum(len(b.keep) for b in kept)
            if batch.keep[: share - held]:  # only what the round can take stays
                kept.append(_only(batch, batch.keep[: share - held], settings.n, device))
            del batch, ro
            rollout = scores = None
            # the fewest passed groups of any process (keeps_all: every process holds its share)
            before = passed
            passed = mine if keeps_all else -distributed.max_over_processes(-mine, device)
            lookahead.add(passed - before, share)
            if passed >= share or batches >= settings.max_generation_batches or draw is None:
                break
    finally:
        if ahead is not None:  # generated ahead, not needed: as if it never was
            assert put_back is not None
            put_back()
            ahead.restore()
            timings["time_generate"] -= ahead.seconds
            timings["time_discarded"] = timings.get("time_discarded", 0.0) + ahead.seconds
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


@dataclass
class _Ahead:
    """A batch generated ahead: its rows, prompts, responses, the seconds it took and
    torch's random state before it (:meth:`restore`)."""

    rows: list[dict[str, Any]]
    formatted: list[str]
    rollout: Rollout
    seconds: float
    random_state: list[Tensor]
    device: torch.device

    def restore(self) -> None:
        """Torch's random state as it was before this batch was generated."""
        _set_random_state(self.device, self.random_state)


def _random_state(device: torch.device) -> list[Tensor]:
    """Torch's random state: the CPU generator's, and the device's own."""
    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    elif device.type == "mps":
        states.append(torch.mps.get_rng_state())
    return states


def _set_random_state(device: torch.device, states: list[Tensor]) -> None:
    torch.set_rng_state(states[0])
    if device.type == "cuda":
        torch.cuda.set_rng_state(states[1], device)
    elif device.type == "mps":
        torch.mps.set_rng_state(states[1])


def _generate_ahead(
    draw: Draw,
    sample: Sample,
    settings: RolloutSpec,
    number: int,
    device: torch.device,
    phase: Callable[[str], None],
) -> _Ahead:
    """Batch ``number`` (0-based) drawn and generated while the one before it is scored."""
    state = _random_state(device)
    rows, formatted = draw()
    phase(
        f"generating batch {number + 1} of at most {settings.max_generation_batches} "
        f"while batch {number} is scored"
    )
    start = time.perf_counter()
    ro = sample(formatted, settings.n, batch=number, rows=rows)
    return _Ahead(rows, formatted, ro, time.perf_counter() - start, state, device)


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
    rows: list[dict[str, Any]],
    formatted: list[str],
    ro: Rollout,
    scorer: Scorer,
    scores: Tensor | Scores | None,
    pending: Pending | None = None,
    texts: list[str] | None = None,
) -> GroupBatch:
    """One batch's responses scored (``pending``: its scoring begun, with its ``texts``;
    ``scores``: given), every group kept."""
    if pending is not None:
        assert texts is not None
        scored = scorer.rollout_scores(ro, pending.result())
    elif scores is None:
        scored, texts = scorer.rollout(rows, ro)
    else:
        texts = scorer.decode(ro)[3]
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
