"""RolloutBatch: the tensors every component reads.

B responses, T = padded response length. See docs/design.md for the conventions every
component keeps (masked positions give 0 and are carried through; the value after a row's
last token is 0 unless the truncation rule bootstraps it).

All derived quantities (sequence scores, lengths, last-token index, group statistics) are
computed here once, vectorised and without host synchronisation, so that components never
re-derive them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
from torch import Tensor

from ppokit.slots import FIELDS as OPTIONAL_FIELDS

__all__ = ["BatchError", "RolloutBatch", "take_rows"]

#: Optional [B, T] fields with their expected dtype family.
TOKEN_FIELDS = {f.name: f.dtype for f in OPTIONAL_FIELDS if f.shape == "BT"}
#: Optional [B] fields with their expected dtype family.
ROW_FIELDS = {f.name: f.dtype for f in OPTIONAL_FIELDS if f.shape == "B"}
#: Optional [B, K] fields (one column per reward part) with their expected dtype family.
PART_FIELDS = {f.name: f.dtype for f in OPTIONAL_FIELDS if f.shape == "BK"}
#: Every field of a batch.
FIELDS = ("response_mask", "token_rewards", *(f.name for f in OPTIONAL_FIELDS))


def take_rows(
    x: Tensor | None, index: Tensor | slice, width: int | None = None, name: str = ""
) -> Tensor | None:
    """The rows ``index`` of ``x`` (None stays None); ``width``: a tensor of positions
    (``[B, T, ...]``, not a ``[B, K]`` field ``name`` of :data:`PART_FIELDS`) cut to its
    first ``width``. The one way a round's rows are taken: the batch's fields, the update's
    estimates, each process's own rows."""
    if x is None:
        return None
    x = x[index]
    if width is not None and x.dim() >= 2 and name not in PART_FIELDS:
        return x[:, :width]
    return x


class BatchError(ValueError):
    """A RolloutBatch was built with tensors of the wrong shape, dtype or device."""


def _kind(t: Tensor) -> str:
    if t.dtype == torch.bool:
        return "bool"
    if t.is_floating_point():
        return "float"
    if not t.is_complex():
        return "integer"
    return "complex"


@dataclass(frozen=True, eq=False)
class RolloutBatch:
    """A batch of B sampled responses, padded to T response positions.

    Fields (shape, dtype):
        response_mask [B,T] bool: True on generated tokens that count (EOS included).
        token_rewards [B,T] float: r_t; an outcome reward sits on the row's last True position.
        values [B,T] float | None: V_old(s_t), the critic's value of the state before token t.
        logp_old [B,T] float | None: log pi_old(a_t|s_t), the trainer's policy at the
            weights that sampled (the denominator of the PPO ratio).
        logp_rollout [B,T] float | None: log mu(a_t|s_t), what the rollout engine recorded
            under the distribution it sampled from (equal to logp_old for the hf engine).
        logp_ref [B,T] float | None: reference-policy log-probs, for KL.
        group_ids [B] long | None: responses to the same prompt share an id.
        truncated [B] bool | None: the response hit the length limit without EOS.
        bootstrap_values [B] float | None: V_old of the state after a truncated row's last token.
        baseline_rewards [B] float | None: score of a baseline response (ReMax).
        env_mask [B,T] bool | None: the environment's tokens inside a multi-turn response
            (observations between the model's turns: never in response_mask).
        reward_parts [B,K] float | None: each reward's own score r_k, one column per reward
            of the spec in its order (an environment's turn rewards last).
        reward_weights [B,K] float | None: each column's weight w_k in R = Σ_k w_k r_k.
        weight_version [B] long | None: the version of the weights that generated the row
            (the number of updates before them; docs/async.md).
    """

    response_mask: Tensor
    token_rewards: Tensor
    values: Tensor | None = None
    logp_old: Tensor | None = None
    logp_rollout: Tensor | None = None
    logp_ref: Tensor | None = None
    group_ids: Tensor | None = None
    truncated: Tensor | None = None
    bootstrap_values: Tensor | None = None
    baseline_rewards: Tensor | None = None
    env_mask: Tensor | None = None
    reward_parts: Tensor | None = None
    reward_weights: Tensor | None = None
    weight_version: Tensor | None = None

    def __post_init__(self) -> None:
        mask = self.response_mask
        if not isinstance(mask, Tensor) or mask.dim() != 2:
            raise BatchError(f"response_mask must be a [B, T] tensor, got {_describe(mask)}")
        if mask.dtype != torch.bool:
            raise BatchError(f"response_mask must be bool, got {mask.dtype}")
        shape = tuple(mask.shape)
        device = mask.device
        self._check("token_rewards", self.token_rewards, shape, "float", device)
        for name, kind in TOKEN_FIELDS.items():
            value = getattr(self, name)
            if value is not None:
                self._check(name, value, shape, kind, device)
        for name, kind in ROW_FIELDS.items():
            value = getattr(self, name)
            if value is not None:
                self._check(name, value, shape[:1], kind, device)
        width: int | None = None  # K: the same in every [B, K] field
        for name, kind in PART_FIELDS.items():
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, Tensor) and value.dim() == 2 and value.shape[1] >= 1:
                width = int(value.shape[1]) if width is None else width
                self._check(name, value, (shape[0], width), kind, device)
            else:
                got = _describe(value)
                raise BatchError(f"{name} must be a [B, K] tensor with K >= 1, got {got}")

    @staticmethod
    def _check(
        name: str, t: object, shape: tuple[int, ...], kind: str, device: torch.device
    ) -> None:
        if not isinstance(t, Tensor):
            raise BatchError(f"{name} must be a tensor, got {type(t).__name__}")
        if tuple(t.shape) != shape:
            dims = "[B]" if len(shape) == 1 else "[B, T]" if name not in PART_FIELDS else "[B, K]"
            raise BatchError(f"{name} must have shape {dims} = {list(shape)}, got {list(t.shape)}")
        if _kind(t) != kind:
            raise BatchError(f"{name} must be a {kind} tensor, got {t.dtype}")
        if t.device != device:
            raise BatchError(f"{name} is on {t.device} but response_mask is on {device}")

    # ------------------------------------------------------------------ basics
    @property
    def batch_size(self) -> int:
        return self.response_mask.shape[0]

    @property
    def seq_len(self) -> int:
        return self.response_mask.shape[1]

    @property
    def device(self) -> torch.device:
        return self.response_mask.device

    def replace(self, **changes: Tensor | None) -> RolloutBatch:
        """A new batch with some fields replaced (validated again)."""
        return self._with(changes)

    def to(self, device: torch.device | str) -> RolloutBatch:
        return self._with(
            {f: (None if getattr(self, f) is None else getattr(self, f).to(device)) for f in FIELDS}
        )

    def rows(self, index: Tensor | slice, width: int | None = None) -> RolloutBatch:
        """The sub-batch of the given rows (every present field indexed along B); ``width``:
        its ``[B, T]`` fields cut to their first ``width`` positions (``[B, K]`` ones whole)."""
        return self._with({f: take_rows(getattr(self, f), index, width, f) for f in FIELDS})

    def _with(self, changes: Mapping[str, Tensor | None]) -> RolloutBatch:
        """``dataclasses.replace`` with fields named at run time: a None for a required field
        is no type error here but __post_init__'s BatchError."""
        fields: dict[str, Any] = dict(changes)
        return dataclasses.replace(self, **fields)

    def has(self, field: str) -> bool:
        return getattr(self, field, None) is not None

    # ------------------------------------------------------------------ derived
    @cached_property
    def maskf(self) -> Tensor:
        """response_mask as float32 [B, T]."""
        return self.response_mask.to(torch.float32)

    @cached_property
    def scores(self) -> Tensor:
        """R_i = sum_t r_{i,t} over the mask, float32 [B] (masked entries never matter)."""
        zero = torch.zeros((), dtype=torch.float32, device=self.device)
        return torch.where(self.response_mask, self.token_rewards.float(), zero).sum(dim=1)

    @cached_property
    def lengths(self) -> Tensor:
        """Number of True positions per row, long [B]."""
        return torch.count_nonzero(self.response_mask, dim=1)

    @cached_property
    def nonempty(self) -> Tensor:
        """bool [B]: rows with at least one True position (an empty row is no response)."""
        return self.lengths > 0

    @cached_property
    def last_index(self) -> Tensor:
        """Index of each row's last True position, long [B] (0 for an empty row)."""
        positions = torch.arange(1, self.seq_len + 1, device=self.device)
        return (self.response_mask * positions).argmax(dim=1)

    @cached_property
    def last_mask(self) -> Tensor:
        """bool [B, T]: True only on each row's last True position."""
        onehot = torch.zeros_like(self.response_mask)
        onehot.scatter_(1, self.last_index[:, None], True)
        return onehot & self.response_mask

    @cached_property
    def terminal_values(self) -> Tensor:
        """Value of the state after each row's last token, float32 [B].

        ``bootstrap_values`` on truncated rows when both fields are present, else 0.
        """
        if self.bootstrap_values is None:
            return torch.zeros(self.batch_size, device=self.device)
        boot = self.bootstrap_values.float()
        if self.truncated is None:
            return boot
        return torch.where(self.truncated, boot, torch.zeros_like(boot))

    # ------------------------------------------------------------------ groups
    @cached_property
    def group_index(self) -> Tensor:
        """Dense group index in [0, B), long [B]; every row is its own group without group_ids.

        Computed by sort and cumulative sum: no host synchronisation, no loop over groups.
        """
        if self.group_ids is None:
            return torch.arange(self.batch_size, device=self.device)
        ids = self.group_ids.long()
        sorted_ids, order = torch.sort(ids, stable=True)
        starts = torch.ones_like(sorted_ids, dtype=torch.long)
        starts[1:] = (sorted_ids[1:] != sorted_ids[:-1]).long()
        dense_sorted = torch.cumsum(starts, 0) - 1
        dense = torch.empty_like(dense_sorted)
        dense[order] = dense_sorted
        return dense

    def group_sum(self, x: Tensor) -> Tensor:
        """Per-row sum of ``x`` [B] over the row's group, float32 [B]."""
        x = x.float()
        sums = torch.zeros(self.batch_size, device=x.device).index_add_(0, self.group_index, x)
        return sums[self.group_index]

    def group_max(self, x: Tensor) -> Tensor:
        """Per-row maximum of ``x`` [B] over the row's group, float32 [B]."""
        return self._group_reduce(x, "amax")

    def group_min(self, x: Tensor) -> Tensor:
        """Per-row minimum of ``x`` [B] over the row's group, float32 [B]."""
        return self._group_reduce(x, "amin")

    def _group_reduce(self, x: Tensor, reduce: str) -> Tensor:
        x = x.float()
        out = torch.zeros_like(x).scatter_reduce(
            0, self.group_index, x, reduce=reduce, include_self=False
        )
        return out[self.group_index]

    @cached_property
    def group_sizes(self) -> Tensor:
        """Number of responses (non-empty rows) in each row's group, float32 [B]."""
        return self.group_sum(self.nonempty.to(torch.float32))

    def group_mean(self, x: Tensor, weights: Tensor | None = None) -> Tensor:
        """Per-row (weighted) mean of ``x`` [B] over the non-empty rows of the row's group,
        float32 [B].

        ``weights`` [B] default to 1; empty rows always weigh 0. A group whose weights sum
        to 0 has mean 0.
        """
        live = self.nonempty.to(torch.float32)
        weights = live if weights is None else weights.float() * live
        total = self.group_sum(weights)
        num = self.group_sum(torch.where(weights != 0, x.float() * weights, 0.0))
        return torch.where(total > 0, num / total.clamp_min(1e-30), torch.zeros_like(num))


def _describe(t: object) -> str:
    if isinstance(t, Tensor):
        return f"a tensor of shape {list(t.shape)}"
    return type(t).__name__
