"""Properties of the HL-Gauss loss and its registration through the ppokit entry point."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from ppokit_hlgauss.loss import HLGaussLoss
from ppokit_hlgauss.plugin import HLGaussParams


def hlgauss(**params: float) -> HLGaussLoss:
    """The loss with its params model's defaults filled in."""
    return HLGaussLoss(**HLGaussParams(**params).model_dump())


targets = st.lists(st.floats(-3.0, 3.0, allow_nan=False), min_size=1, max_size=16)


@settings(max_examples=100, deadline=None)
@given(targets, st.integers(2, 101), st.floats(0.1, 2.0))
def test_target_distribution_is_a_distribution(ys, bins, ratio):
    loss = hlgauss(bins=bins, vmin=-1.0, vmax=1.0, sigma_ratio=ratio)
    p = loss.target_distribution(torch.tensor(ys))
    assert p.shape == (len(ys), bins)
    assert (p >= 0).all()
    torch.testing.assert_close(p.sum(-1), torch.ones(len(ys)), atol=1e-5, rtol=0)


@settings(max_examples=100, deadline=None)
@given(st.floats(-0.6, 0.6), st.integers(21, 201))
def test_target_mean_recovers_the_value_inside_the_support(y, bins):
    """Away from the edges the histogram's expectation is Y up to a small fraction of a bin."""
    loss = hlgauss(bins=bins, vmin=-1.0, vmax=1.0, sigma_ratio=0.75)
    p = loss.target_distribution(torch.tensor([y]))
    value = loss.value(p.log())  # softmax(log p) = p
    width = 2.0 / bins
    assert abs(value.item() - y) < 0.05 * width + 1e-5


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(2, 64))
def test_gradient_is_softmax_minus_target(seed, bins):
    """d l / d h = softmax(h) - p(Y): the cross-entropy identity."""
    g = torch.Generator().manual_seed(seed)
    loss = hlgauss(bins=bins, vmin=-2.0, vmax=2.0)
    logits = torch.randn(3, 5, bins, generator=g, requires_grad=True)
    y = torch.randn(3, 5, generator=g) * 1.5
    loss(logits, y, torch.zeros_like(y)).sum().backward()
    expected = torch.softmax(logits.detach(), -1) - loss.target_distribution(y)
    torch.testing.assert_close(logits.grad, expected, atol=1e-5, rtol=1e-4)


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 2**31 - 1))
def test_loss_is_minimised_by_the_target_distribution(seed):
    """Gibbs' inequality: l(log p) <= l(h) for every h."""
    g = torch.Generator().manual_seed(seed)
    loss = hlgauss(bins=17, vmin=-1.0, vmax=1.0)
    y = torch.rand(8, generator=g) * 2 - 1
    best = loss(loss.target_distribution(y).log(), y)
    other = loss(torch.randn(8, 17, generator=g), y)
    assert (best <= other + 1e-5).all()


def test_hand_computed_two_bins():
    """K = 2 over [-1, 1]: edges -1, 0, 1; Y = 0 splits the mass evenly."""
    loss = hlgauss(bins=2, vmin=-1.0, vmax=1.0, sigma_ratio=0.75)
    p = loss.target_distribution(torch.tensor([0.0]))
    torch.testing.assert_close(p, torch.tensor([[0.5, 0.5]]))
    # equal logits: softmax (1/2, 1/2), loss = log 2, value = 0
    h = torch.zeros(1, 2)
    torch.testing.assert_close(loss(h, torch.tensor([0.0])), torch.tensor([0.6931472]))
    torch.testing.assert_close(loss.value(h), torch.tensor([0.0]))
    # logits (0, log 3): probabilities (1/4, 3/4), value = -0.5/4 + 0.5*3/4 = 0.25
    h = torch.tensor([[0.0, torch.log(torch.tensor(3.0)).item()]])
    torch.testing.assert_close(loss.value(h), torch.tensor([0.25]))


def test_targets_outside_the_support_are_clamped():
    loss = hlgauss(bins=10, vmin=0.0, vmax=1.0)
    far = loss.target_distribution(torch.tensor([5.0]))
    edge = loss.target_distribution(torch.tensor([1.0]))
    torch.testing.assert_close(far, edge)


def test_bfloat16_logits_give_float32():
    loss = hlgauss(bins=8)
    h = torch.randn(2, 3, 8).to(torch.bfloat16)
    assert loss(h, torch.zeros(2, 3)).dtype == torch.float32
    assert loss.value(h).dtype == torch.float32


def test_registered_through_the_entry_point():
    from ppokit.registry import build_registry

    registry = build_registry()
    info = registry.info("regression_loss", "hlgauss")
    assert info.plugin == "hlgauss"
    assert info.version == "0.1.0"
    comp = registry.create("regression_loss", "hlgauss", bins=11, vmin=0.0, vmax=2.0)
    assert comp.head_size == 11
    assert "Farebrother" in info.source


def test_bad_support_is_rejected():
    from ppokit.registry import RegistryError, build_registry

    with pytest.raises(RegistryError, match="vmax must be greater than vmin"):
        build_registry().create("regression_loss", "hlgauss", vmin=1.0, vmax=0.0)
