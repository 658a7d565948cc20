"""Critic targets: loop references, identities, masking, bootstrap, hand-computed cases."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ppokit.batch import RolloutBatch
from ppokit.registry import get_registry
from tests.helpers import reference
from tests.helpers.components import builtin_names, make_any, names
from tests.helpers.strategies import batches

#: Every registered critic target (installed plugins included): the generic contract tests.
NAMES = names("critic_target")
FAST = settings(max_examples=60, deadline=None)
#: Per component of a generic test: every registered component runs.
EACH = settings(max_examples=30, deadline=None)


def make(name: str, **params):
    return make_any("critic_target", name, **params)


def close(a: torch.Tensor, ref: torch.Tensor, tol: float = 1e-5) -> bool:
    scale = 1.0 + ref.abs().max().item() if ref.numel() else 1.0
    return bool(((a.double() - ref).abs() <= tol * scale).all())


def masked(batch: RolloutBatch, x: torch.Tensor) -> torch.Tensor:
    return torch.where(batch.response_mask, x.double(), 0.0)


def test_registered():
    reg = get_registry()
    assert {"lambda_return", "mc_return", "td0"} <= set(builtin_names("critic_target"))
    for name in builtin_names("critic_target"):
        info = reg.info("critic_target", name)
        assert info.formula and info.source
    assert reg.info("critic_target", "mc_return").requires == ()
    try:
        make("lambda_return", lam=2.0)
    except LookupError:
        pass
    else:
        raise AssertionError("lam = 2 accepted")


@pytest.mark.parametrize("name", NAMES)
@EACH
@given(batches())
def test_contract(name, batch):
    y = make(name)(batch)
    assert y.dtype == torch.float32 and y.shape == batch.response_mask.shape
    assert not y.requires_grad
    assert bool((y[~batch.response_mask] == 0).all())


@pytest.mark.parametrize("name", NAMES)
@EACH
@given(batches(dtype=torch.float32), st.randoms(use_true_random=False))
def test_masked_garbage_and_row_order(name, batch, rnd):
    tgt = make(name)
    y = tgt(batch)
    mask = batch.response_mask
    noise = torch.randn(mask.shape) * 100
    changed = batch.replace(
        token_rewards=torch.where(mask, batch.token_rewards, noise),
        values=torch.where(mask, batch.values, noise),
    )
    assert torch.equal(tgt(changed), y)
    perm = list(range(batch.batch_size))
    rnd.shuffle(perm)
    index = torch.tensor(perm)
    assert torch.allclose(tgt(batch.rows(index)), y[index], atol=1e-6)


@pytest.mark.parametrize("name", NAMES)
@EACH
@given(batches(dtype=torch.float32))
def test_bfloat16_close_to_float32(name, batch):
    fields = ("token_rewards", "values", "bootstrap_values")
    low = batch.replace(**{f: getattr(batch, f).bfloat16() for f in fields})
    rounded = batch.replace(**{f: getattr(batch, f).bfloat16().float() for f in fields})
    out = make(name)(low)
    assert out.dtype == torch.float32
    assert torch.allclose(out, make(name)(rounded), rtol=1e-5, atol=1e-5)


@FAST
@given(batches(), st.floats(0, 1), st.floats(0, 1))
def test_lambda_return_is_value_plus_gae(batch, gamma, lam):
    y = make("lambda_return", gamma=gamma, lam=lam)(batch)
    assert close(y, masked(batch, batch.values) + reference.gae(batch, gamma, lam))


@FAST
@given(batches(outcome_only=True, truncation=False))
def test_lambda_return_lam_one_is_outcome(batch):
    """Terminal-only reward, gamma = lam = 1, terminal value 0: Y_t = R."""
    y = make("lambda_return", gamma=1.0, lam=1.0)(batch)
    assert close(y, reference.broadcast(batch, batch.scores.tolist()))


@FAST
@given(batches(), st.floats(0, 1))
def test_lambda_return_lam_one_is_mc_return(batch, gamma):
    a = make("lambda_return", gamma=gamma, lam=1.0)(batch)
    b = make("mc_return", gamma=gamma)(batch)
    assert close(a, b.double(), 1e-5)


@FAST
@given(batches(), st.floats(0, 1))
def test_lambda_return_lam_zero_is_td0(batch, gamma):
    a = make("lambda_return", gamma=gamma, lam=0.0)(batch)
    b = make("td0", gamma=gamma)(batch)
    assert close(a, b.double(), 1e-5)


@FAST
@given(batches(), st.floats(0, 1))
def test_mc_return_equals_loop(batch, gamma):
    assert close(make("mc_return", gamma=gamma)(batch), reference.returns(batch, gamma, True))


@FAST
@given(batches(), st.floats(0, 1))
def test_td0_equals_formula(batch, gamma):
    v_next = reference.next_values(batch.values, batch.response_mask, batch.terminal_values)
    expected = masked(batch, batch.token_rewards) + gamma * v_next
    assert close(make("td0", gamma=gamma)(batch), expected)


@FAST
@given(
    batches(truncation=True),
    st.floats(0, 1),
    st.sampled_from(("lambda_return", "mc_return", "td0")),
)
def test_bootstrap_adds_discounted_terminal_value(batch, gamma, name):
    """With lam = 1, bootstrapping adds gamma^(k+1) V_T, k = True positions after t
    (td0: only at the last position, k = 0)."""
    tgt = make(name, gamma=gamma)
    mask = batch.response_mask
    without = tgt(batch.replace(truncated=torch.zeros_like(batch.truncated)))
    remaining = (mask.flip(1).cumsum(1).flip(1) - 1).double()
    term = batch.terminal_values.double()[:, None]
    if name == "td0":
        expected = torch.where(batch.last_mask, gamma * term, 0.0)
    else:
        expected = torch.where(mask, gamma ** (remaining + 1) * term, 0.0)
    assert close(tgt(batch) - without, expected)


def _hand_batch() -> RolloutBatch:
    """Row 0: tokens at 0, 1, 3 (gap at 2); row 1: tokens at 0, 1, truncated, V_T = 2."""
    return RolloutBatch(
        response_mask=torch.tensor([[1, 1, 0, 1], [1, 1, 0, 0]], dtype=torch.bool),
        token_rewards=torch.tensor([[0.0, 0.5, 9.0, 1.0], [0.0, 2.0, 9.0, 9.0]]),
        values=torch.tensor([[0.5, 0.25, 9.0, 0.5], [1.0, 0.5, 9.0, 9.0]]),
        truncated=torch.tensor([False, True]),
        bootstrap_values=torch.tensor([5.0, 2.0]),
    )


def test_lambda_return_hand_computed():
    # GAE(gamma=1, lam=0.5) = [[0.25, 1, -, 0.5], [1.25, 3.5]] plus V
    y = make("lambda_return", gamma=1.0, lam=0.5)(_hand_batch())
    assert torch.allclose(y, torch.tensor([[0.75, 1.25, 0.0, 1.0], [2.25, 4.0, 0.0, 0.0]]))


def test_mc_return_hand_computed():
    # gamma = 0.5. Row 0: G3 = 1, G1 = 1, G0 = 0.5. Row 1: G1 = 2 + 0.5 * 2 = 3, G0 = 1.5
    y = make("mc_return", gamma=0.5)(_hand_batch())
    assert torch.allclose(y, torch.tensor([[0.5, 1.0, 0.0, 1.0], [1.5, 3.0, 0.0, 0.0]]))


def test_td0_hand_computed():
    # gamma = 0.5. Row 0: Y0 = 0 + 0.5 * 0.25, Y1 = 0.5 + 0.5 * 0.5 (skips the gap), Y3 = 1
    # Row 1: Y0 = 0 + 0.5 * 0.5, Y1 = 2 + 0.5 * 2 (bootstrap)
    y = make("td0", gamma=0.5)(_hand_batch())
    assert torch.allclose(y, torch.tensor([[0.125, 0.75, 0.0, 1.0], [0.25, 3.0, 0.0, 0.0]]))
