"""Scoring responses: decoded to text (the one host read of a round's responses) and scored
by the spec's rewards, R = Σ_k weight_k · reward_k, each reward's scores kept apart beside R
(the batch's ``reward_parts``). The training round and the evaluation both score through a
:class:`Scorer`."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ppokit.components.reward import RESERVED_FIELDS
from ppokit.errors import UserError
from ppokit.trainer.assembly import Assembly, as_scores, scored
from ppokit.trainer.checks import count
from ppokit.trainer.rollout import Rollout, decode_rows

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["ENVIRONMENT", "Scorer", "Scores", "labels", "reads_parts", "score_texts"]

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
    out = Scores(torch.zeros(len(responses), device=device))
    names = labels([name for name, _, _ in rewards])
    for i, (label, (name, fn, weight)) in enumerate(zip(names, rewards, strict=True)):
        slot = "reward" if len(rewards) == 1 else f"reward.{i}"
        where = getattr(fn, "where", None) or f"{slot} ({name})"
        got, flags = scored(fn, where, prompts, responses, fields)
        s = as_scores(got, len(responses), where).to(device)
        out.parts[label] = s
        out.weights[label] = weight
        out.flags.update({f"{label}/{k}": v.to(device) for k, v in flags.items()})
        out.total = out.total + weight * s
    # finite scores times their weights may still overflow
    count("the rewards' weighted sum R", out.total, "responses")
    return out


class Scorer:
    """The spec's rewards (``assembly.rewards``) over texts decoded by ``tokenizer``."""

    def __init__(
        self, assembly: Assembly, tokenizer: PreTrainedTokenizerBase, device: torch.device
    ) -> None:
        self.assembly = assembly
        self.tokenizer = tokenizer
        self.device = device

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
        return score_texts(self.assembly.rewards, prompts, responses, fields, self.device)

    def rollout(self, rows: list[dict[str, Any]], ro: Rollout) -> tuple[Scores, list[str]]:
        """The scores and the transcripts of a rollout of ``B // len(rows)`` responses per
        data row. A multi-turn rollout's R adds the episode's turn rewards (its part
        ``environment``, weight 1)."""
        n = ro.response_ids.shape[0] // max(1, len(rows))
        expanded = [row for row in rows for _ in range(n)]
        texts, lengths, truncated, transcripts = self.decode(ro)
        scores = self.score(expanded, texts, lengths, truncated, transcripts)
        if ro.turn_rewards is not None:
            scores.parts[ENVIRONMENT] = ro.turn_rewards.sum(1)
            scores.weights[ENVIRONMENT] = 1.0
            scores.total = scores.total + scores.parts[ENVIRONMENT]
        return scores, transcripts
