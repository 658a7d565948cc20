"""Scoring responses: decoded to text (the one host read of a round's responses) and scored
by the spec's rewards, R = Σ_k weight_k · reward_k, each reward's scores kept apart beside R
(the batch's ``reward_parts``). The training round and the evaluation both score through a
:class:`Scorer`.

Scoring can be started and finished apart (:meth:`Scorer.start`, :class:`Pending`): the
rewards that wait (:func:`~ppokit.trainer.boundary.waits`: a ``blocking`` reward, one in
several worker processes) are called on a bounded pool of threads, one thread a reward,
while the trainer's thread goes on (the round generates its next batch); the others are
called, and every answer checked and counted, on the trainer's thread when the scores are
asked for, in the rewards' order. So the scores are the same, in the rows' order, whatever
order the calls end in."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ppokit.bounded import Started, Threads
from ppokit.components.reward import RESERVED_FIELDS
from ppokit.errors import UserError
from ppokit.trainer.assembly import Assembly, as_scores
from ppokit.trainer.boundary import finish, reply, waits
from ppokit.trainer.checks import count
from ppokit.trainer.rollout import Rollout, decode_rows

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "ENVIRONMENT",
    "Pending",
    "Scorer",
    "Scores",
    "labels",
    "reads_parts",
    "score_texts",
    "start_texts",
]

#: The label of a multi-turn episode's turn rewards among the parts.
ENVIRONMENT = "environment"


@dataclass
class Scores:
    """A batch's rewards: R [B], and each reward's own scores r_k [B] with its weight w_k
    (``parts``, ``weights``: by label, in the spec's order, the environment's turn rewards
    last), and the flags the rewards raised (``flags``: ``"<label>/<flag>"`` -> float32 [B]
    in {0, 1}, e.g. ``judge/unparsed``)."""

    total: Tensor
    parts: dict[str, Tensor] = field(default_factory=dict)
    weights: dict[str, float] = field(default_factory=dict)
    flags: dict[str, Tensor] = field(default_factory=dict)

    def columns(self) -> tuple[Tensor, Tensor]:
        """The batch's ``reward_parts`` and ``reward_weights``, float32 [B, K] each (K = 1,
        R itself with weight 1, when the parts are unknown: scores given from outside)."""
        if not self.parts:
            r = self.total.float()[:, None]
            return r, torch.ones_like(r)
        parts = torch.stack([p.float() for p in self.parts.values()], 1)
        weights = torch.tensor(list(self.weights.values()), device=parts.device)
        return parts, weights.expand_as(parts).contiguous()

    def rows(self, index: Tensor) -> Scores:
        """The scores of the rows ``index``."""
        return Scores(
            self.total[index],
            {k: v[index] for k, v in self.parts.items()},
            dict(self.weights),
            {k: v[index] for k, v in self.flags.items()},
        )

    @staticmethod
    def cat(items: list[Scores]) -> Scores:
        """The scores of several batches, rows in order (the parts and flags every batch
        has: a batch whose scores were given from outside has none)."""
        first = items[0]
        parts = [k for k in first.parts if all(k in s.parts for s in items)]
        flags = [k for k in first.flags if all(k in s.flags for s in items)]
        return Scores(
            torch.cat([s.total for s in items]),
            {k: torch.cat([s.parts[k] for s in items]) for k in parts},
            {k: first.weights[k] for k in parts},
            {k: torch.cat([s.flags[k] for s in items]) for k in flags},
        )


def reads_parts(requires: frozenset[str]) -> bool:
    """Whether a component reads each reward's scores (the batch's [B, K] fields)."""
    return bool(requires & {"reward_parts", "reward_weights"})


def labels(names: list[str]) -> list[str]:
    """Each reward's label: its name, or ``name.i`` (i its index in the spec's list) for a
    name several rewards share."""
    seen = Counter(names)
    return [name if seen[name] == 1 else f"{name}.{i}" for i, name in enumerate(names)]


def score_texts(
    rewards: list[tuple[str, Any, float]],
    prompts: list[str],
    responses: list[str],
    fields: dict[str, list[Any]],
    device: torch.device,
) -> Scores:
    """R = Σ_k weight_k · reward_k, float32 [B], with each reward's scores and flags, of
    ``rewards`` ((name, reward, weight) each, behind their boundary) over ``responses`` with
    their ``fields`` (one entry per response each: the data's columns, ``lengths``,
    ``truncated``, ``transcripts``). Each reward counts its own scores into the round's
    non-finite counter; R is counted here."""
    return start_texts(rewards, prompts, responses, fields, device).result()


@dataclass
class Pending:
    """A batch's scoring under way (:func:`start_texts`): :meth:`result` calls the rewards
    that were not started, waits for those that were (``started``: by the reward's index),
    and checks every answer, in the rewards' order, on the calling thread."""

    rewards: list[tuple[str, Any, float]]
    prompts: list[str]
    responses: list[str]
    fields: dict[str, list[Any]]
    device: torch.device
    started: dict[int, Started]

    def result(self) -> Scores:
        """The batch's :class:`Scores` (what a reward raised is raised here, its one line)."""
        out = Scores(torch.zeros(len(self.responses), device=self.device))
        names = labels([name for name, _, _ in self.rewards])
        texts = self.prompts, self.responses, self.fields
        try:
            for i, (label, (name, fn, weight)) in enumerate(zip(names, self.rewards, strict=True)):
                slot = "reward" if len(self.rewards) == 1 else f"reward.{i}"
                where = getattr(fn, "where", None) or f"{slot} ({name})"
                future = self.started.get(i)
                answer = reply(fn, *texts) if future is None else future.result()
                got, flags = finish(fn, where, answer, *texts)
                s = as_scores(got, len(self.responses), where).to(self.device)
                out.parts[label] = s
                out.weights[label] = weight
                out.flags.update({f"{label}/{k}": v.to(self.device) for k, v in flags.items()})
                out.total = out.total + weight * s
        finally:  # a call not yet begun is not begun (one under way ends on its own bound)
            for future in self.started.values():
                future.cancel()
        # finite scores times their weights may still overflow
        count("the rewards' weighted sum R", out.total, "responses")
        return out


def start_texts(
    rewards: list[tuple[str, Any, float]],
    prompts: list[str],
    responses: list[str],
    fields: dict[str, list[Any]],
    device: torch.device,
    threads: Threads | None = None,
) -> Pending:
    """The scoring of :func:`score_texts` begun: with ``threads``, each reward that waits
    is called on them now; the rest when the result is asked for."""
    started: dict[int, Started] = {}
    if threads is not None:
        for i, (_, fn, _) in enumerate(rewards):
            if waits(fn):
                started[i] = threads.start(reply, fn, prompts, responses, fields)
    return Pending(rewards, prompts, responses, fields, device, started)


class Scorer:
    """The spec's rewards (``assembly.rewards``) over texts decoded by ``tokenizer``."""

    def __init__(
        self, assembly: Assembly, tokenizer: PreTrainedTokenizerBase, device: torch.device
    ) -> None:
        self.assembly = assembly
        self.tokenizer = tokenizer
        self.device = device
        self._threads: Threads | None = None

    @property
    def waits(self) -> bool:
        """Whether any reward waits on something outside the trainer's threads (see the
        module's docstring): what scoring can overlap."""
        return any(waits(fn) for _, fn, _ in self.assembly.rewards)

    def threads(self) -> Threads:
        """The scoring threads: one for each reward that waits, made at the first use."""
        if self._threads is None:
            size = sum(waits(fn) for _, fn, _ in self.assembly.rewards)
            self._threads = Threads(size, "ppokit-score")
        return self._threads

    def close(self) -> None:
        """End the scoring threads (a call under way ends on its own bound)."""
        if self._threads is not None:
            self._threads.close()
            self._threads = None

    def decode(self, ro: Rollout) -> tuple[list[str], list[int], list[bool], list[str]]:
        """Response texts (the model's own tokens: with an environment its turns, without
        the environment's text), lengths (the model's tokens), truncation flags and
        transcripts (with an environment the whole episode; else the responses), in one
        host read."""
        multi = ro.env_mask is not None
        texts, lengths, truncated, transcripts = decode_rows(
            self.tokenizer,
            ro.response_ids,
            ro.response_mask,
            ro.response_mask,
            ro.truncated,
            also=ro.present if multi else None,
        )
        return texts, lengths, truncated, transcripts if transcripts is not None else texts

    def score(
        self,
        rows: list[dict[str, Any]],
        responses: list[str],
        lengths: list[int],
        truncated: list[bool],
        transcripts: list[str] | None = None,
    ) -> Scores:
        """R = Σ_k weight_k · reward_k, float32 [B], with each reward's scores and flags,
        for one response per data row (each reward counts its own scores into the round's
        non-finite counter; R is counted here). A data column named as one of
        RESERVED_FIELDS is a UserError."""
        return self.start(rows, responses, lengths, truncated, transcripts).result()

    def start(
        self,
        rows: list[dict[str, Any]],
        responses: list[str],
        lengths: list[int],
        truncated: list[bool],
        transcripts: list[str] | None = None,
        overlap: bool = False,
    ) -> Pending:
        """:meth:`score` begun: with ``overlap``, the rewards that wait are called on the
        scoring threads now (:func:`start_texts`)."""
        columns = sorted({k for row in rows for k in row if k != "prompt"})
        clash = [c for c in columns if c in RESERVED_FIELDS]
        if clash:
            names = self.assembly.rewards
            raise UserError(
                f"data column {clash[0]!r} has the name of a field ppokit passes to every reward "
                f"({', '.join(RESERVED_FIELDS)}), so reward {names[0][0]!r} could not tell "
                "them apart: rename the column (data.columns maps a column to another name)"
            )
        fields: dict[str, list[Any]] = {c: [row.get(c) for row in rows] for c in columns}
        fields.update(
            lengths=lengths,
            truncated=truncated,
            transcripts=responses if transcripts is None else transcripts,
        )
        prompts = [row["prompt"] for row in rows]
        threads = self.threads() if overlap and self.waits else None
        rewards = self.assembly.rewards
        return start_texts(rewards, prompts, responses, fields, self.device, threads)

    def rollout(self, rows: list[dict[str, Any]], ro: Rollout) -> tuple[Scores, list[str]]:
        """The scores and the transcripts of a rollout of ``B // len(rows)`` responses per
        data row. A multi-turn rollout's R adds the episode's turn rewards (its part
        ``environment``, weight 1)."""
        expanded, (texts, lengths, truncated, transcripts) = self._decoded(rows, ro)
        scores = self.score(expanded, texts, lengths, truncated, transcripts)
        return self.rollout_scores(ro, scores), transcripts

    def start_rollout(
        self, rows: list[dict[str, Any]], ro: Rollout, overlap: bool = False
    ) -> tuple[Pending, list[str]]:
        """:meth:`rollout` begun (the responses decoded, :meth:`start`); finish it with
        :meth:`rollout_scores`."""
        expanded, (texts, lengths, truncated, transcripts) = self._decoded(rows, ro)
        pending = self.start(expanded, texts, lengths, truncated, transcripts, overlap)
        return pending, transcripts

    def _decoded(
        self, rows: list[dict[str, Any]], ro: Rollout
    ) -> tuple[list[dict[str, Any]], tuple[list[str], list[int], list[bool], list[str]]]:
        """Each data row once per response of it, and the rollout decoded."""
        n = ro.response_ids.shape[0] // max(1, len(rows))
        return [row for row in rows for _ in range(n)], self.decode(ro)

    @staticmethod
    def rollout_scores(ro: Rollout, scores: Scores) -> Scores:
        """A rollout's scores with a multi-turn episode's turn rewards added to R (its part
        ``environment``, weight 1)."""
        if ro.turn_rewards is not None:
            scores.parts[ENVIRONMENT] = ro.turn_rewards.sum(1)
            scores.weights[ENVIRONMENT] = 1.0
            scores.total = scores.total + scores.parts[ENVIRONMENT]
        return scores
