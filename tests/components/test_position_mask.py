"""Position masks: hand-computed cases and properties over generated batches."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

from ppokit.batch import RolloutBatch
from ppokit.components.position_mask.impl import CompletedMask, LastTokenMask, ResponseMask
from ppokit.registry import build_registry
from tests.helpers.components import make_any, names
from tests.helpers.strategies import batches

SETTINGS = settings(max_examples=60, deadline=None)
#: Per component of a generic test: every registered component runs.
EACH = settings(max_examples=30, deadline=None)
#: Every registered position mask (installed plugins included): the generic contract tests.
NAMES = names("position_mask")


def _batch() -> RolloutBatch:
    mask = torch.tensor(
        [[True, True, False, False], [True, False, True, False], [False, False, False, False]]
    )
    return RolloutBatch(
        response_mask=mask,
        token_rewards=torch.zeros(3, 4),
        truncated=torch.tensor([False, True, False]),
    )


def test_hand_computed():
    batch = _batch()
    torch.testing.assert_close(
        ResponseMask()(batch),
        torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]]),
    )
    torch.testing.assert_close(
        CompletedMask()(batch),
        torch.tensor([[1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]),
    )
    torch.testing.assert_close(
        LastTokenMask()(batch),
        torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]]),
    )


def test_completed_needs_truncated():
    batch = _batch().replace(truncated=None)
    with pytest.raises(ValueError, match="truncated"):
        CompletedMask()(batch)


@pytest.mark.parametrize("name", NAMES)
@EACH
@given(batches())
def test_every_mask_is_binary_float32_and_inside_the_response(name, batch):
    m = make_any("position_mask", name)(batch)
    assert m.dtype == torch.float32
    assert m.shape == batch.response_mask.shape
    assert ((m == 0) | (m == 1)).all()
    assert (m[~batch.response_mask] == 0).all()


@SETTINGS
@given(batches())
def test_masks_are_binary_float32_and_inside_the_response(batch):
    response = ResponseMask()(batch)
    completed = CompletedMask()(batch)
    last = LastTokenMask()(batch)
    for m in (response, completed, last):
        assert m.dtype == torch.float32
        assert m.shape == batch.response_mask.shape
        assert ((m == 0) | (m == 1)).all()
        assert (m[~batch.response_mask] == 0).all()
    assert torch.equal(response, batch.response_mask.float())
    # completed: the whole row for EOS-ended rows, nothing for truncated ones
    assert torch.equal(completed[~batch.truncated], response[~batch.truncated])
    assert (completed[batch.truncated] == 0).all()
    # last token: exactly one position per non-empty row, at the row's last True position
    torch.testing.assert_close(last.sum(1), (batch.lengths > 0).float())
    positions = torch.arange(batch.seq_len).expand_as(last)
    later = positions > batch.last_index[:, None]
    assert not (batch.response_mask & later).any()
    assert torch.equal(last.bool(), batch.last_mask)


@pytest.mark.parametrize("name", NAMES)
@EACH
@given(batches())
def test_masks_do_not_depend_on_rewards_or_values(name, batch):
    other = batch.replace(
        token_rewards=torch.randn_like(batch.token_rewards.float()),
        values=torch.randn_like(batch.values.float()),
    )
    m = make_any("position_mask", name)
    assert torch.equal(m(batch), m(other))


def test_registry_builds_masks():
    registry = build_registry()
    assert isinstance(registry.create("position_mask", "response"), ResponseMask)
    assert registry.info("position_mask", "completed").requires == ("truncated",)
    assert registry.info("position_mask", "last_token").requires == ()
