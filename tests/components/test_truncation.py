"""Truncation rules: hand-computed cases and properties over generated batches."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ppokit.batch import RolloutBatch
from ppokit.components.truncation.impl import Bootstrap, Exclude, Penalty, SoftOverlong, Terminal
from ppokit.registry import RegistryError, build_registry
from tests.helpers.components import make, make_any, names
from tests.helpers.strategies import batches

SETTINGS = settings(max_examples=60, deadline=None)
#: Per component of a generic test: every registered component runs.
EACH = settings(max_examples=30, deadline=None)
#: Every registered truncation rule (installed plugins included): the generic contract tests.
NAMES = names("truncation")


def _batch() -> RolloutBatch:
    """Row 0 ended with EOS (reward 1 on its last token), row 1 truncated (reward 0.5 on its
    last token, with a masked gap), row 2 truncated with reward spread over tokens."""
    mask = torch.tensor(
        [[True, True, False, False], [True, False, True, True], [True, True, True, True]]
    )
    rewards = torch.tensor([[0.0, 1.0, 9.0, 9.0], [0.0, 9.0, 0.0, 0.5], [0.1, 0.2, 0.3, 0.4]])
    return RolloutBatch(
        response_mask=mask,
        token_rewards=rewards,
        truncated=torch.tensor([False, True, True]),
        bootstrap_values=torch.tensor([5.0, 6.0, 7.0]),
    )


def test_terminal():
    out = Terminal()(_batch())
    assert out.bootstrap_values is None
    assert torch.equal(out.terminal_values, torch.zeros(3))
    assert torch.equal(out.token_rewards, _batch().token_rewards)
    assert torch.equal(out.response_mask, _batch().response_mask)


def test_bootstrap():
    out = Bootstrap()(_batch())
    torch.testing.assert_close(out.terminal_values, torch.tensor([0.0, 6.0, 7.0]))
    with pytest.raises(ValueError, match="bootstrap_values"):
        Bootstrap()(_batch().replace(bootstrap_values=None))
    with pytest.raises(ValueError, match="truncated"):
        Bootstrap()(_batch().replace(truncated=None))


def test_exclude():
    out = Exclude()(_batch())
    assert out.response_mask.tolist() == [
        [True, True, False, False],
        [False, False, False, False],
        [False, False, False, False],
    ]
    assert out.bootstrap_values is None
    torch.testing.assert_close(out.scores, torch.tensor([1.0, 0.0, 0.0]))


def test_penalty():
    out = Penalty(value=-2.0)(_batch())
    torch.testing.assert_close(
        out.token_rewards,
        torch.tensor([[0.0, 1.0, 9.0, 9.0], [0.0, 0.0, 0.0, -2.0], [0.0, 0.0, 0.0, -2.0]]),
    )
    torch.testing.assert_close(out.scores, torch.tensor([1.0, -2.0, -2.0]))
    assert out.bootstrap_values is None
    with pytest.raises(ValueError, match="truncated"):
        make("truncation", "penalty")(_batch().replace(truncated=None))


def test_soft_overlong_hand_computed():
    """max_length 3, buffer 2: L_c = 1; lengths 2, 3, 4 -> -0.5 f, -1 f, -f (f = 2)."""
    out = SoftOverlong(max_length=3, buffer=2, factor=2.0)(_batch())
    torch.testing.assert_close(
        out.token_rewards,
        torch.tensor([[0.0, 0.0, 9.0, 9.0], [0.0, 9.0, 0.0, -1.5], [0.1, 0.2, 0.3, -1.6]]),
    )
    assert out.bootstrap_values is None


def test_soft_overlong_penalty_curve():
    rule = SoftOverlong(max_length=10, buffer=4, factor=1.0)
    lengths = torch.tensor([0, 5, 6, 7, 8, 10, 11, 50])
    torch.testing.assert_close(
        rule.penalty(lengths), torch.tensor([0.0, 0.0, 0.0, -0.25, -0.5, -1.0, -1.0, -1.0])
    )


@SETTINGS
@given(batches(), st.data(), st.floats(0.0, 3.0))
def test_soft_overlong_properties(batch, data, factor):
    max_length = data.draw(st.integers(2, 16))
    buffer = data.draw(st.integers(1, max_length - 1))
    rule = SoftOverlong(max_length=max_length, buffer=buffer, factor=factor)
    out = rule(batch)
    pen = rule.penalty(batch.lengths)
    assert ((pen <= 0) & (pen >= -factor - 1e-6)).all()
    # only each row's last position changes, and the score moves by the penalty
    changed = out.token_rewards != batch.token_rewards
    assert not (changed & ~batch.last_mask).any()
    expected = batch.scores + pen * (batch.lengths > 0)
    tol = 0.1 if batch.token_rewards.dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out.scores, expected, atol=tol, rtol=tol)
    # monotone in the length
    curve = rule.penalty(torch.arange(0, max_length + 3))
    assert (curve[1:] <= curve[:-1]).all()


@SETTINGS
@given(batches(), st.floats(-3.0, 3.0))
def test_rules_on_generated_batches(batch, value):
    truncated = batch.truncated
    rules = (
        Terminal(),
        Exclude(),
        Penalty(value=value),
        make("truncation", "soft_overlong", max_length=5, buffer=2),
    )
    for rule in rules:
        out = rule(batch)
        assert out.bootstrap_values is None
        assert torch.equal(out.terminal_values, torch.zeros(batch.batch_size))
    kept = Bootstrap()(batch)
    expected = torch.where(truncated, batch.bootstrap_values.float(), torch.zeros(batch.batch_size))
    assert torch.equal(kept.terminal_values, expected)
    # exclude: truncated rows vanish from the mask, the others are untouched
    excluded = Exclude()(batch)
    assert not excluded.response_mask[truncated].any()
    assert torch.equal(excluded.response_mask[~truncated], batch.response_mask[~truncated])
    # penalty: truncated rows score exactly `value`, the others keep every reward
    penalised = Penalty(value=value)(batch)
    rewards = penalised.token_rewards
    assert torch.equal(rewards[~truncated], batch.token_rewards[~truncated])
    torch.testing.assert_close(
        penalised.scores[truncated],
        torch.full_like(penalised.scores[truncated], value).to(rewards.dtype).float(),
    )
    assert (rewards[truncated][~batch.last_mask[truncated]] == 0).all()


@pytest.mark.parametrize("name", NAMES)
@EACH
@given(batches())
def test_every_rule_keeps_the_batch_and_ignores_masked_rewards(name, batch):
    """A rule returns a batch of the same shape whose mask is inside the input's; it leaves
    the policy's and the critic's tensors alone; what masked positions held never matters to
    the scores."""
    rule = make_any("truncation", name)
    out = rule(batch)
    assert isinstance(out, RolloutBatch)
    assert out.response_mask.shape == batch.response_mask.shape
    assert not (out.response_mask & ~batch.response_mask).any()
    for field in ("values", "logp_old", "logp_rollout", "logp_ref", "group_ids", "truncated"):
        assert torch.equal(getattr(out, field), getattr(batch, field)), field
    assert out.token_rewards.dtype == batch.token_rewards.dtype
    noise = (torch.randn(batch.token_rewards.shape) * 100).to(batch.token_rewards.dtype)
    dirty = batch.replace(
        token_rewards=torch.where(batch.response_mask, batch.token_rewards, noise)
    )
    out_dirty = rule(dirty)
    assert torch.equal(out_dirty.response_mask, out.response_mask)
    assert torch.equal(out_dirty.scores, out.scores)
    assert torch.equal(out_dirty.terminal_values, out.terminal_values)


def test_registry_builds_rules():
    registry = build_registry()
    rule = registry.create("truncation", "soft_overlong", max_length=100, buffer=20)
    assert (rule.max_length, rule.buffer, rule.factor) == (100, 20, 1.0)
    with pytest.raises(RegistryError, match="buffer must be smaller"):
        registry.create("truncation", "soft_overlong", max_length=10, buffer=10)
    with pytest.raises(RegistryError, match="max_length"):
        registry.create("truncation", "soft_overlong", buffer=2)
    assert registry.create("truncation", "penalty").value == -1.0
    assert registry.info("truncation", "bootstrap").requires == ("truncated", "bootstrap_values")
    assert registry.info("truncation", "exclude").requires == ("truncated",)
    assert registry.info("truncation", "terminal").requires == ()
    assert "2503.14476" in registry.info("truncation", "soft_overlong").source
