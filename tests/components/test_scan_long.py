"""The fused CPU kernels equal the chunked PyTorch scan and the per-step reference.

Every scan-based estimator and target is computed twice, with the kernels and inside
``_native.disabled()`` (the chunked scan), on generated batches with gaps, empty rows, groups,
per-row lambda and garbage at masked positions; both must match. Long rows are checked against
the float64 per-step reference with the elementwise bound of ``test_scan``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ppokit import _native
from ppokit.batch import RolloutBatch
from ppokit.components._scan import discounted_reverse_cumsum, gae, next_values, returns_to_go
from ppokit.registry import get_registry
from tests.components import reference
from tests.components.test_scan import assert_matches, scan_inputs
from tests.strategies import batches

SCANNED = [
    ("advantage", "gae", {}),
    ("advantage", "gae", {"whiten": False, "lam": 0.0}),
    ("advantage", "gae", {"gamma": 0.9, "lam": 1.0}),
    ("advantage", "length_adaptive_gae", {}),
    ("advantage", "mc", {}),
    ("advantage", "reinforce_pp", {}),
    ("advantage", "reinforce_pp_baseline", {}),
    ("advantage", "remax", {}),
    ("critic_target", "lambda_return", {}),
    ("critic_target", "mc_return", {}),
    ("critic_target", "td0", {}),
]


def test_kernels_are_built():
    """setup.py builds them wherever a C compiler is available, as on every machine we test."""
    if os.environ.get("PPOKIT_NATIVE") == "0":
        pytest.skip("PPOKIT_NATIVE=0")
    assert _native.available(), "ppokit/_kernels.c was not built"
    assert _native.applies(torch.zeros(2))


def _both(fn, *args, **kwargs):
    native = fn(*args, **kwargs)
    with _native.disabled():
        plain = fn(*args, **kwargs)
    return native, plain


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
def test_estimators_equal_the_chunked_scan(kind, name, params, batch):
    component = get_registry().create(kind, name, **params)
    native, plain = _both(component, batch)
    assert native.dtype == plain.dtype == torch.float32
    # whitening divides the float32 rounding of its inputs by their std: a looser bound
    assert torch.allclose(native, plain, rtol=1e-4, atol=2e-4)
    assert bool((native[~batch.response_mask] == 0).all())
    # garbage at masked positions changes nothing
    assert torch.equal(component(_garbage(batch)), native)


@settings(max_examples=60, deadline=None)
@given(scan_inputs(max_len=90), st.floats(0.0, 1.0))
def test_scan_and_next_values_equal_the_reference(inputs, d):
    x, mask = inputs
    assert_matches(discounted_reverse_cumsum(x, mask, d), reference.reverse_scan(x, mask, d))
    terminal = torch.randn(x.shape[0])
    assert torch.equal(
        next_values(x, mask, terminal).double(), reference.next_values(x, mask, terminal)
    )


@pytest.mark.parametrize("path", ["avx512", "avx2", "scalar"])
@pytest.mark.parametrize("lam", [0.0, 0.95, 1.0])
@pytest.mark.parametrize("gamma", [0.99, 1.0])
def test_long_rows_gae_is_exact(gamma, lam, path):
    """T = 32768 with gaps: elementwise within 1e-5 relative or 1e-6 absolute of float64."""
    gen = torch.Generator().manual_seed(3)
    b, t = 3, 32768
    mask = torch.rand(b, t, generator=gen) < 0.9
    mask[:, -7:] = False
    batch = RolloutBatch(
        response_mask=mask,
        token_rewards=torch.randn(b, t, generator=gen) * 0.1,
        values=torch.randn(b, t, generator=gen),
        truncated=torch.tensor([True, False, True]),
        bootstrap_values=torch.randn(b, generator=gen),
    )
    with _native.at_most(path) if _native.available() else contextlib.nullcontext():
        adv = gae(batch, gamma, lam)
        ret = returns_to_go(batch, gamma, bootstrap=True)
    assert_matches(adv, reference.gae(batch, gamma, lam))
    assert_matches(ret, reference.returns(batch, gamma, True))


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


def test_autograd_and_other_devices_use_the_chunked_scan():
    x = torch.randn(2, 8, requires_grad=True)
    assert not _native.applies(x)
    with torch.no_grad():
        assert _native.applies(x) == _native.available()
    assert not _native.applies(torch.zeros(2, device="meta"))
    with _native.disabled():
        assert not _native.applies(torch.zeros(2))
    # and a gradient flows through the chunked scan
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
    native, plain = _both(gae, batch, 0.5, 0.5)
    expected = torch.tensor([[1.625, 0.0, 2.5]])
    assert torch.equal(native, expected)
    assert torch.allclose(plain, expected)
    lam_return, _ = _both(gae, batch, 0.5, 0.5, plus_values=True)
    assert torch.equal(lam_return, expected + torch.tensor([[0.5, 0.0, 1.0]]))


@pytest.mark.skipif(not _native.available(), reason="C kernels not built")
@pytest.mark.parametrize("path", ["scalar", "avx2"])
@pytest.mark.parametrize(("kind", "name", "params"), SCANNED[:1] + SCANNED[3:])
@settings(max_examples=25, deadline=None)
@given(batch=batches(max_rows=10, max_len=37))
def test_every_cpu_path_gives_the_same_results(path, kind, name, params, batch):
    """CPUs without AVX-512 (or AVX2) run narrower paths: they must give the same results."""
    component = get_registry().create(kind, name, **params)
    widest = component(batch)
    with _native.at_most(path):
        narrow = component(batch.replace())
        assert torch.equal(component(_garbage(batch)), narrow)
    assert torch.allclose(narrow, widest, rtol=1e-6, atol=1e-6)


def test_without_the_extension_everything_runs_on_the_chunked_scan():
    """An install without a C compiler has no ppokit._kernels: same results, no error."""
    code = """
import sys
sys.modules["ppokit._kernels"] = None  # an install that could not build it
import torch
from ppokit import _native
from ppokit.batch import RolloutBatch
from ppokit.registry import get_registry
assert not _native.available() and not _native.applies(torch.zeros(1))
assert _native.level() == "none"
batch = RolloutBatch(
    response_mask=torch.tensor([[True, False, True], [True, True, False]]),
    token_rewards=torch.tensor([[1.0, float("nan"), 2.0], [0.5, 1.0, 7.0]]),
    values=torch.tensor([[0.5, 9.0, 1.0], [0.25, 0.5, 9.0]]),
    truncated=torch.tensor([True, False]),
    bootstrap_values=torch.tensor([3.0, 0.0]),
)
adv = get_registry().create("advantage", "gae", gamma=0.5, lam=0.5, whiten=False)(batch)
print(adv[0].tolist(), batch.scores.tolist(), batch.lengths.tolist())
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    # row 0 as in test_hand_computed_gae_with_a_gap; scores ignore the masked NaN
    assert out.split() == ["[1.625,", "0.0,", "2.5]", "[3.0,", "1.5]", "[2,", "2]"]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_gets_its_own_threads():
    """The worker threads do not survive a fork: the child must start its own, not hang."""
    gen = torch.Generator().manual_seed(0)
    batch = RolloutBatch(
        response_mask=torch.rand(64, 4096, generator=gen) < 0.9,
        token_rewards=torch.randn(64, 4096, generator=gen),
        values=torch.randn(64, 4096, generator=gen),
    )
    expected = gae(batch, 1.0, 0.95)  # the parent's pool now exists
    pid = os.fork()
    if pid == 0:  # child
        got = gae(batch, 1.0, 0.95)  # on two threads of its own
        torch.set_num_threads(1)  # torch's OpenMP pool does not survive a fork either
        os._exit(0 if torch.equal(got, expected) else 1)
    deadline = time.monotonic() + 60
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung on the parent's worker threads")
    assert os.waitstatus_to_exitcode(done[1]) == 0


@pytest.mark.skipif(not _native.available(), reason="C kernels not built")
def test_the_kernels_never_see_mismatched_shapes():
    """They read raw memory: a wrong shape is a ValueError before any read."""
    mask = torch.ones(3, 5, dtype=torch.bool)
    with pytest.raises(ValueError, match="expected shape"):
        _native.scan(torch.zeros(3, 4), mask, 0.9)
    with pytest.raises(ValueError, match="expected shape"):
        _native.row_sums(torch.zeros(2, 5), mask)
    with pytest.raises(RuntimeError):
        _native.broadcast_rows(torch.zeros(2), mask)
    with pytest.raises(ValueError, match="mask must be"):
        _native.scan(torch.zeros(15), mask.reshape(15), 0.9)
    # a 0/1 mask of another dtype is read as a mask
    y, _ = _native.scan(torch.ones(3, 5), mask.float(), 1.0)
    assert y[0].tolist() == [5.0, 4.0, 3.0, 2.0, 1.0]
