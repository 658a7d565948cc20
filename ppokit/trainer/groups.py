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
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ppokit import distributed
from ppokit.components.group_filter import Groups
from ppokit.errors import UserError
from ppokit.trainer.assembly import optional
from ppokit.trainer.checks import NonFinite
from ppokit.trainer.rollout import Rollout

if TYPE_CHECKING:
    from ppokit.trainer.round import Learner

__all__ = ["Draw", "Filled", "fill"]

#: The next batch of prompts: this process's data rows and their formatted prompts.
Draw = Callable[[], tuple[list[dict[str, Any]], list[str]]]


@dataclass
class Filled:
    """The round's kept groups (``rows``, their ``rollout.n`` responses each, in order) and
    what was generated to find them."""

    rows: list[dict[str, Any]]
    formatted: list[str]
    rollout: Rollout | None  # None: no group passed
    scores: Tensor  # R [B] of the kept responses
    parts: dict[str, Tensor]  # each reward's scores of the kept responses (several rewards)
    texts: list[str]
    #: every generated response of this process: R, each reward's scores, lengths, truncation
    generated: dict[str, Tensor] = field(default_factory=dict)
    generated_parts: dict[str, Tensor] = field(default_factory=dict)
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


@dataclass
class _Batch:
    rows: list[dict[str, Any]]
    formatted: list[str]
    rollout: Rollout
    scores: Tensor
    parts: dict[str, Tensor]
    texts: list[str]
    keep: list[int]  # indices of the groups that passed


def fill(
    lrn: Learner,
    rows: list[dict[str, Any]],
    formatted: list[str],
    checks: NonFinite,
    timings: dict[str, float],
    draw: Draw | None = None,
    rollout: Rollout | None = None,
    scores: Tensor | None = None,
) -> Filled:
    """The round's groups from the first batch (``rows``, ``formatted``) and, while the
    filter has passed too few, the batches ``draw`` gives (see the module's docstring).
    ``rollout`` and ``scores``: the first batch's responses and rewards, already made.
    The seconds spent generating and scoring add up in ``timings`` (``time_generate``,
    ``time_score``); the rewards go into ``checks``."""
    timings.setdefault("time_generate", 0.0)
    timings.setdefault("time_score", 0.0)
    spec, n = lrn.spec, lrn.spec.rollout.n
    world = distributed.world()
    share = spec.rollout.prompts_per_round // world.size
    limit = spec.rollout.max_generation_batches
    keeps_all = bool(optional(lrn.assembly.filter, "group_filter", "keeps_all"))
    batches: list[_Batch] = []
    passed = 0
    while True:
        if batches:
            assert draw is not None
            rows, formatted = draw()
        batch = _one_batch(
            lrn, rows, formatted, len(batches), checks, timings, rollout, scores, keeps_all
        )
        batches.append(batch)
        rollout = scores = None
        mine = sum(len(b.keep) for b in batches)
        # the fewest passed groups of any process (keeps_all: every process holds its share)
        passed = mine if keeps_all else -distributed.max_over_processes(-mine, lrn.device)
        if passed >= share or len(batches) >= limit or draw is None:
            break
    take = min(passed, share)
    exhausted = passed < share
    if keeps_all or not world.distributed:
        total = mine * world.size
    else:
        total = _passed_sum(batches, lrn.device)
    if exhausted and spec.rollout.filter_exhausted == "error":
        name = lrn.assembly.name("rollout.filter")
        raise UserError(
            f"rollout.filter: {name} passed {total} of the round's "
            f"{spec.rollout.prompts_per_round} groups in {len(batches)} generation batches "
            "(rollout.max_generation_batches); rollout.filter_exhausted: error stops the run "
            "(set it to train to train on the groups that passed)"
        )
    got = _gather(lrn, batches, take, exhausted, n, total)
    got.filtered = not keeps_all
    return got


def _passed_sum(batches: list[_Batch], device: torch.device) -> int:
    """The groups that passed on every process, summed (whole-round)."""
    mine = torch.tensor(float(sum(len(b.keep) for b in batches)), device=device)
    return int(distributed.all_sum(mine).item())


def _one_batch(
    lrn: Learner,
    rows: list[dict[str, Any]],
    formatted: list[str],
    index: int,
    checks: NonFinite,
    timings: dict[str, float],
    rollout: Rollout | None,
    scores: Tensor | None,
    keeps_all: bool,
) -> _Batch:
    """Generate (unless given), score and filter one batch (a filter that ``keeps_all``
    is not called)."""
    n = lrn.spec.rollout.n
    lrn.on_phase("generating")
    start = time.perf_counter()
    ro = rollout if rollout is not None else lrn.sample(formatted, n, batch=index, rows=rows)
    lrn.on_phase("scoring")
    middle = time.perf_counter()
    if scores is None:
        scores, parts, texts = lrn.scorer.rollout(rows, ro, checks)
    else:
        texts, parts = lrn.scorer.decode(ro)[0], {}
        scores = scores.to(lrn.device).float()
    g = len(rows)
    groups = Groups(
        rows=rows,
        responses=texts,
        rewards=scores.view(g, n),
        lengths=ro.response_mask.sum(1).view(g, n),
        truncated=ro.truncated.view(g, n),
    )
    keep = (
        list(range(g))
        if keeps_all
        else lrn.assembly.filter(groups).nonzero().flatten().tolist()  # one host read
    )
    timings["time_generate"] += middle - start
    timings["time_score"] += time.perf_counter() - middle
    return _Batch(rows, formatted, ro, scores, parts, texts, keep)


def _gather(
    lrn: Learner, batches: list[_Batch], take: int, exhausted: bool, n: int, passed: int
) -> Filled:
    """The first ``take`` passed groups of ``batches``, in order, as one rollout."""
    rows: list[dict[str, Any]] = []
    formatted: list[str] = []
    texts: list[str] = []
    parts: list[Rollout] = []
    scores: list[Tensor] = []
    rewards: dict[str, list[Tensor]] = {}
    left = take
    for b in batches:
        chosen = b.keep[:left]
        left -= len(chosen)
        if not chosen:
            continue
        index = [g * n + i for g in chosen for i in range(n)]
        at = torch.tensor(index, device=lrn.device)
        rows += [b.rows[g] for g in chosen]
        formatted += [b.formatted[g] for g in chosen]
        texts += [b.texts[i] for i in index]
        parts.append(b.rollout.rows(at))
        scores.append(b.scores[at])
        for name, s in b.parts.items():
            rewards.setdefault(name, []).append(s[at])
    pad = lrn.models.tokenizer.pad_token_id
    world = distributed.world().size
    generated = {
        "scores": torch.cat([b.scores for b in batches]),
        "lengths": torch.cat([b.rollout.response_mask.sum(1) for b in batches]),
        "truncated": torch.cat([b.rollout.truncated for b in batches]),
    }
    names = batches[0].parts
    return Filled(
        rows=rows,
        formatted=formatted,
        rollout=Rollout.cat(parts, pad_id=int(pad or 0)) if parts else None,
        scores=torch.cat(scores) if scores else batches[0].scores[:0],
        parts={name: torch.cat(s) for name, s in rewards.items()},
        texts=texts,
        generated=generated,
        generated_parts={name: torch.cat([b.parts[name] for b in batches]) for name in names},
        kept_groups=take * world,
        passed_groups=passed,
        generated_groups=sum(len(b.rows) for b in batches) * world,
        batches=len(batches),
        exhausted=exhausted,
    )
