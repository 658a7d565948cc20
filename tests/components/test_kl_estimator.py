"""KL estimators: unbiasedness by exact enumeration, signs, straight-through gradients."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ppokit.components.kl_estimator.impl import K1, K2, K3, AbsKL, LogRatioEstimator
from ppokit.registry import build_registry, get_registry
from tests.helpers.components import builtin_names, make, make_any, names
from tests.helpers.strategies import token_tensors

SETTINGS = settings(max_examples=80, deadline=None)
#: Per component of a generic test: every registered component runs.
EACH = settings(max_examples=30, deadline=None)
#: Every registered KL estimator (installed plugins included): the generic contract tests.
NAMES = names("kl_estimator")
#: The built-ins, which all take ``straight_through``.
BUILTINS = builtin_names("kl_estimator")


def kl(name: str, straight_through: bool = False):
    """A built-in estimator, built by the registry."""
    return make("kl_estimator", name, straight_through=straight_through)


def any_kl(name: str, straight_through: bool):
    """Any registered estimator; ``straight_through`` where it takes one."""
    takes = "straight_through" in get_registry().info("kl_estimator", name).params.model_fields
    return make_any(
        "kl_estimator", name, **({"straight_through": straight_through} if takes else {})
    )


def _categoricals(seed: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """log pi and log pi_ref over k actions with |log pi - log pi_ref| <= 2 everywhere
    (so k3's clamps are inactive)."""
    g = torch.Generator().manual_seed(seed)
    logits = 2.0 * torch.randn(k, generator=g, dtype=torch.float64)
    shift = 2.0 * torch.rand(k, generator=g, dtype=torch.float64) - 1.0
    return torch.log_softmax(logits, 0), torch.log_softmax(logits + shift, 0)


def _expectation(est, logp: torch.Tensor, logp_ref: torch.Tensor) -> torch.Tensor:
    """E_{a ~ pi}[k(a)], by exact enumeration over the k actions."""
    values = est(logp[None, :].float(), logp_ref[None, :].float())[0].double()
    return (logp.exp() * values).sum()


def _kl(logp: torch.Tensor, logp_ref: torch.Tensor) -> torch.Tensor:
    return (logp.exp() * (logp - logp_ref)).sum()


def test_hand_computed():
    """pi(a) = 1/2, pi_ref(a) = 1/4: log-ratio log 2, d = log(1/2)."""
    logp = torch.tensor([[math.log(0.5)]])
    ref = torch.tensor([[math.log(0.25)]])
    ln2 = math.log(2.0)
    torch.testing.assert_close(kl("k1")(logp, ref), torch.tensor([[ln2]]))
    torch.testing.assert_close(kl("k2")(logp, ref), torch.tensor([[0.5 * ln2**2]]))
    torch.testing.assert_close(kl("k3")(logp, ref), torch.tensor([[0.5 + ln2 - 1.0]]))
    torch.testing.assert_close(kl("abs")(ref, logp), torch.tensor([[ln2]]))
    torch.testing.assert_close(kl("k1")(ref, logp), torch.tensor([[-ln2]]))


@SETTINGS
@given(st.integers(0, 2**31 - 1), st.integers(2, 8))
def test_k1_and_k3_are_unbiased(seed, k):
    logp, logp_ref = _categoricals(seed, k)
    kl_value = _kl(logp, logp_ref)
    for est in (kl("k1"), kl("k3"), kl("k1", True), kl("k3", True)):
        torch.testing.assert_close(
            _expectation(est, logp, logp_ref), kl_value, rtol=1e-5, atol=1e-6
        )


def test_k2_is_biased_in_general():
    """pi = (1/2, 1/2), pi_ref = (9/10, 1/10): E[k2] = 0.6476..., KL = 0.5108..."""
    logp = torch.tensor([0.5, 0.5], dtype=torch.float64).log()
    logp_ref = torch.tensor([0.9, 0.1], dtype=torch.float64).log()
    kl_value = _kl(logp, logp_ref)
    e_k2 = _expectation(kl("k2"), logp, logp_ref)
    expected_k2 = 0.25 * (math.log(0.5 / 0.9) ** 2 + math.log(0.5 / 0.1) ** 2)
    torch.testing.assert_close(e_k2, torch.tensor(expected_k2, dtype=torch.float64))
    torch.testing.assert_close(
        kl_value, torch.tensor(0.5 * math.log(0.25 / 0.09), dtype=torch.float64)
    )
    assert abs(float(e_k2 - kl_value)) > 0.1
    # abs is biased as well: E|log r| >= |E log r|
    assert float(_expectation(kl("abs"), logp, logp_ref)) > float(kl_value) + 0.1


@SETTINGS
@given(
    st.lists(st.floats(-1e4, 1e4), min_size=1, max_size=16),
    st.lists(st.floats(-1e4, 1e4), min_size=1, max_size=16),
)
def test_k2_k3_and_abs_are_non_negative(a, b):
    n = min(len(a), len(b))
    logp, ref = torch.tensor([a[:n]]), torch.tensor([b[:n]])
    for name in ("k2", "k3", "abs"):
        out = kl(name)(logp, ref)
        assert (out >= 0).all()
        assert torch.isfinite(out).all()
    assert (kl("k3")(logp, ref) <= 10.0).all()


def test_k3_clamps():
    logp = torch.tensor([[0.0, 0.0, -30.0]])
    ref = torch.tensor([[-30.0, 30.0, 0.0]])
    out = kl("k3")(logp, ref)
    # d = -20 (clamped): exp(-20) + 20 - 1 ~ 19 -> 10; d = 20: ~ 4.85e8 -> 10
    torch.testing.assert_close(out, torch.tensor([[10.0, 10.0, 10.0]]))


@pytest.mark.parametrize("name", BUILTINS)
@EACH
@given(token_tensors(n=2))
def test_straight_through_keeps_values_and_takes_k2_gradient(name, case):
    logp, ref, _ = case
    plain, straight = kl(name), kl(name, straight_through=True)
    x = logp.clone().requires_grad_(True)
    out = straight(x, ref)
    assert torch.equal(out.detach(), plain(logp, ref))
    (grad,) = torch.autograd.grad(out.sum(), x)
    torch.testing.assert_close(grad, logp - ref)


@SETTINGS
@given(token_tensors(n=2))
def test_plain_gradients(case):
    """d k1 = 1, d k2 = logp - ref, d k3 = 1 - exp(ref - logp), d abs = sign(logp - ref)."""
    logp, ref, _ = case
    grads = []
    for name in ("k1", "k2", "k3", "abs"):
        x = logp.clone().requires_grad_(True)
        (g,) = torch.autograd.grad(kl(name)(x, ref).sum(), x)
        grads.append(g)
    torch.testing.assert_close(grads[0], torch.ones_like(logp))
    torch.testing.assert_close(grads[1], logp - ref)
    k3 = kl("k3")(logp, ref)
    expected = torch.where(k3 < 10, 1 - (ref - logp).exp(), torch.zeros_like(k3))
    torch.testing.assert_close(grads[2], expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grads[3], torch.sign(logp - ref))
    # straight-through really changes k3's gradient (it is not k2's in general)
    assert not torch.allclose(grads[2], grads[1]) or torch.allclose(logp, ref, atol=1e-3)


@pytest.mark.parametrize("straight", [False, True])
@pytest.mark.parametrize("name", NAMES)
@EACH
@given(token_tensors(n=2))
def test_bfloat16_gives_float32(name, straight, case):
    logp, ref, _ = case
    est = any_kl(name, straight)
    low = est(logp.to(torch.bfloat16), ref.to(torch.bfloat16))
    assert low.dtype == torch.float32
    torch.testing.assert_close(
        low, est(logp.to(torch.bfloat16).float(), ref.to(torch.bfloat16).float())
    )


@pytest.mark.parametrize("straight", [False, True])
@pytest.mark.parametrize("name", NAMES)
def test_no_gradient_reaches_the_reference(name, straight):
    ref = torch.zeros(1, 3, requires_grad=True)
    logp = torch.randn(1, 3, requires_grad=True)
    out = any_kl(name, straight)(logp, ref)
    assert out.dtype == torch.float32 and out.shape == (1, 3)
    out = out.sum()
    out.backward()
    assert ref.grad is None
    assert logp.grad is not None


@pytest.mark.parametrize(("name", "cls"), [("k1", K1), ("k2", K2), ("k3", K3), ("abs", AbsKL)])
def test_registry_builds_estimators(name, cls):
    registry = build_registry()
    est = registry.create("kl_estimator", name, straight_through=True)
    assert isinstance(est, cls) and isinstance(est, LogRatioEstimator)
    assert est.straight_through is True
    assert registry.create("kl_estimator", name).straight_through is False
    assert registry.info("kl_estimator", name).requires == ("logp_ref",)
