"""The chunked PyTorch scan on long rows, under autograd, in bf16 and on every thread count.

Long rows (T = 32768, with gaps) are checked against the float64 per-step reference with the
elementwise bound of ``test_scan``; every scan-based estimator and target ignores what masked
positions hold.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

from ppokit.batch import RolloutBatch
from ppokit.ops import discounted_reverse_cumsum, gae, returns_to_go
from tests.components.test_scan import assert_matches
from tests.helpers import reference
from tests.helpers.components import make_any, names
from tests.helpers.strategies import batches

#: Every registered advantage and critic target (installed plugins included) with its
#: defaults, plus scan settings the defaults do not reach.
SCANNED = [(kind, name, {}) for kind in ("advantage", "critic_target") for name in names(kind)] + [
    ("advantage", "gae", {"whiten": False, "lam": 0.0}),
    ("advantage", "gae", {"gamma": 0.9, "lam": 1.0}),
]


def _garbage(batch: RolloutBatch) -> RolloutBatch:
    """NaN at every masked position of the token fields the scans read."""
    nan = torch.tensor(float("nan"))
    fields = {
        name: torch.where(batch.response_mask, getattr(batch, name), nan.to(getattr(batch, name)))
        for name in ("token_rewards", "values")
        if batch.has(name)
    }
    return batch.replace(**fields)


@pytest.mark.parametrize(("kind", "name", "params"), SCANNED)
@settings(max_examples=40, deadline=None)
@given(batch=batches(max_rows=12, max_len=23, with_baseline=True))
def test_masked_positions_never_matter(kind, name, params, batch):
    component = make_any(kind, name, **params)
    out = component(batch)
    assert out.dtype == torch.float32
    assert bool((out[~batch.response_mask] == 0).all())
    assert torch.equal(component(_garbage(batch)), out)


def _long_rows() -> RolloutBatch:
    """3 rows of T = 32768 with gaps, the last 7 positions masked, bootstrapped rows."""
    gen = torch.Generator().manual_seed(3)
    b, t = 3, 32768
    mask = torch.rand(b, t, generator=gen) < 0.9
    mask[:, -7:] = False
    return RolloutBatch(
        response_mask=mask,
        token_rewards=torch.randn(b, t, generator=gen) * 0.1,
        values=torch.randn(b, t, generator=gen),
        truncated=torch.tensor([True, False, True]),
        bootstrap_values=torch.randn(b, generator=gen),
    )


@pytest.mark.slow
@pytest.mark.parametrize("lam", [0.0, 0.95, 1.0])
@pytest.mark.parametrize("gamma", [0.99, 1.0])
def test_long_rows_gae_and_lambda_return_are_exact(gamma, lam):
    """T = 32768 with gaps: GAE and the lambda-return V + A (the one-step target at lam = 0,
    the return at lam = 1) elementwise within 1e-5 relative or 1e-6 absolute of float64."""
    batch = _long_rows()
    expected = reference.gae(batch, gamma, lam)  # one float64 loop for both
    assert_matches(gae(batch, gamma, lam), expected)
    values = torch.where(batch.response_mask, batch.values.double(), 0.0)
    assert_matches(gae(batch, gamma, lam, plus_values=True), expected + values)


@pytest.mark.slow
@pytest.mark.parametrize("gamma", [0.99, 1.0])
def test_long_rows_returns_are_exact(gamma):
    """The bootstrapped return-to-go on the same rows, with the same bound."""
    batch = _long_rows()
    assert_matches(
        returns_to_go(batch, gamma, bootstrap=True), reference.returns(batch, gamma, True)
    )


def test_results_do_not_depend_on_the_thread_count():
    gen = torch.Generator().manual_seed(0)
    b, t = 64, 4099  # rows split between threads; T not a whole number of blocks
    batch = RolloutBatch(
        response_mask=torch.rand(b, t, generator=gen) < 0.8,
        token_rewards=torch.randn(b, t, generator=gen),
        values=torch.randn(b, t, generator=gen),
    )
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = gae(batch, 1.0, 0.95, whiten=True)
        torch.set_num_threads(4)
        four = gae(batch, 1.0, 0.95, whiten=True)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, four)


def test_bfloat16_inputs_accumulate_in_float64():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 3001, generator=gen).bfloat16()
    mask = torch.rand(4, 3001, generator=gen) < 0.8
    y = discounted_reverse_cumsum(x, mask, 1.0)
    assert y.dtype == torch.float32
    assert_matches(y, reference.reverse_scan(x.float(), mask, 1.0))


def test_a_gradient_flows_through_the_scan():
    x = torch.randn(2, 8, requires_grad=True)
    y = discounted_reverse_cumsum(x, torch.ones(2, 8, dtype=torch.bool), 0.9)
    y.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_hand_computed_gae_with_a_gap():
    # row: positions 0, 2 True (gap at 1), r = [1, 9, 2], V = [0.5, 9, 1], V_term = 3,
    # gamma 0.5, lam 0.5: delta_2 = 2 + 0.5*3 - 1 = 2.5, A_2 = 2.5;
    # delta_0 = 1 + 0.5*1 - 0.5 = 1.0, A_0 = 1.0 + 0.25 * 2.5 = 1.625
    batch = RolloutBatch(
        response_mask=torch.tensor([[True, False, True]]),
        token_rewards=torch.tensor([[1.0, 9.0, 2.0]]),
        values=torch.tensor([[0.5, 9.0, 1.0]]),
        truncated=torch.tensor([True]),
        bootstrap_values=torch.tensor([3.0]),
    )
    expected = torch.tensor([[1.625, 0.0, 2.5]])
    assert torch.allclose(gae(batch, 0.5, 0.5), expected)
    lam_return = gae(batch, 0.5, 0.5, plus_values=True)
    assert torch.allclose(lam_return, expected + torch.tensor([[0.5, 0.0, 1.0]]))
