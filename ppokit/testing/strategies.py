"""Hypothesis strategies for the inputs of components: RolloutBatches (ragged lengths,
padding, masked gaps inside rows, groups of 1..8, truncated rows, float32 and bfloat16
tensors), ``[B, T]`` tensors with a mask, and generated groups for group filters.

Public, for a plugin's own tests; the conformance properties (:mod:`ppokit.testing`) draw
their inputs from here. Imports torch, numpy and hypothesis.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from hypothesis import strategies as st

from ppokit.batch import RolloutBatch
from ppokit.components.group_filter import Groups

__all__ = ["BatchCase", "batches", "group_sets", "token_tensors"]


@dataclass
class BatchCase:
    """A generated batch plus the raw pieces it was built from."""

    batch: RolloutBatch
    seed: int


def _rng_tensor(
    rng: np.random.Generator, shape: tuple[int, ...], scale: float = 1.0
) -> torch.Tensor:
    return torch.from_numpy(rng.standard_normal(shape).astype(np.float32) * scale)


@st.composite
def batches(
    draw: st.DrawFn,
    *,
    max_rows: int = 12,
    max_len: int = 12,
    gaps: bool = True,
    groups: bool = True,
    min_group: int = 1,
    max_group: int = 8,
    truncation: bool = True,
    outcome_only: bool = False,
    dtype: torch.dtype | None = None,
    with_values: bool = True,
    with_logp: bool = True,
    with_baseline: bool = True,
    with_parts: bool = True,
) -> RolloutBatch:
    """A RolloutBatch with ragged rows, padding, optional masked gaps and groups.

    ``outcome_only``: rewards only on each row's last True position (an outcome reward).
    ``dtype``: float dtype of the float fields (default: float32 or bfloat16, drawn).
    """
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    if groups:
        sizes = draw(
            st.lists(st.integers(min_group, max_group), min_size=1, max_size=max(1, max_rows // 2))
        )
        group_ids = np.repeat(np.arange(len(sizes)), sizes)
        perm = rng.permutation(len(group_ids))
        group_ids = group_ids[perm]
    else:
        n = draw(st.integers(1, max_rows))
        group_ids = np.arange(n)
    b = len(group_ids)
    t = draw(st.integers(1, max_len))
    pad = draw(st.integers(0, 3))
    lengths = rng.integers(0 if draw(st.booleans()) else 1, t + 1, size=b)
    mask = np.arange(t)[None, :] < lengths[:, None]
    if gaps and draw(st.booleans()):
        # masked gaps (observation tokens) strictly inside rows: keep first and last True
        holes = rng.random((b, t)) < 0.25
        first = np.zeros_like(mask)
        first[:, 0] = True
        last = np.zeros_like(mask)
        last[np.arange(b), np.maximum(lengths - 1, 0)] = True
        mask = mask & ~(holes & ~first & ~last)
    mask = np.concatenate([mask, np.zeros((b, pad), dtype=bool)], axis=1)
    tt = t + pad
    if dtype is None:
        dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    mask_t = torch.from_numpy(mask)
    if outcome_only:
        rewards = torch.zeros(b, tt)
        last_idx = (mask_t * torch.arange(1, tt + 1)).argmax(dim=1)
        outcome = _rng_tensor(rng, (b,))
        rewards[torch.arange(b), last_idx] = outcome * mask_t.any(dim=1)
        # garbage at masked positions must never matter
        rewards = torch.where(mask_t, rewards, _rng_tensor(rng, (b, tt), 5.0))
    else:
        rewards = _rng_tensor(rng, (b, tt))
    fields: dict[str, torch.Tensor | None] = {
        "response_mask": mask_t,
        "token_rewards": rewards.to(dtype),
    }
    if with_values:
        fields["values"] = _rng_tensor(rng, (b, tt)).to(dtype)
    if with_logp:
        fields["logp_old"] = (-_rng_tensor(rng, (b, tt)).abs()).to(dtype)
        fields["logp_ref"] = (-_rng_tensor(rng, (b, tt)).abs()).to(dtype)
        fields["logp_rollout"] = (-_rng_tensor(rng, (b, tt)).abs()).to(dtype)
    fields["group_ids"] = torch.from_numpy(group_ids * 7 + 3).long()  # ids need not be dense
    if truncation:
        truncated = torch.from_numpy(rng.random(b) < 0.3) & mask_t.any(dim=1)
        fields["truncated"] = truncated
        fields["bootstrap_values"] = _rng_tensor(rng, (b,)).to(dtype)
    if with_baseline:
        fields["baseline_rewards"] = _rng_tensor(rng, (b,)).to(dtype)
    if with_parts:  # K reward parts, some of them few-valued (ties inside groups)
        k = draw(st.integers(1, 3))
        parts = _rng_tensor(rng, (b, k))
        few = torch.from_numpy(rng.random(k) < 0.5)
        parts = torch.where(few, parts.round().clamp(-1, 1), parts)
        fields["reward_parts"] = parts.to(dtype)
        weights = torch.from_numpy(rng.uniform(-1.0, 2.0, k).astype(np.float32))
        fields["reward_weights"] = weights.expand(b, k).contiguous().to(dtype)
    return RolloutBatch(**fields)  # type: ignore[arg-type]


@st.composite
def token_tensors(
    draw: st.DrawFn, *, max_rows: int = 8, max_len: int = 12, n: int = 2
) -> tuple[torch.Tensor, ...]:
    """``n`` float32 [B, T] tensors plus a bool mask [B, T] (the last element)."""
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    b = draw(st.integers(1, max_rows))
    t = draw(st.integers(1, max_len))
    mask = torch.from_numpy(rng.random((b, t)) < 0.7)
    return (*(_rng_tensor(rng, (b, t)) for _ in range(n)), mask)


@st.composite
def group_sets(draw: st.DrawFn, *, max_groups: int = 10, max_size: int = 8) -> Groups:
    """G groups of n responses, as a group filter sees them: some constant (any magnitude),
    some with a spread, rewards in {0, 1} or real-valued, random truncation flags."""
    g = draw(st.integers(1, max_groups))
    n = draw(st.integers(2, max_size))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    if draw(st.booleans()):
        rewards = torch.from_numpy(rng.integers(0, 2, (g, n)).astype(np.float32))
    else:
        scale = draw(st.sampled_from([1e-2, 1.0, 100.0]))
        rewards = _rng_tensor(rng, (g, n), scale)
    constant = torch.from_numpy(rng.random(g) < 0.4)
    level = _rng_tensor(rng, (g, 1), 10.0)
    rewards = torch.where(constant[:, None], level.expand(g, n), rewards)
    truncated = torch.from_numpy(rng.random((g, n)) < draw(st.sampled_from([0.0, 0.5, 0.95])))
    return Groups(
        rows=[{"prompt": f"p{i}"} for i in range(g)],
        responses=[f"r{i}" for i in range(g * n)],
        rewards=rewards,
        lengths=torch.from_numpy(rng.integers(1, 9, (g, n))).long(),
        truncated=truncated,
    )
