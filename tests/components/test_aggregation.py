"""Aggregations: hand-computed cases, exact micro-batch accumulation, masking."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ppokit.components.aggregation.impl import (
    RatioAggregation,
    SeqMeanTokenMean,
    SeqMeanTokenSum,
    SeqMeanTokenSumNorm,
    TokenMean,
)
from ppokit.registry import RegistryError, build_registry
from tests.helpers.components import builtin_names, make, make_any, names
from tests.helpers.strategies import token_tensors

SETTINGS = settings(max_examples=80, deadline=None)
#: Per component of a generic test: every registered component runs.
EACH = settings(max_examples=30, deadline=None)

#: Every registered aggregation (installed plugins included) with its default parameters,
#: plus a non-default variant.
AGGREGATIONS = {name: {} for name in names("aggregation")} | {
    "seq_mean_token_sum_norm(norm=7.5)": {"norm": 7.5}
}
#: The built-ins share the numerator / denominator form (exact micro-batch accumulation).
RATIOS = {name: {} for name in builtin_names("aggregation")} | {
    "seq_mean_token_sum_norm(norm=7.5)": {"norm": 7.5}
}


def aggregation(key: str):
    """The aggregation of an AGGREGATIONS / RATIOS key, built by the registry."""
    return make_any("aggregation", key.split("(")[0], **AGGREGATIONS[key])


def test_every_builtin_is_a_ratio_aggregation():
    for name in builtin_names("aggregation"):
        assert isinstance(make_any("aggregation", name), RatioAggregation)


L = torch.tensor([[1.0, 2.0, 3.0, 100.0], [4.0, 50.0, 6.0, 7.0], [9.0, 9.0, 9.0, 9.0]])
MASK = torch.tensor(
    [[True, True, True, False], [True, False, True, True], [False, False, False, False]]
)


@pytest.mark.parametrize(
    ("agg", "expected"),
    [
        (TokenMean(), (1 + 2 + 3 + 4 + 6 + 7) / 6),
        (SeqMeanTokenMean(rows="nonempty"), (6 / 3 + 17 / 3) / 2),
        (SeqMeanTokenSum(rows="nonempty"), (6 + 17) / 2),
        (SeqMeanTokenSumNorm(norm=None, rows="nonempty"), (6 + 17) / 2 / 4),
        (SeqMeanTokenSumNorm(norm=10.0, rows="nonempty"), (6 + 17) / 2 / 10),
        (make("aggregation", "seq_mean_token_sum_norm"), (6 + 17) / 2 / 4),
    ],
)
def test_hand_computed(agg, expected):
    """Two non-empty rows (sums 6 and 17 over 3 tokens each); the empty row does not count."""
    out = agg(L, MASK)
    assert out.dtype == torch.float32
    assert out.dim() == 0
    torch.testing.assert_close(out, torch.tensor(expected))
    torch.testing.assert_close(out, agg.numerator(L, MASK) / agg.denominator(MASK))


def test_explicit_denominator():
    agg = TokenMean()
    torch.testing.assert_close(agg(L, MASK, denom=torch.tensor(2.0)), torch.tensor(23 / 2))
    torch.testing.assert_close(agg(L, MASK, denom=4.0), torch.tensor(23 / 4))


@pytest.mark.parametrize("key", AGGREGATIONS)
@EACH
@given(token_tensors(n=1))
def test_masked_values_never_matter(key, case):
    values, mask = case
    agg = aggregation(key)
    pool = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30])
    garbage = pool[torch.arange(values.numel()) % 4].reshape(values.shape)
    clean = agg(values, mask)
    assert torch.isfinite(clean)
    assert torch.equal(agg(torch.where(mask, values, garbage), mask), clean)
    torch.testing.assert_close(agg(values, mask.float()), clean)
    # gradient: 0 at masked positions
    x = values.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(agg(x, mask), x)
    assert (grad[~mask] == 0).all()


@pytest.mark.parametrize("key", AGGREGATIONS)
@EACH
@given(st.integers(1, 5), st.integers(1, 6))
def test_all_masked_gives_zero(key, b, t):
    agg = aggregation(key)
    mask = torch.zeros(b, t, dtype=torch.bool)
    values = torch.full((b, t), float("nan"))
    out = agg(values, mask)
    assert torch.equal(out, torch.tensor(0.0))
    if key in RATIOS:
        assert torch.equal(agg(values, mask, denom=agg.denominator(mask)), torch.tensor(0.0))


@pytest.mark.parametrize("key", RATIOS)
@EACH
@given(st.data())
def test_micro_batches_sum_to_the_whole(key, data):
    """sum over any row split of agg(L_part, mask_part, denom=denominator(full)) == agg(L, mask)."""
    values, mask = data.draw(token_tensors(n=1))
    agg = aggregation(key)
    b = values.shape[0]
    cuts = sorted(set(data.draw(st.lists(st.integers(1, max(b - 1, 1)), max_size=4))))
    bounds = [0, *[c for c in cuts if c < b], b]
    denom = agg.denominator(mask)
    total = sum(
        agg(values[lo:hi], mask[lo:hi], denom=denom) for lo, hi in itertools.pairwise(bounds)
    )
    torch.testing.assert_close(total, agg(values, mask), rtol=1e-5, atol=1e-6)
    # and the gradients add up the same way
    x = values.clone().requires_grad_(True)
    (g_whole,) = torch.autograd.grad(agg(x, mask), x)
    parts = [
        torch.autograd.grad(agg(x[lo:hi], mask[lo:hi], denom=denom), x)[0]
        for lo, hi in itertools.pairwise(bounds)
    ]
    torch.testing.assert_close(sum(parts), g_whole, rtol=1e-5, atol=1e-7)


@SETTINGS
@given(st.integers(0, 2**31 - 1), st.integers(1, 6), st.integers(1, 8))
def test_equal_lengths_make_token_mean_equal_seq_mean_token_mean(seed, b, t):
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, t + 1, (1,), generator=g))
    # every row has exactly n unmasked positions, anywhere in the row
    order = torch.rand(b, t, generator=g).argsort(dim=1)
    mask = order < n
    values = torch.randn(b, t, generator=g)
    torch.testing.assert_close(
        TokenMean()(values, mask), SeqMeanTokenMean(rows="nonempty")(values, mask)
    )


def test_unequal_lengths_separate_token_mean_from_seq_mean_token_mean():
    mask = torch.tensor([[True, False], [True, True]])
    values = torch.tensor([[1.0, 0.0], [3.0, 5.0]])
    torch.testing.assert_close(TokenMean()(values, mask), torch.tensor(3.0))
    torch.testing.assert_close(SeqMeanTokenMean(rows="nonempty")(values, mask), torch.tensor(2.5))


@SETTINGS
@given(token_tensors(n=1))
def test_norm_variant_is_seq_mean_token_sum_over_t(case):
    values, mask = case
    t = values.shape[1]
    torch.testing.assert_close(
        SeqMeanTokenSumNorm(norm=None, rows="nonempty")(values, mask),
        SeqMeanTokenSum(rows="nonempty")(values, mask) / t,
    )
    # the padded length comes from the whole minibatch's mask, even for a narrower part
    agg = make("aggregation", "seq_mean_token_sum_norm")
    torch.testing.assert_close(
        agg(values[:, : max(t - 1, 1)], mask[:, : max(t - 1, 1)], denom=agg.denominator(mask)),
        agg.numerator(values[:, : max(t - 1, 1)], mask[:, : max(t - 1, 1)]) / agg.denominator(mask),
    )


@SETTINGS
@given(token_tensors(n=1))
def test_token_mean_gradient_is_mask_over_count(case):
    values, mask = case
    x = values.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(TokenMean()(x, mask), x)
    torch.testing.assert_close(grad, mask.float() / mask.sum().clamp_min(1))


@pytest.mark.parametrize("key", AGGREGATIONS)
def test_bfloat16_values_give_float32(key):
    agg = aggregation(key)
    values = torch.randn(4, 6, generator=torch.Generator().manual_seed(len(key))).to(torch.bfloat16)
    mask = torch.ones(4, 6, dtype=torch.bool)
    out = agg(values, mask)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, agg(values.float(), mask))


def test_registry_builds_aggregations():
    registry = build_registry()
    assert isinstance(registry.create("aggregation", "token_mean"), TokenMean)
    norm = registry.create("aggregation", "seq_mean_token_sum_norm", norm=2.0)
    assert norm.norm == 2.0
    with pytest.raises(RegistryError, match="norm"):
        registry.create("aggregation", "seq_mean_token_sum_norm", norm=0.0)
    assert "2503.20783" in registry.info("aggregation", "seq_mean_token_sum_norm").source
