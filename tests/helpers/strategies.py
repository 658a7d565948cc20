"""Hypothesis strategies for RolloutBatch inputs: those of :mod:`ppokit.testing.strategies`,
which plugin authors use too."""

from __future__ import annotations

from ppokit.testing.strategies import BatchCase, batches, group_sets, token_tensors

__all__ = ["BatchCase", "batches", "group_sets", "token_tensors"]
