"""Group statistics count non-empty rows only: ``RolloutBatch.group_*`` and
``ppokit.ops.GroupStats``, hand-computed and as a property; the masking helpers of
``ppokit.ops``."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ppokit.batch import FIELDS, RolloutBatch
from ppokit.ops import LOG_RATIO_BOUND, GroupStats, bool_mask, masked
from tests.helpers.strategies import batches

SETTINGS = settings(max_examples=80, deadline=None)
SQRT2 = math.sqrt(2.0)


def _hand_batch() -> RolloutBatch:
    """Six rows, T = 3, groups 0, 0, 0, 1, 1, 2 (ids 7, 7, 7, 4, 4, 9).

    Group 0: rows 0 (2 tokens, score 1) and 1 (1 token, score 3) and the empty row 2 (9 at a
    masked position). Group 1: row 3 (1 token, score 5) and the empty row 4. Group 2: only
    the empty row 5.
    """
    mask = torch.tensor(
        [
            [True, True, False],
            [True, False, False],
            [False, False, False],
            [True, False, False],
            [False, False, False],
            [False, False, False],
        ]
    )
    rewards = torch.tensor(
        [
            [0.5, 0.5, 9.0],
            [3.0, 9.0, 9.0],
            [9.0, 9.0, 9.0],
            [5.0, 9.0, 9.0],
            [9.0, 9.0, 9.0],
            [9.0, 9.0, 9.0],
        ]
    )
    return RolloutBatch(
        response_mask=mask, token_rewards=rewards, group_ids=torch.tensor([7, 7, 7, 4, 4, 9])
    )


#: A per-row value whose entries on the empty rows (2, 4, 5) must never count.
X = torch.tensor([1.0, 3.0, 100.0, 5.0, -7.0, 1e6])


# ---------------------------------------------------------------- RolloutBatch
def test_group_sizes_count_non_empty_rows():
    batch = _hand_batch()
    assert batch.nonempty.tolist() == [True, True, False, True, False, False]
    torch.testing.assert_close(batch.group_sizes, torch.tensor([2.0, 2.0, 2.0, 1.0, 1.0, 0.0]))
    assert batch.group_sizes.dtype == torch.float32


def test_group_mean_ignores_empty_rows():
    # group 0: (1 + 3) / 2; group 1: 5 alone; group 2 has no response: 0
    out = _hand_batch().group_mean(X)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, torch.tensor([2.0, 2.0, 2.0, 5.0, 5.0, 0.0]))


def test_weighted_group_mean_ignores_empty_rows():
    # group 0: (3 * 1 + 1 * 3) / (3 + 1); the empty rows' weights (50, 4, 1) count 0
    weights = torch.tensor([3.0, 1.0, 50.0, 2.0, 4.0, 1.0])
    out = _hand_batch().group_mean(X, weights=weights)
    torch.testing.assert_close(out, torch.tensor([1.5, 1.5, 1.5, 5.0, 5.0, 0.0]))
    # a group whose weights sum to 0 has mean 0
    zero_first = torch.tensor([0.0, 0.0, 50.0, 2.0, 4.0, 1.0])
    out = _hand_batch().group_mean(X, weights=zero_first)
    torch.testing.assert_close(out, torch.tensor([0.0, 0.0, 0.0, 5.0, 5.0, 0.0]))


def test_without_group_ids_every_row_is_its_own_group():
    batch = _hand_batch().replace(group_ids=None)
    live = batch.nonempty.float()
    torch.testing.assert_close(batch.group_sizes, live)
    torch.testing.assert_close(batch.group_mean(X), X * live)
    # and GroupStats' baseline convention: a group of one has baseline 0 and std 1
    torch.testing.assert_close(GroupStats(batch, values=X).centred(), X * live)
    torch.testing.assert_close(GroupStats(batch, values=X).std(), torch.ones(6))


# ---------------------------------------------------------------- GroupStats
def test_group_stats_hand_computed():
    batch = _hand_batch()
    torch.testing.assert_close(batch.scores, torch.tensor([1.0, 3.0, 0.0, 5.0, 0.0, 0.0]))
    stats = GroupStats(batch)
    torch.testing.assert_close(stats.count, torch.tensor([2.0, 2.0, 2.0, 1.0, 1.0, 0.0]))
    # group 0: R - mean(1, 3); group 1 has one response: R itself; empty rows: 0
    centred = stats.centred()
    assert centred.dtype == torch.float32
    torch.testing.assert_close(centred, torch.tensor([-1.0, 1.0, 0.0, 5.0, 0.0, 0.0]))
    # unbiased over the non-empty rows; 1 with fewer than two
    torch.testing.assert_close(stats.std(), torch.tensor([SQRT2, SQRT2, SQRT2, 1.0, 1.0, 1.0]))


def test_group_stats_weighted_and_explicit_values():
    batch = _hand_batch()
    # length-weighted (the empty row weighs 0): group 0 mean (2 * 1 + 1 * 3) / 3 = 5/3
    weighted = GroupStats(batch, weights=batch.lengths).centred()
    torch.testing.assert_close(weighted, torch.tensor([-2 / 3, 4 / 3, 0.0, 5.0, 0.0, 0.0]))
    # other per-row values: the empty rows' entries never count
    stats = GroupStats(batch, values=X)
    torch.testing.assert_close(stats.centred(), torch.tensor([-1.0, 1.0, 0.0, 5.0, 0.0, 0.0]))
    torch.testing.assert_close(stats.std(), torch.tensor([SQRT2, SQRT2, SQRT2, 1.0, 1.0, 1.0]))


def test_group_stats_equal_values_centre_to_exactly_zero():
    batch = _hand_batch()
    values = torch.full((6,), 0.1)
    centred = GroupStats(batch, values=values).centred()
    assert centred[:3].tolist() == [0.0, 0.0, 0.0]
    assert GroupStats(batch, values=values).std()[:3].tolist() == [0.0, 0.0, 0.0]


# ---------------------------------------------------------------- property
def _with_empty_rows(batch: RolloutBatch, rows: torch.Tensor, fresh: bool) -> RolloutBatch:
    """``batch`` plus empty copies of ``rows`` (same group; a group of their own if ``fresh``)
    with garbage rewards."""
    added = batch.rows(rows)
    extra, t = len(rows), batch.seq_len
    changes = {
        "response_mask": torch.zeros(extra, t, dtype=torch.bool),
        "token_rewards": (torch.randn(extra, t) * 100).to(batch.token_rewards.dtype),
    }
    if fresh:
        changes["group_ids"] = torch.full((extra,), int(batch.group_ids.max()) + 1)
    added = added.replace(**changes)
    return RolloutBatch(
        **{
            f: torch.cat([getattr(batch, f), getattr(added, f)])
            for f in FIELDS
            if getattr(batch, f) is not None
        }
    )


@SETTINGS
@given(
    batches(dtype=torch.float32),
    st.integers(0, 100),
    st.integers(1, 4),
    st.booleans(),
    st.integers(0, 2**31 - 1),
)
def test_an_empty_row_changes_no_statistic_of_the_other_rows(batch, which, extra, fresh, seed):
    b = batch.batch_size
    rows = torch.full((extra,), which % b)
    grown = _with_empty_rows(batch, rows, fresh)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, generator=g)
    weights = torch.rand(b, generator=g) + 0.1
    garbage = torch.randn(extra, generator=g) * 1e4
    gx, gw = torch.cat([x, garbage]), torch.cat([weights, garbage.abs()])

    def same(a: torch.Tensor, c: torch.Tensor) -> None:
        torch.testing.assert_close(a[:b], c, rtol=1e-6, atol=1e-6)

    assert torch.equal(grown.group_sizes[:b], batch.group_sizes)
    same(grown.group_mean(gx), batch.group_mean(x))
    same(grown.group_mean(gx, weights=gw), batch.group_mean(x, weights=weights))
    for kwargs, grown_kwargs in [
        ({}, {}),
        ({"weights": batch.lengths}, {"weights": grown.lengths}),
        ({"values": x, "weights": weights}, {"values": gx, "weights": gw}),
    ]:
        before, after = GroupStats(batch, **kwargs), GroupStats(grown, **grown_kwargs)
        assert torch.equal(after.count[:b], before.count)
        same(after.centred(), before.centred())
        same(after.std(), before.std())
        # the empty rows themselves centre to 0
        assert torch.equal(after.centred()[b:], torch.zeros(extra))
    # they share their group's statistics
    if not fresh:
        assert torch.equal(grown.group_sizes[b:], batch.group_sizes[rows])


# ---------------------------------------------------------------- masking helpers
def test_bool_mask_and_masked():
    floats = torch.tensor([[1.0, 0.0, 0.5]])
    assert bool_mask(floats).tolist() == [[True, False, True]]
    bools = torch.tensor([[True, False, False]])
    assert bool_mask(bools) is bools
    x = torch.tensor([[float("nan"), float("inf"), 2.0]], requires_grad=True)
    out = masked(x, torch.tensor([[False, False, True]]))
    assert out.tolist() == [[0.0, 0.0, 2.0]]
    (grad,) = torch.autograd.grad(out.sum(), x)
    assert grad.tolist() == [[0.0, 0.0, 1.0]]
    # exp of the bound stays finite in float32
    assert math.isfinite(torch.tensor(LOG_RATIO_BOUND).exp().item())
