"""Which of a round's rows go through one forward (and backward) pass together: micro-batches
of ``train.micro_batch_size`` rows, or by a token budget (``train.micro_batch_tokens``).

By a budget, a minibatch's rows are sorted by length (prompt + response tokens, the
environment's included), longest first, and taken in that order: a micro-batch holds rows
while its rows × its longest row stay within the budget (with ``train.pack_sequences``, while
the sum of its rows does: first fit, longest first), and a row longer than the budget goes
alone. Each micro-batch's rollout is cut to its own longest prompt and response, so its
padding is at most what rows of about the same length leave (packed: none); every forward
pass of the round uses them (log π_old, values, reference, update). On several processes
every process runs as many micro-batches as the process that needs the most (every forward
and backward of a sharded model is collective): a process that needs fewer splits its
costliest ones in two until it has as many.

The plan is made on the host from each row's length, read once a round, with one collective
a round on several processes (the largest count of each minibatch). The loss does not depend
on the plan: every micro-batch uses the whole minibatch's denominators
(:mod:`~ppokit.trainer.objective`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ppokit import distributed
from ppokit.spec import TrainSpec
from ppokit.trainer.rollout import Rollout

__all__ = ["Micro", "MicroBatches", "plan"]


@dataclass(frozen=True)
class Micro:
    """One micro-batch: its rows ``index`` (on the device) and, by a token budget, the
    longest real ``prompt`` and ``response`` among them (None: as the round pads them)."""

    index: Tensor
    prompt: int | None = None
    response: int | None = None

    def rollout(self, ro: Rollout) -> Rollout:
        """The micro-batch's rows of ``ro``, cut to its own longest prompt and response."""
        part = ro.rows(self.index)
        if self.prompt is None or self.response is None:
            return part
        return part.cut(self.prompt, self.response)


def plan(
    lengths: Sequence[int], budget: int, pack: bool = False, count: int = 0
) -> list[list[int]]:
    """Positions of ``lengths`` grouped into micro-batches of at most ``budget`` tokens each:
    rows × the longest row (``pack``: the sum of the rows), a row longer than the budget
    alone; then, while there are fewer than ``count`` groups, the costliest group of two rows
    or more split in two. Rows are taken longest first (ties: in order)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    loads: list[int] = []
    for i in order:  # host-side planning over plain ints
        if pack:
            fit = next((g for g, load in enumerate(loads) if load + lengths[i] <= budget), None)
        else:  # the group's first row is its longest
            last = len(groups) - 1
            fits = last >= 0 and (len(groups[last]) + 1) * lengths[groups[last][0]] <= budget
            fit = last if fits else None
        if fit is None:
            groups.append([i])
            loads.append(lengths[i])
        else:
            groups[fit].append(i)
            loads[fit] += lengths[i]

    def cost(g: list[int]) -> int:
        return sum(lengths[i] for i in g) if pack else len(g) * max(lengths[i] for i in g)

    while len(groups) < count:
        splittable = [g for g in range(len(groups)) if len(groups[g]) > 1]
        if not splittable:
            break
        g = max(splittable, key=lambda k: cost(groups[k]))
        half = len(groups[g]) // 2
        groups[g : g + 1] = [groups[g][:half], groups[g][half:]]
    return groups


@dataclass(frozen=True)
class MicroBatches:
    """A round's micro-batches: ``rows`` rows each (None: the whole minibatch), or by the
    token ``budget`` over each row's ``prompt_tokens`` and ``response_tokens`` (real tokens,
    read once from the round's rollout)."""

    rows: int | None
    budget: int | None = None
    pack: bool = False
    prompt_tokens: tuple[int, ...] = ()
    response_tokens: tuple[int, ...] = ()

    @classmethod
    def of(cls, train: TrainSpec, ro: Rollout) -> MicroBatches:
        """The micro-batches ``train`` asks for, over the rows of ``ro`` (this process's)."""
        if train.micro_batch_tokens is None:
            return cls(train.micro_batch_size)
        counts = torch.stack([ro.prompt_mask.sum(1), ro.present.sum(1)]).tolist()  # one read
        return cls(
            None, train.micro_batch_tokens, train.pack_sequences, tuple(counts[0]), tuple(counts[1])
        )

    def minibatches(
        self, order: Tensor, size: int, device: torch.device
    ) -> list[tuple[Tensor, list[Micro]]]:
        """The minibatches of ``size`` rows of ``order`` (a permutation of the rows, on the
        CPU), each on ``device`` with its micro-batches."""
        if self.budget is None:
            split = order.to(device).split(size)
            return [(idx, [Micro(j) for j in idx.split(self.rows or size)]) for idx in split]
        parts = [idx.tolist() for idx in order.split(size)]
        micros = self._agreed(parts, device)
        return [
            (torch.tensor(rows, device=device), m) for rows, m in zip(parts, micros, strict=True)
        ]

    def whole(self, rows: int, device: torch.device) -> list[Micro]:
        """Micro-batches of all ``rows`` rows by the token budget (the no-grad passes)."""
        return self._agreed([list(range(rows))], device)[0]

    def _agreed(self, parts: list[list[int]], device: torch.device) -> list[list[Micro]]:
        """Each part's micro-batches by the budget, as many on every process."""
        assert self.budget is not None
        lengths = [p + r for p, r in zip(self.prompt_tokens, self.response_tokens, strict=True)]

        def grouped(rows: list[int], count: int = 0) -> list[list[int]]:
            groups = plan([lengths[i] for i in rows], self.budget or 0, self.pack, count)
            return [[rows[k] for k in g] for g in groups]

        counts = distributed.max_each([len(grouped(rows)) for rows in parts], device)
        out = []
        for rows, count in zip(parts, counts, strict=True):
            micros = []
            for g in grouped(rows, count):
                prompt = max(self.prompt_tokens[i] for i in g)
                response = max(1, max(self.response_tokens[i] for i in g))
                micros.append(Micro(torch.tensor(g, device=device), prompt, response))
            out.append(micros)
        return out
