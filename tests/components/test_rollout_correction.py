"""Rollout corrections: identities over generated batches (on-policy identity, the
importance-sampling identity on enumerable vocabularies, bounds, row constancy, masking and
padding invariance) and hand-computed cases."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ppokit.batch import RolloutBatch
from ppokit.components.rollout_correction.impl import MAX_LOG_RATIO, log_ratio
from ppokit.registry import RegistryError
from tests.helpers.components import make, names
from tests.helpers.strategies import batches
from tests.helpers.tolerance import U, exp_gap, sum_gap

NAMES = names("rollout_correction")
BUILTINS = ("none", "token_tis", "token_mis", "seq_tis", "seq_mis", "geo_mask")
SEQUENCE = ("seq_tis", "seq_mis", "geo_mask")
EACH = settings(max_examples=40, deadline=None)


def _upper(name: str, corr: object) -> float:
    """The largest weight a correction can give."""
    return max(getattr(corr, "cap", 1.0), getattr(corr, "high", 1.0))


def _with_rollout(batch: RolloutBatch, noise: float, seed: int) -> RolloutBatch:
    """The batch with log μ = log π_old + noise (masked positions: garbage)."""
    g = torch.Generator().manual_seed(seed)
    assert batch.logp_old is not None
    old = batch.logp_old.float()
    rollout = old + noise * torch.randn(old.shape, generator=g)
    garbage = 50 * torch.randn(old.shape, generator=g)
    mask = batch.response_mask
    return batch.replace(
        logp_old=old, logp_rollout=torch.where(mask, rollout, garbage), token_rewards=old * 0
    )


def test_every_builtin_is_registered() -> None:
    assert set(BUILTINS) <= set(NAMES)


@pytest.mark.parametrize("name", BUILTINS)
@EACH
@given(batches(dtype=torch.float32))
def test_on_policy_every_correction_is_the_identity(name: str, batch: RolloutBatch) -> None:
    """μ = π_old: weight 1 on every response position, 0 elsewhere."""
    batch = batch.replace(logp_rollout=batch.logp_old)
    weights = make("rollout_correction", name)(batch)
    assert torch.equal(weights, batch.maskf)


@pytest.mark.parametrize("name", BUILTINS)
@EACH
@given(batches(dtype=torch.float32), st.floats(0.0, 3.0), st.integers(0, 1000))
def test_weights_are_bounded_masked_and_without_grad(
    name: str, batch: RolloutBatch, noise: float, seed: int
) -> None:
    batch = _with_rollout(batch, noise, seed)
    corr = make("rollout_correction", name)
    weights = corr(batch)
    assert weights.dtype == torch.float32 and not weights.requires_grad
    assert weights.shape == batch.response_mask.shape
    assert torch.isfinite(weights).all()
    assert (weights >= 0).all() and (weights <= _upper(name, corr) + 1e-6).all()
    assert (weights[~batch.response_mask] == 0).all()


@pytest.mark.parametrize("name", SEQUENCE)
@EACH
@given(batches(dtype=torch.float32), st.floats(0.0, 1.0), st.integers(0, 1000))
def test_sequence_corrections_are_constant_along_a_row(
    name: str, batch: RolloutBatch, noise: float, seed: int
) -> None:
    batch = _with_rollout(batch, noise, seed)
    weights = make("rollout_correction", name)(batch)
    first = weights.max(dim=1).values  # the row's weight (all positions share it)
    expected = torch.where(batch.response_mask, first[:, None], 0.0)
    assert torch.equal(weights, expected)


@pytest.mark.parametrize("name", BUILTINS)
@EACH
@given(batches(dtype=torch.float32), st.floats(0.0, 2.0), st.integers(0, 1000))
def test_padding_and_masked_values_never_matter(
    name: str, batch: RolloutBatch, noise: float, seed: int
) -> None:
    batch = _with_rollout(batch, noise, seed)
    corr = make("rollout_correction", name)
    weights = corr(batch)
    b, extra = batch.batch_size, 3
    g = torch.Generator().manual_seed(seed + 1)

    def pad(x: torch.Tensor, fill: torch.Tensor | float) -> torch.Tensor:
        tail = fill if isinstance(fill, torch.Tensor) else torch.full((b, extra), fill)
        return torch.cat([x, tail.to(x.dtype)], dim=1)

    garbage = lambda: 30 * torch.randn((b, extra), generator=g)  # noqa: E731
    padded = RolloutBatch(
        response_mask=pad(batch.response_mask, False),
        token_rewards=pad(batch.token_rewards, 0.0),
        logp_old=pad(batch.logp_old, garbage()),  # type: ignore[arg-type]
        logp_rollout=pad(batch.logp_rollout, garbage()),  # type: ignore[arg-type]
    )
    again = corr(padded)
    assert (again[:, weights.shape[1] :] == 0).all()
    gap, unsure = _float32_gap(name, corr, batch, weights.shape[1] + extra)
    close = (again[:, : weights.shape[1]] - weights).abs() <= gap * torch.maximum(
        again[:, : weights.shape[1]].abs(), weights.abs()
    )
    assert (close | unsure).all()


def _float32_gap(
    name: str, corr: object, batch: RolloutBatch, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """How far two float32 computations of a correction's weights may lie apart when the
    masked and padded positions are what they should be, nothing else (tests/helpers/
    tolerance.py): the relative gap per position [B, T], and the positions whose weight sits
    within that gap of a bound (``low``, ``high``), where rounding alone can keep or zero
    it. Token weights take one exp of the same difference (the subtraction rounds the same
    way everywhere); sequence weights take it of a sum over up to ``width`` terms; the
    geometric mean divides that sum by the length (one more rounding)."""
    delta = log_ratio(batch).double()
    lengths = batch.lengths.clamp_min(1).double()
    if name in ("seq_tis", "seq_mis"):
        exact = delta.sum(1)
        log_gap = sum_gap(delta, width, 1)
    elif name == "geo_mask":
        exact = delta.sum(1) / lengths
        log_gap = sum_gap(delta, width, 1) / lengths + 2 * 2 * U * exact.abs()
    else:
        exact, log_gap = delta, torch.zeros_like(delta)
    if exact.dim() == 1:
        exact, log_gap = exact[:, None].expand_as(delta), log_gap[:, None].expand_as(delta)
    gap = exp_gap(log_gap)
    value = exact.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp()
    unsure = torch.zeros_like(delta, dtype=torch.bool)
    for bound in (getattr(corr, "low", None), getattr(corr, "high", None)):
        if bound is not None:
            unsure |= (value - bound).abs() <= gap * torch.maximum(value, torch.tensor(bound))
    return gap, unsure


# ---------------------------------------------------------------------- importance sampling
def _categorical(seed: int, v: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(log π, log μ) of two distributions over ``v`` tokens (float64)."""
    g = torch.Generator().manual_seed(seed)
    pi = torch.randn(v, generator=g, dtype=torch.float64).log_softmax(0)
    mu = (pi.exp() + 0.3 * torch.rand(v, generator=g, dtype=torch.float64)).log()
    return pi, mu - mu.logsumexp(0)


def _one_token_batch(pi: torch.Tensor, mu: torch.Tensor) -> RolloutBatch:
    """Each of the V outcomes as a one-token response."""
    v = pi.shape[0]
    return RolloutBatch(
        response_mask=torch.ones(v, 1, dtype=torch.bool),
        token_rewards=torch.zeros(v, 1),
        logp_old=pi.float()[:, None],
        logp_rollout=mu.float()[:, None],
    )


@pytest.mark.parametrize("name", ["token_tis", "seq_tis", "token_mis", "seq_mis"])
@given(st.integers(0, 10_000), st.integers(2, 12))
@EACH
def test_the_importance_sampling_identity_holds_exactly(name: str, seed: int, v: int) -> None:
    """E_μ[c·f] = E_π[f] on an enumerable vocabulary when no ratio is truncated or masked."""
    pi, mu = _categorical(seed, v)
    ratio = (pi - mu).exp()
    wide = {"cap": float(ratio.max()) * 2 + 1} if "tis" in name else {}
    if "mis" in name:
        wide = {"low": float(ratio.min()) / 2, "high": float(ratio.max()) * 2 + 1}
    weights = make("rollout_correction", name, **wide)(_one_token_batch(pi, mu))[:, 0].double()
    f = torch.linspace(-1.0, 2.0, v, dtype=torch.float64)
    assert torch.allclose((mu.exp() * weights * f).sum(), (pi.exp() * f).sum(), atol=1e-6)


@given(st.integers(0, 10_000), st.integers(2, 12), st.floats(1.0, 3.0))
@EACH
def test_truncation_biases_towards_zero_as_its_cap_says(seed: int, v: int, cap: float) -> None:
    """For f >= 0: E_μ[min(r, C)·f] <= E_π[f], the gap Σ_a μ(a)(r(a) − C)⁺ f(a) exactly."""
    pi, mu = _categorical(seed, v)
    weights = make("rollout_correction", "token_tis", cap=cap)(_one_token_batch(pi, mu))[:, 0]
    f = torch.linspace(0.0, 1.0, v, dtype=torch.float64)
    estimate = (mu.exp() * weights.double() * f).sum()
    truth = (pi.exp() * f).sum()
    gap = (mu.exp() * ((pi - mu).exp() - cap).clamp_min(0) * f).sum()
    assert estimate <= truth + 1e-6
    assert torch.allclose(truth - estimate, gap, atol=1e-6)


# ---------------------------------------------------------------------- hand-computed cases
def _hand_batch() -> RolloutBatch:
    """Two rows: Δ = (ln 3, ln 0.5, ·) and (ln 1.25, ·, ·), the dots masked."""
    mask = torch.tensor([[True, True, False], [True, False, False]])
    old = torch.tensor([[math.log(0.3), math.log(0.1), 9.0], [math.log(0.5), 0.0, 0.0]])
    rollout = torch.tensor([[math.log(0.1), math.log(0.2), -9.0], [math.log(0.4), 5.0, 0.0]])
    return RolloutBatch(
        response_mask=mask, token_rewards=torch.zeros(2, 3), logp_old=old, logp_rollout=rollout
    )


@pytest.mark.parametrize(
    ("name", "params", "expected"),
    [
        ("none", {}, [[1, 1, 0], [1, 0, 0]]),
        ("token_tis", {}, [[2, 0.5, 0], [1.25, 0, 0]]),  # cap 2 truncates 3
        ("token_mis", {"high": 2.5}, [[0, 0.5, 0], [1.25, 0, 0]]),  # 3 > high: dropped
        ("seq_tis", {"cap": 1.4}, [[1.4, 1.4, 0], [1.25, 0, 0]]),  # row 0: 3 · 0.5 = 1.5
        ("seq_mis", {"low": 0.5, "high": 1.3}, [[0, 0, 0], [1.25, 0, 0]]),
        # geometric means: row 0 sqrt(1.5) = 1.2247, row 1 1.25
        ("geo_mask", {"low": 0.8, "high": 1.24}, [[1, 1, 0], [0, 0, 0]]),
    ],
)
def test_hand_computed(name: str, params: dict[str, float], expected: list[list[float]]) -> None:
    weights = make("rollout_correction", name, **params)(_hand_batch())
    assert torch.allclose(weights, torch.tensor(expected, dtype=torch.float32), atol=1e-6)


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("token_tis", {"cap": 0.5}),
        ("seq_tis", {"cap": 0.99}),
        ("token_mis", {"low": 1.1}),
        ("seq_mis", {"high": 0.9}),
        ("geo_mask", {"low": 0.0}),
    ],
)
def test_a_correction_that_would_reject_on_policy_tokens_is_refused(
    name: str, params: dict[str, float]
) -> None:
    with pytest.raises(RegistryError, match=f"rollout_correction '{name}': "):
        make("rollout_correction", name, **params)
