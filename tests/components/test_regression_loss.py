"""Critic regression losses: hand cases, value-clipping gradients, Huber, base defaults."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from ppokit.components.regression_loss.impl import MSE, ClippedMSE, Huber, RegressionLoss
from ppokit.registry import RegistryError, build_registry
from tests.helpers.components import builtin_names, make, make_any, names
from tests.helpers.strategies import token_tensors

#: Every registered regression loss (installed plugins included): the generic contract tests.
NAMES = names("regression_loss")

SETTINGS = settings(max_examples=80, deadline=None)


def _grad(loss, pred, target, old):
    v = pred.clone().requires_grad_(True)
    out = loss(v, target, old)
    (g,) = torch.autograd.grad(out.sum(), v)
    return out.detach(), g


def test_mse_hand_computed():
    out, grad = _grad(MSE(), torch.tensor([[2.0, -1.0]]), torch.tensor([[0.5, 1.0]]), None)
    torch.testing.assert_close(out, torch.tensor([[1.125, 2.0]]))
    torch.testing.assert_close(grad, torch.tensor([[1.5, -2.0]]))


def test_clipped_mse_hand_computed():
    """V_old = 0.5, V = 1.0, clip 0.2: the clipped value is 0.7."""
    loss = ClippedMSE(clip=0.2)
    pred = torch.tensor([[1.0, 1.0, 0.6]])
    target = torch.tensor([[0.0, 2.0, 2.0]])
    old = torch.tensor([[0.5, 0.5, 0.5]])
    out, grad = _grad(loss, pred, target, old)
    # Y = 0: max(1.0, 0.49) -> plain branch; Y = 2: max(1.0, 1.69) -> clipped branch;
    # V = 0.6 is inside the clip range: plain
    torch.testing.assert_close(out, torch.tensor([[0.5, 0.845, 0.98]]))
    torch.testing.assert_close(grad, torch.tensor([[1.0, 0.0, -1.4]]))
    assert loss.clipped(pred, target, old).tolist() == [[False, True, False]]


def test_huber_hand_computed():
    loss = Huber(delta=1.0)
    out, grad = _grad(loss, torch.tensor([[0.5, 3.0, -2.0]]), torch.zeros(1, 3), None)
    torch.testing.assert_close(out, torch.tensor([[0.125, 2.5, 1.5]]))
    torch.testing.assert_close(grad, torch.tensor([[0.5, 1.0, -1.0]]))


@SETTINGS
@given(token_tensors(n=3), st.floats(0.01, 1.0))
def test_clipped_mse_gradient_is_zero_exactly_when_the_clipped_branch_is_further(case, clip):
    pred, target, old, _ = case
    pred = old + 0.5 * pred  # V - V_old around the clip range
    loss = ClippedMSE(clip=clip)
    out, grad = _grad(loss, pred, target, old)
    v_clip = old + (pred - old).clamp(-clip, clip)
    further = ((v_clip - target).abs() > (pred - target).abs()) & ((pred - old).abs() > clip)
    clipped = loss.clipped(pred, target, old)
    assert torch.equal(clipped, further)
    reported: dict[str, torch.Tensor] = {}  # what its call reports: the same positions
    assert torch.equal(loss(pred, target, old, metrics=reported), loss(pred, target, old))
    assert torch.equal(reported["vf_clipfrac"], clipped)
    assert torch.equal(grad == 0, clipped | (pred == target))
    torch.testing.assert_close(grad, torch.where(clipped, torch.zeros_like(grad), pred - target))
    # the clipped loss is never below the plain one, and equal inside the clip range
    plain = MSE()(pred, target)
    assert (out >= plain).all()
    inside = (pred - old).abs() <= clip
    assert torch.equal(out[inside], plain[inside])


@SETTINGS
@given(token_tensors(n=2), st.floats(0.05, 5.0))
def test_huber_is_delta_times_smooth_l1(case, delta):
    pred, target, _ = case
    pred = 3.0 * pred
    out, grad = _grad(Huber(delta=delta), pred, target, None)
    torch.testing.assert_close(
        out, delta * F.smooth_l1_loss(pred, target, reduction="none", beta=delta)
    )
    torch.testing.assert_close(out, F.huber_loss(pred, target, reduction="none", delta=delta))
    torch.testing.assert_close(grad, (pred - target).clamp(-delta, delta))


@SETTINGS
@given(token_tensors(n=2))
def test_huber_is_mse_for_small_errors(case):
    pred, target, _ = case
    pred = target + 0.1 * pred.clamp(-5, 5)
    torch.testing.assert_close(Huber(delta=1.0)(pred, target), MSE()(pred, target))


def test_base_class_defaults():
    head_out = torch.arange(24.0).reshape(2, 3, 4)
    assert {"mse", "clipped_mse", "huber"} <= set(builtin_names("regression_loss"))
    for name in builtin_names("regression_loss"):
        loss = make_any("regression_loss", name)
        assert isinstance(loss, RegressionLoss)
        assert loss.head_size == 1
        torch.testing.assert_close(loss.value(head_out), head_out[..., 0])
        torch.testing.assert_close(loss.prediction(head_out), head_out[..., 0])
    assert not hasattr(MSE(), "clipped")
    assert not hasattr(Huber(delta=1.0), "clipped")


def test_subclass_changes_the_head():
    class Mean(MSE):
        head_size = 4

        def value(self, head_out: torch.Tensor) -> torch.Tensor:
            return head_out.mean(-1)

    loss = Mean()
    head_out = torch.arange(24.0).reshape(2, 3, 4)
    torch.testing.assert_close(loss.prediction(head_out), head_out.mean(-1))
    with pytest.raises(NotImplementedError):
        RegressionLoss()(head_out[..., 0], head_out[..., 0])


def test_clipped_mse_needs_old_values():
    with pytest.raises(ValueError, match="old"):
        make("regression_loss", "clipped_mse")(torch.zeros(1, 1), torch.zeros(1, 1))


def _inputs(loss, seed: int = 0) -> list[torch.Tensor]:
    """(pred, target, old) for a [3, 4] batch: pred read from a head output of the loss's
    ``head_size`` (default 1) by its ``prediction`` (default: the value)."""
    g = torch.Generator().manual_seed(seed)
    head_out = torch.randn(3, 4, getattr(loss, "head_size", 1), generator=g)
    pred = loss.prediction(head_out) if hasattr(loss, "prediction") else head_out[..., 0]
    return [pred, torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g)]


@pytest.mark.parametrize("name", NAMES)
def test_bfloat16_gives_float32(name):
    loss = make_any("regression_loss", name)
    xs = _inputs(loss)
    out = loss(*(x.to(torch.bfloat16) for x in xs))
    assert out.dtype == torch.float32
    assert out.shape == (3, 4)
    torch.testing.assert_close(out, loss(*(x.to(torch.bfloat16).float() for x in xs)))


@pytest.mark.parametrize("name", NAMES)
def test_no_gradient_reaches_the_target_or_the_old_values(name):
    loss = make_any("regression_loss", name)
    pred, target, old = (x.requires_grad_(True) for x in _inputs(loss, seed=1))
    loss(pred, target, old).sum().backward()
    assert pred.grad is not None and torch.isfinite(pred.grad).all()
    assert target.grad is None and old.grad is None


def test_registry_builds_regression_losses():
    registry = build_registry()
    assert registry.create("regression_loss", "clipped_mse", clip=0.5).clip == 0.5
    assert registry.create("regression_loss", "huber").delta == 1.0
    assert isinstance(registry.create("regression_loss", "mse"), MSE)
    with pytest.raises(RegistryError, match="clip"):
        registry.create("regression_loss", "clipped_mse", clip=0.0)
    with pytest.raises(RegistryError, match="delta"):
        registry.create("regression_loss", "huber", delta=-1.0)
