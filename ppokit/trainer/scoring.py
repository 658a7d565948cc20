"""Scoring responses: decoded to text (the one host read of a round's responses) and scored
by the spec's rewards, R = Σ_k weight_k · reward_k. The training round and the evaluation
both score through a :class:`Scorer`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ppokit.components.reward import RESERVED_FIELDS
from ppokit.errors import UserError
from ppokit.trainer.assembly import Assembly, as_scores
from ppokit.trainer.checks import count
from ppokit.trainer.rollout import Rollout, decode_rows

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["Scorer"]


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
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """R = Σ_k weight_k · reward_k, float32 [B], and each reward's scores, for one
        response per data row (each reward counts its own scores into the round's
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
        prompts = [row["prompt"] for row in rows]
        total = torch.zeros(len(responses), device=self.device)
        parts = {}
        rewards = self.assembly.rewards
        given = {
            "lengths": lengths,
            "truncated": truncated,
            "transcripts": responses if transcripts is None else transcripts,
        }
        for i, (name, fn, weight) in enumerate(rewards):
            slot = "reward" if len(rewards) == 1 else f"reward.{i}"
            where = getattr(fn, "where", None) or self.assembly.name(slot)
            out = fn(prompts, responses, **fields, **given)
            s = as_scores(out, len(responses), where).to(self.device)
            parts[name] = s
            total = total + weight * s
        # finite scores times their weights may still overflow
        count("the rewards' weighted sum R", total, "responses")
        return total, parts

    def rollout(
        self, rows: list[dict[str, Any]], ro: Rollout
    ) -> tuple[Tensor, dict[str, Tensor], list[str]]:
        """(R [B], each reward's scores, the transcripts) of a rollout of ``B // len(rows)``
        responses per data row. A multi-turn rollout's R adds the episode's turn rewards
        (its part ``environment``)."""
        n = ro.response_ids.shape[0] // max(1, len(rows))
        expanded = [row for row in rows for _ in range(n)]
        texts, lengths, truncated, transcripts = self.decode(ro)
        scores, parts = self.score(expanded, texts, lengths, truncated, transcripts)
        if ro.turn_rewards is not None:
            parts["environment"] = ro.turn_rewards.sum(1)
            scores = scores + parts["environment"]
        return scores, parts, transcripts
