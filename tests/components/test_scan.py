"""The vectorised reverse scan equals the per-step loop, gaps, per-row discounts and long T."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ppokit import ops
from ppokit.batch import RolloutBatch
from ppokit.ops import (
    Compaction,
    batch_whiten,
    dense_reverse_scan,
    discounted_reverse_cumsum,
    gae,
    next_values,
    returns_to_go,
    whiten_rows,
)
from tests.helpers import reference

DISCOUNTS = st.one_of(st.sampled_from([0.0, 1.0, 0.5, 0.99]), st.floats(0.0, 1.0))


def assert_matches(y: torch.Tensor, ref: torch.Tensor) -> None:
    """Elementwise |y - ref| <= 1e-5 |ref| + 1e-6, with y float32."""
    assert y.dtype == torch.float32
    err = (y.double() - ref).abs()
    bound = 1e-5 * ref.abs() + 1e-6
    assert bool((err <= bound).all()), f"max error {err.max():.3g}"


@st.composite
def scan_inputs(draw: st.DrawFn, max_rows: int = 6, max_len: int = 200):
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    b = draw(st.integers(1, max_rows))
    t = draw(st.integers(1, max_len))
    density = draw(st.sampled_from([1.0, 0.9, 0.5, 0.1]))
    mask = torch.from_numpy(rng.random((b, t)) < density)
    x = torch.from_numpy(rng.standard_normal((b, t)).astype(np.float32))
    return x, mask


@settings(max_examples=80, deadline=None)
@given(scan_inputs(), DISCOUNTS)
def test_scan_equals_loop_scalar_discount(inputs, d):
    x, mask = inputs
    assert_matches(discounted_reverse_cumsum(x, mask, d), reference.reverse_scan(x, mask, d))


@settings(max_examples=60, deadline=None)
@given(scan_inputs(), st.data())
def test_scan_equals_loop_per_row_discount(inputs, data):
    x, mask = inputs
    d = torch.tensor(
        data.draw(st.lists(DISCOUNTS, min_size=x.shape[0], max_size=x.shape[0])),
        dtype=torch.float32,
    )
    assert_matches(discounted_reverse_cumsum(x, mask, d), reference.reverse_scan(x, mask, d))


@settings(max_examples=50, deadline=None)
@given(scan_inputs(), DISCOUNTS)
def test_masked_entries_never_matter(inputs, d):
    x, mask = inputs
    y = discounted_reverse_cumsum(x, mask, d)
    garbage = torch.where(mask, x, torch.full_like(x, float("nan")))
    assert torch.equal(discounted_reverse_cumsum(garbage, mask, d), y)
    assert bool((y[~mask] == 0).all())
    # extra padding columns change nothing (up to float rounding: more columns can change the
    # blocking of the chunk matmuls, and so the order of a dot product's additions)
    padded_x = torch.cat([x, torch.randn(x.shape[0], 5)], dim=1)
    padded_m = torch.cat([mask, torch.zeros(x.shape[0], 5, dtype=torch.bool)], dim=1)
    padded = discounted_reverse_cumsum(padded_x, padded_m, d)
    torch.testing.assert_close(padded[:, : x.shape[1]], y, rtol=1e-6, atol=1e-6)
    assert bool((padded[:, x.shape[1] :] == 0).all())


@settings(max_examples=50, deadline=None)
@given(scan_inputs())
def test_next_values_equals_loop(inputs):
    x, mask = inputs
    terminal = torch.randn(x.shape[0])
    out = next_values(x, mask, terminal)
    assert torch.equal(out.double(), reference.next_values(x, mask, terminal))


@pytest.mark.parametrize("d", [0.999, 1.0])
def test_long_rows(d):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 32768, generator=gen)
    mask = torch.rand(3, 32768, generator=gen) < 0.9
    mask[2] = True
    assert_matches(discounted_reverse_cumsum(x, mask, d), reference.reverse_scan(x, mask, d))


def test_long_rows_underflowing_powers():
    """0.5^32768 underflows: powers are never divided by, so nothing blows up."""
    x = torch.ones(2, 32768)
    mask = torch.ones(2, 32768, dtype=torch.bool)
    y = discounted_reverse_cumsum(x, mask, torch.tensor([0.5, 0.0]))
    assert torch.isfinite(y).all()
    assert torch.allclose(y[0, :-40], torch.full((32768 - 40,), 2.0))
    assert torch.equal(y[1], torch.ones(32768))


def test_hand_computed():
    # row 0: positions 0, 2, 3 unmasked (gap at 1), d = 0.5:
    # y3 = 4, y2 = 3 + 0.5*4 = 5, y0 = 1 + 0.5*5 = 3.5 ; row 1 empty
    x = torch.tensor([[1.0, 100.0, 3.0, 4.0], [1.0, 2.0, 3.0, 4.0]])
    mask = torch.tensor([[True, False, True, True], [False] * 4])
    y = discounted_reverse_cumsum(x, mask, 0.5)
    assert torch.equal(y, torch.tensor([[3.5, 0.0, 5.0, 4.0], [0.0] * 4]))
    nv = next_values(x, mask, torch.tensor([7.0, 9.0]))
    assert torch.equal(nv, torch.tensor([[3.0, 0.0, 4.0, 7.0], [0.0] * 4]))


def test_bfloat16_accumulates_in_float32():
    x = torch.randn(4, 3000)
    mask = torch.rand(4, 3000) < 0.8
    y = discounted_reverse_cumsum(x.bfloat16(), mask, 1.0)
    assert y.dtype == torch.float32
    ref = reference.reverse_scan(x.bfloat16().float(), mask, 1.0)
    assert_matches(y, ref)


@pytest.mark.parametrize("chunk", [2, 3, 32, 64, 128])
def test_dense_scan_any_chunk(chunk):
    x = torch.randn(3, 301, dtype=torch.float64)
    mask = torch.ones(3, 301, dtype=torch.bool)
    ref = reference.reverse_scan(x, mask, 0.97)
    assert torch.allclose(dense_reverse_scan(x, 0.97, chunk), ref, rtol=1e-12, atol=1e-12)


def test_compaction_round_trip():
    mask = torch.tensor([[False, True, False, True, True], [True, False, False, False, False]])
    rows = Compaction(mask)
    x = torch.arange(10.0).view(2, 5)
    dense = rows.compact(x)
    assert dense[0, :4].tolist() == [0.0, 1.0, 3.0, 4.0]
    assert dense[1, :2].tolist() == [0.0, 5.0]
    assert rows.lengths.tolist() == [3, 1]
    assert torch.equal(rows.expand(dense), torch.where(mask, x, 0.0))


def test_batch_whiten_hand_computed():
    # masked values 1, 2, 3: mean 2, unbiased var 1
    x = torch.tensor([[1.0, 2.0, 0.0], [3.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    out = batch_whiten(x, mask)
    expected = torch.tensor([[-1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]) / (1 + 1e-8) ** 0.5
    assert torch.allclose(out, expected, atol=1e-7)


@settings(max_examples=50, deadline=None)
@given(scan_inputs(max_len=20))
def test_whiten_rows_is_batch_whiten_of_the_broadcast(inputs):
    x, mask = inputs
    per_row = x[:, 0]
    broadcast = torch.where(mask, per_row[:, None], 0.0)
    expected = reference.whiten(broadcast, mask)
    got = torch.where(mask, whiten_rows(per_row, mask.sum(dim=1))[:, None], 0.0)
    assert torch.allclose(got.double(), expected, atol=1e-5, rtol=1e-5)


def test_dense_scan_overwrite_only_when_asked():
    x = torch.randn(2, 64)
    kept = x.clone()
    y = dense_reverse_scan(x, 0.9)
    assert torch.equal(x, kept)
    assert torch.allclose(dense_reverse_scan(x, 0.9, overwrite=True), y)


def _scan_calls(seed: int = 0, b: int = 7, t: int = 301) -> list:
    """Every scan entry point, on a batch with gaps, truncated rows and an empty row."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(b, t, generator=gen) < 0.8
    mask[1] = False
    batch = RolloutBatch(
        response_mask=mask,
        token_rewards=torch.randn(b, t, generator=gen),
        values=torch.randn(b, t, generator=gen),
        truncated=torch.rand(b, generator=gen) < 0.5,
        bootstrap_values=torch.randn(b, generator=gen),
    )
    x, lam, term = (
        torch.randn(b, t, generator=gen),
        torch.rand(b, generator=gen),
        batch.values[:, 0],
    )
    return [
        lambda: gae(batch, 1.0, 0.95, whiten=True),
        lambda: gae(batch, 0.99, 0.97, plus_values=True),
        lambda: gae(batch, 1.0, lam, whiten=True),
        lambda: gae(batch, 0.9, 1.0),
        lambda: gae(batch, 0.9, 0.0, plus_values=True, whiten=True),
        lambda: returns_to_go(batch, 1.0, bootstrap=True, minus_values=True, whiten=True),
        lambda: returns_to_go(batch, 0.5, bootstrap=False, baseline=term),
        lambda: discounted_reverse_cumsum(x, mask, 0.97),
        lambda: discounted_reverse_cumsum(x, mask, lam),
        lambda: next_values(x, mask, term),
    ]


def test_scratch_memory_changes_no_result(monkeypatch):
    """Temporaries carved from the per-thread scratch buffer give the plain allocations'
    results, bit for bit."""
    calls = _scan_calls()
    for call in calls:
        call()  # the buffer grows to the largest need
    carved = [call() for call in calls]
    assert ops._ARENA.buffer.numel() > 0  # the calls above did use it
    monkeypatch.setattr(ops._ARENA, "busy", True)  # as in a nested call: plain allocations
    for call, expected in zip(calls, carved, strict=True):
        assert torch.equal(call(), expected)


def test_results_never_live_in_the_scratch_buffer():
    first = [call() for call in _scan_calls(seed=1)]
    kept = [y.clone() for y in first]
    second = [call() for call in _scan_calls(seed=2)]  # reuses the buffer
    for y, z in zip(first, kept, strict=True):
        assert torch.equal(y, z)
    buffer = ops._ARENA.buffer
    start, end = buffer.data_ptr(), buffer.data_ptr() + buffer.numel()
    for y in first + second:
        assert not start <= y.data_ptr() < end


def test_scratch_is_per_thread_and_bounded(monkeypatch):
    """A new thread starts with its own empty buffer, which never grows past the bound (every
    temporary is then a plain allocation)."""
    monkeypatch.setattr(ops, "SCRATCH_BYTES_MAX", 4096)
    calls = _scan_calls(seed=3)
    expected = [call() for call in calls]
    seen: dict[str, object] = {}

    def work() -> None:
        seen["results"] = [call() for call in calls]
        seen["size"] = ops._ARENA.buffer.numel()

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert seen["size"] == 0
    for y, z in zip(seen["results"], expected, strict=True):  # type: ignore[arg-type]
        assert torch.equal(y, z)


def test_a_gradient_through_the_scan_equals_the_loop_gradient():
    """Under autograd the scan allocates normally (nothing saved for backward is reused)."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(3, 70, generator=gen, dtype=torch.float64).float().requires_grad_()
    mask = torch.rand(3, 70, generator=gen) < 0.8
    weights = torch.randn(3, 70, generator=gen)
    (discounted_reverse_cumsum(x, mask, 0.9) * weights).sum().backward()
    # d/dx_s of sum_t w_t y_t = sum_{t<=s} w_t 0.9^(rank(s) - rank(t)) over True t, s
    expected = reference.reverse_scan(weights.flip(1), mask.flip(1), 0.9).flip(1)
    assert x.grad is not None
    assert_matches(x.grad, torch.where(mask, expected, 0.0))


def test_length_adaptive_gae_is_gae_with_its_per_row_lam():
    """λ_i = clamp(1 − 1/(α l_i), 0, 1) from the row lengths (an empty row: 0), as the
    catalogue's formula states, and the advantage is GAE with that per-row λ."""
    from ppokit.components.advantage.impl import LengthAdaptiveGAE

    gen = torch.Generator().manual_seed(5)
    mask = torch.rand(5, 40, generator=gen) < 0.7
    mask[2] = False
    batch = RolloutBatch(
        response_mask=mask,
        token_rewards=torch.randn(5, 40, generator=gen),
        values=torch.randn(5, 40, generator=gen),
    )
    est = LengthAdaptiveGAE(gamma=0.99, alpha=0.05, whiten=True)
    lengths = mask.sum(1).double()
    expected_lam = (1 - 1 / (0.05 * lengths)).clamp(0, 1).float()
    torch.testing.assert_close(est.lam(batch), expected_lam, rtol=1e-5, atol=0)
    assert float(est.lam(batch)[2]) == 0.0
    assert torch.equal(est(batch), gae(batch, 0.99, est.lam(batch), whiten=True))
