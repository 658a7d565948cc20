"""Prompt weights: hand-computed cases and properties over generated batches."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ppokit.batch import RolloutBatch
from ppokit.components.prompt_weight.impl import InformativeGroups, PassRateVariance, Uniform
from ppokit.registry import RegistryError, build_registry
from tests.helpers.components import make_any, names
from tests.helpers.strategies import batches

SETTINGS = settings(max_examples=60, deadline=None)
#: Per component of a generic test: every registered component runs.
EACH = settings(max_examples=30, deadline=None)
#: Every registered prompt weight (installed plugins included): the generic contract tests.
NAMES = names("prompt_weight")


def _outcome_batch(scores: list[float], groups: list[int], garbage: float = 0.0) -> RolloutBatch:
    """Two response positions per row; the outcome sits on the second, garbage on a third
    (masked) position."""
    b = len(scores)
    rewards = torch.zeros(b, 3)
    rewards[:, 1] = torch.tensor(scores)
    rewards[:, 2] = garbage
    mask = torch.tensor([[True, True, False]] * b)
    return RolloutBatch(response_mask=mask, token_rewards=rewards, group_ids=torch.tensor(groups))


def test_hand_computed():
    # groups: {1, 0} -> p = 1/2; {1, 1} -> p = 1; {0.5, 0.5} -> p = 1/2
    batch = _outcome_batch([1.0, 0.0, 1.0, 1.0, 0.5, 0.5], [4, 4, 9, 9, 2, 2], garbage=7.0)
    torch.testing.assert_close(Uniform()(batch), torch.ones(6))
    raw = PassRateVariance(normalize=False)(batch)
    torch.testing.assert_close(raw, torch.tensor([0.25, 0.25, 0.0, 0.0, 0.25, 0.25]))
    # mean of the raw weights is 1/6
    torch.testing.assert_close(
        PassRateVariance(normalize=True)(batch), torch.tensor([1.5, 1.5, 0.0, 0.0, 1.5, 1.5])
    )
    torch.testing.assert_close(
        InformativeGroups()(batch), torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    )


def test_pass_rate_is_clamped_to_zero_one():
    batch = _outcome_batch([2.0, 3.0, -1.0, -4.0, 0.8, 0.0], [0, 0, 1, 1, 2, 2])
    # p = 2.5 -> 1, p = -2.5 -> 0, p = 0.4 -> 0.24
    torch.testing.assert_close(
        PassRateVariance(normalize=False)(batch), torch.tensor([0, 0, 0, 0, 0.24, 0.24])
    )


def test_empty_rows_do_not_count_in_their_group():
    """Two real responses scoring 1 and two rows emptied (say by the exclude rule): the
    group's pass rate is 1, so neither weight sees an informative group."""
    batch = _outcome_batch([1.0, 1.0, 0.0, 0.0], [0, 0, 0, 0])
    emptied = batch.replace(
        response_mask=batch.response_mask & torch.tensor([1, 1, 0, 0]).bool()[:, None]
    )
    assert torch.equal(PassRateVariance(normalize=False)(emptied), torch.zeros(4))
    assert torch.equal(InformativeGroups()(emptied), torch.zeros(4))
    assert torch.equal(Uniform()(emptied), torch.tensor([1.0, 1.0, 0.0, 0.0]))


def test_all_zero_weights_stay_zero():
    batch = _outcome_batch([1.0, 1.0, 0.0, 0.0], [0, 0, 1, 1])
    out = PassRateVariance(normalize=True)(batch)
    assert torch.equal(out, torch.zeros(4))
    assert torch.equal(InformativeGroups()(batch), torch.zeros(4))


def _reference_informative(scores: list[float], groups: list[int], live: list[bool]) -> list[float]:
    values: dict[int, set[float]] = {}
    for s, g, ok in zip(scores, groups, live, strict=True):
        if ok:
            values.setdefault(g, set()).add(s)
    return [1.0 if ok and len(values[g]) > 1 else 0.0 for g, ok in zip(groups, live, strict=True)]


@pytest.mark.parametrize("name", NAMES)
@EACH
@given(batches(outcome_only=True))
def test_every_weight_is_per_group_and_non_negative(name, batch):
    """One weight per prompt: float32 [B], constant over each group's responses, >= 0; a row
    without tokens weighs 0."""
    live = batch.nonempty
    w = make_any("prompt_weight", name)(batch)
    assert w.dtype == torch.float32
    assert w.shape == (batch.batch_size,)
    if name != "untruncated":  # the one weight of a response, not of its prompt
        torch.testing.assert_close(batch.group_mean(w, weights=live.float())[live], w[live])
    assert torch.equal(w[~live], torch.zeros_like(w[~live]))
    assert (w >= 0).all()
    assert not w.requires_grad


@SETTINGS
@given(batches(outcome_only=True), st.booleans())
def test_weights_are_per_group_and_bounded(batch, normalize):
    index = batch.group_index
    live = batch.nonempty
    weights = (
        Uniform()(batch),
        PassRateVariance(normalize=normalize)(batch),
        InformativeGroups()(batch),
    )
    for w in weights:
        assert w.dtype == torch.float32
        assert w.shape == (batch.batch_size,)
        # one weight per prompt: constant over each group's responses; empty rows weigh 0
        torch.testing.assert_close(batch.group_mean(w, weights=live.float())[live], w[live])
        assert torch.equal(w[~live], torch.zeros_like(w[~live]))
        assert (w >= 0).all()
    raw = PassRateVariance(normalize=False)(batch)
    assert (raw <= 0.25).all()
    norm = PassRateVariance(normalize=True)(batch)
    if (raw > 0).any():
        torch.testing.assert_close(norm[live].mean(), torch.tensor(1.0))
        torch.testing.assert_close(norm * raw[live].mean(), raw)
    else:
        assert torch.equal(norm, torch.zeros_like(norm))
    expected = _reference_informative(batch.scores.tolist(), index.tolist(), live.tolist())
    assert InformativeGroups()(batch).tolist() == expected


@SETTINGS
@given(batches(), st.booleans())
def test_masked_rewards_never_matter_to_pass_rate_variance(batch, normalize):
    noise = torch.randn(batch.token_rewards.shape) * 10
    other = batch.replace(
        token_rewards=torch.where(
            batch.response_mask, batch.token_rewards, noise.to(batch.token_rewards.dtype)
        )
    )
    w = PassRateVariance(normalize=normalize)
    assert torch.equal(w(batch), w(other))


@pytest.mark.parametrize("name", NAMES)
@EACH
@given(batches())
def test_masked_rewards_never_matter(name, batch):
    noise = torch.randn(batch.token_rewards.shape) * 10
    other = batch.replace(
        token_rewards=torch.where(
            batch.response_mask, batch.token_rewards, noise.to(batch.token_rewards.dtype)
        )
    )
    w = make_any("prompt_weight", name)
    assert torch.equal(w(batch), w(other))


def test_registry_builds_weights():
    registry = build_registry()
    assert registry.create("prompt_weight", "pass_rate_variance").normalize is True
    assert (
        registry.create("prompt_weight", "pass_rate_variance", normalize=False).normalize is False
    )
    for name in ("pass_rate_variance", "informative_groups"):
        assert registry.info("prompt_weight", name).requires == ("group_ids",)
    assert "2503.14476" in registry.info("prompt_weight", "informative_groups").source
    with pytest.raises(RegistryError, match="normalise: Extra inputs"):
        registry.create("prompt_weight", "pass_rate_variance", normalise=True)
