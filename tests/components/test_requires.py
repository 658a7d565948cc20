"""``requires`` (stated in the catalogue entry only) is enough: every registered component that
reads a RolloutBatch runs on a batch holding the mandatory fields plus the ones it requires."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

from ppokit.batch import RolloutBatch
from ppokit.registry import REQUIREMENTS, get_registry
from tests.helpers.components import make_any, names
from tests.helpers.strategies import batches

#: The kinds called as ``component(batch)``.
BATCH_KINDS = ("truncation", "advantage", "critic_target", "position_mask", "prompt_weight")
COMPONENTS = [(kind, name) for kind in BATCH_KINDS for name in names(kind)]


@pytest.mark.parametrize(("kind", "name"), COMPONENTS, ids=lambda v: str(v))
@settings(max_examples=20, deadline=None)
@given(full=batches())
def test_runs_on_exactly_the_required_fields(kind, name, full):
    requires = get_registry().info(kind, name).requires
    batch = full.replace(**{f: None for f in REQUIREMENTS if f not in requires})
    out = make_any(kind, name)(batch)
    if kind == "truncation":
        assert isinstance(out, RolloutBatch)
        assert out.response_mask.shape == batch.response_mask.shape
    else:
        assert out.dtype == torch.float32
        assert out.shape[0] == batch.batch_size
