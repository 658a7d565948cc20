"""Tests of the lite_ppo advantage: identities over generated batches, a hand-computed case,
and its registration through the plugin hook."""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st
from ppokit_example import plugin
from ppokit_example.advantage import LitePPOAdvantage
from ppokit_example.plugin import LitePPOParams

from ppokit.batch import RolloutBatch
from ppokit.registry import Registry, RegistryError


def lite_ppo(**params: float) -> LitePPOAdvantage:
    """The estimator with its params model's defaults filled in."""
    return LitePPOAdvantage(**LitePPOParams(**params).model_dump())


@st.composite
def batches(draw: st.DrawFn, min_len: int = 0) -> RolloutBatch:
    """Ragged rows (empty ones with ``min_len=0``), rewards anywhere, groups of 1..4."""
    sizes = draw(st.lists(st.integers(1, 4), min_size=1, max_size=4))
    b = sum(sizes)
    t = draw(st.integers(1, 6))
    lengths = draw(st.lists(st.integers(min_len, t), min_size=b, max_size=b))
    mask = torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]
    values = st.floats(-3, 3, allow_nan=False, width=32)
    rewards = torch.tensor(draw(st.lists(values, min_size=b * t, max_size=b * t))).view(b, t)
    group_ids = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    return RolloutBatch(response_mask=mask, token_rewards=rewards, group_ids=group_ids)


@settings(max_examples=60, deadline=None)
@given(batches())
def test_zero_off_the_response_and_constant_along_it(batch: RolloutBatch) -> None:
    adv = lite_ppo()(batch)
    assert adv.dtype == torch.float32
    assert torch.all(adv[~batch.response_mask] == 0)
    first = adv.gather(1, batch.last_index[:, None]).expand_as(adv)
    assert torch.equal(torch.where(batch.response_mask, first, 0.0), adv)


#: A group of two nearly equal scores (0.9845 and 0.9844) in a batch of little spread.
NEAR_EQUAL = RolloutBatch(
    response_mask=torch.tensor([[True] * 5, [True] * 4 + [False]]),
    token_rewards=torch.tensor(
        [[0.0, 1.5, -1.1523, 0.7306, -0.0938], [0.0, 1.5, 0.7344, -1.25, 0.0]]
    ),
    group_ids=torch.tensor([0, 0]),
)


@settings(max_examples=60, deadline=None)
@given(batches())
@example(NEAR_EQUAL)
def test_rows_with_tokens_sum_to_zero_in_every_group(batch: RolloutBatch) -> None:
    """Σ_{i∈G} (R_i − mean_G R) = 0 over a group's rows with tokens: empty rows count in no
    group statistic, so every group sums to 0, also one with empty rows."""
    row = lite_ppo()(batch).gather(1, batch.last_index[:, None]).squeeze(1)
    row = torch.where(batch.lengths > 0, row, 0.0)
    sums = batch.group_sum(row)
    scale = batch.group_sum(row.abs()) + 1.0
    assert torch.all(sums.abs() / scale < 1e-5)


@settings(max_examples=60, deadline=None)
@given(batches(min_len=1), st.floats(-5, 5), st.floats(0.5, 4))
def test_invariant_to_affine_rewards(batch: RolloutBatch, shift: float, scale: float) -> None:
    """Adding c to every outcome and scaling by k > 0 leaves A unchanged (up to ε)."""
    last = batch.last_mask.float()
    outcome = batch.replace(token_rewards=batch.token_rewards * last)
    moved = outcome.replace(token_rewards=(outcome.token_rewards * scale + shift) * last)
    assume(outcome.scores.numel() > 1 and outcome.scores.std() > 1e-3)
    est = lite_ppo(eps=1e-12)
    torch.testing.assert_close(est(outcome), est(moved), atol=1e-3, rtol=1e-3)


def test_hand_computed() -> None:
    # two groups of two, one token each: R = [1, 3 | 0, 4]
    mask = torch.ones(4, 1, dtype=torch.bool)
    rewards = torch.tensor([[1.0], [3.0], [0.0], [4.0]])
    batch = RolloutBatch(
        response_mask=mask, token_rewards=rewards, group_ids=torch.tensor([0, 0, 1, 1])
    )
    std = torch.tensor([1.0, 3.0, 0.0, 4.0]).std()  # unbiased, sqrt(35/12)
    expected = torch.tensor([[-1.0], [1.0], [-2.0], [2.0]]) / (std + 1e-6)
    torch.testing.assert_close(lite_ppo()(batch), expected)


def test_bfloat16_inputs_give_float32() -> None:
    mask = torch.tensor([[True, True], [True, False]])
    rewards = torch.tensor([[0.0, 1.0], [2.0, 9.0]], dtype=torch.bfloat16)
    batch = RolloutBatch(response_mask=mask, token_rewards=rewards, group_ids=torch.tensor([5, 5]))
    adv = lite_ppo()(batch)
    assert adv.dtype == torch.float32
    assert adv[1, 1] == 0 and adv[0, 0] == adv[0, 1] == -adv[1, 0]


def test_registered_through_the_hook() -> None:
    registry = Registry()
    record = registry.load_plugin("example", plugin)
    assert record.ok, record.error
    info = registry.info("advantage", "lite_ppo")
    assert info.requires == ("group_ids",)
    assert "arXiv:2508.08221" in info.source
    assert isinstance(registry.create("advantage", "lite_ppo", eps=1e-3), LitePPOAdvantage)
    with pytest.raises(RegistryError, match="eps"):
        registry.create("advantage", "lite_ppo", eps=-1.0)
