"""Group filters: properties over generated groups (a constant group is never informative, a
group with a spread above the tolerance always is, the flags do not depend on the order of a
group's responses or on the other groups) and hand-computed cases; the trainer's contract
check names a filter that returns the wrong thing."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ppokit.components.group_filter import Groups
from ppokit.errors import ComponentError
from ppokit.testing.tensors import shuffled_groups
from ppokit.trainer.assembly import Checked, Where
from tests.helpers.components import make, names

BUILTINS = ("none", "informative", "not_all_truncated", "pass_rate")
EACH = settings(max_examples=60, deadline=None)


def groups_of(rewards: torch.Tensor, truncated: torch.Tensor | None = None) -> Groups:
    g, n = rewards.shape
    if truncated is None:
        truncated = torch.zeros(g, n, dtype=torch.bool)
    return Groups(
        rows=[{"prompt": f"p{i}"} for i in range(g)],
        responses=["r"] * (g * n),
        rewards=rewards.float(),
        lengths=torch.full((g, n), 3, dtype=torch.long),
        truncated=truncated,
    )


@st.composite
def group_sets(draw: st.DrawFn) -> Groups:
    """G groups of n responses: some constant (any magnitude, float noise added), some with
    a spread, rewards in {0, 1} or real-valued, random truncation flags."""
    g = draw(st.integers(1, 10))
    n = draw(st.integers(2, 8))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    binary = draw(st.booleans())
    if binary:
        rewards = torch.randint(0, 2, (g, n), generator=gen).float()
    else:
        rewards = torch.randn(g, n, generator=gen) * draw(st.sampled_from([1e-2, 1.0, 100.0]))
    constant = torch.rand(g, generator=gen) < 0.4
    level = torch.randn(g, 1, generator=gen) * 10
    rewards = torch.where(constant[:, None], level.expand(g, n), rewards)
    truncated = torch.rand(g, n, generator=gen) < draw(st.sampled_from([0.0, 0.5, 0.95]))
    return groups_of(rewards, truncated)


def test_every_builtin_is_registered() -> None:
    assert set(BUILTINS) <= set(names("group_filter"))


@pytest.mark.parametrize("name", BUILTINS)
@EACH
@given(group_sets(), st.integers(0, 2**31 - 1))
def test_flags_are_bool_per_group_and_permutation_invariant(
    name: str, groups: Groups, seed: int
) -> None:
    """bool [G]; shuffling the responses inside each group, or the groups themselves, shuffles
    nothing but the flags of the groups."""
    keep = make("group_filter", name)(groups)
    assert keep.dtype == torch.bool and keep.shape == (groups.size,)
    shuffled, order = shuffled_groups(groups, seed)
    assert torch.equal(make("group_filter", name)(shuffled), keep[order])


@EACH
@given(group_sets(), st.floats(-100, 100, allow_nan=False), st.integers(2, 16))
def test_informative_rejects_constant_groups_even_with_float_noise(
    groups: Groups, level: float, n: int
) -> None:
    """A group whose rewards are all equal, or equal up to float32 rounding (for rewards up
    to 100 in magnitude, whose rounding is below the default tolerance), is never
    informative; a group with a spread is."""
    keep = make("group_filter", "informative")(groups)
    spread = groups.rewards.double().std(dim=1)
    assert torch.equal(keep, spread > 1e-4)
    # the same value up to float32 rounding (relative 1e-7): a tiny non-zero std
    jitter = 1 + 1e-7 * torch.randn(n, generator=torch.Generator().manual_seed(n))
    noisy = (torch.tensor(level, dtype=torch.float32) * jitter.float())[None, :]
    assert not make("group_filter", "informative")(groups_of(noisy))[0]
    constant = torch.full((1, n), level, dtype=torch.float32)
    assert not make("group_filter", "informative")(groups_of(constant))[0]
    bumped = constant.clone()
    bumped[0, -1] += 1.0
    assert make("group_filter", "informative")(groups_of(bumped))[0]


def test_hand_computed_cases() -> None:
    rewards = torch.tensor(
        [[1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 1.0]]
    )
    truncated = torch.tensor(
        [[True] * 4, [True, False, True, True], [False] * 4, [True] * 4], dtype=torch.bool
    )
    groups = groups_of(rewards, truncated)
    flags = {name: make("group_filter", name)(groups).tolist() for name in BUILTINS}
    assert flags["none"] == [True] * 4
    assert flags["informative"] == [False, False, True, True]
    assert flags["not_all_truncated"] == [False, True, True, False]
    # pass rates 1, 0, 0.25, 0.75 against [0.2, 0.8]
    assert flags["pass_rate"] == [False, False, True, True]
    narrow = make("group_filter", "pass_rate", low=0.5, high=1.0, correct_at=0.5)(groups)
    assert narrow.tolist() == [True, False, False, True]
    wide = make("group_filter", "informative", tolerance=0.6)(groups)  # std 0.5 is too small
    assert wide.tolist() == [False, False, False, False]


def test_a_group_of_one_is_never_informative() -> None:
    keep = make("group_filter", "informative")(groups_of(torch.tensor([[0.0], [1.0]])))
    assert keep.tolist() == [False, False]


def test_the_contract_check_names_a_bad_filter() -> None:
    where = Where("rollout.filter", "bad", "ppokit-test")
    groups = groups_of(torch.zeros(3, 2))
    for out in (torch.ones(3), torch.ones(2, dtype=torch.bool), [True, True, True]):
        with pytest.raises(ComponentError, match=r"rollout.filter \(bad, plugin ppokit-test\)"):
            Checked("group_filter", where, lambda _g, out=out: out)(groups)
    good = Checked("group_filter", where, lambda g: torch.ones(g.size, dtype=torch.bool))
    assert good(groups).tolist() == [True] * 3


def test_informative_keeps_a_group_that_varies_in_any_weighted_reward_part() -> None:
    """With the reward parts read (gdpo), a group whose R is constant but whose parts vary
    is kept: correctness and format that trade off leave R flat and GDPO's advantage not;
    a part of weight 0 adds nothing; without the parts only R counts (hand-computed)."""
    # R = c + f: group 0 flat in both, group 1 flat R but varying parts, group 2 varies
    # only in a part of weight 0, group 3 varies in R
    correct = torch.tensor([[1.0, 1.0], [1.0, 0.0], [0.0, 0.0], [1.0, 0.0]])
    fmt = torch.tensor([[0.0, 0.0], [0.0, 1.0], [0.0, 0.0], [0.0, 0.0]])
    unused = torch.tensor([[0.0, 0.0], [0.0, 0.0], [0.0, 5.0], [0.0, 0.0]])
    plain = groups_of(correct + fmt)
    informative = make("group_filter", "informative")
    assert informative(plain).tolist() == [False, False, False, True]
    parts = Groups(
        rows=plain.rows,
        responses=plain.responses,
        rewards=plain.rewards,
        lengths=plain.lengths,
        truncated=plain.truncated,
        parts=torch.stack([correct, fmt, unused], 2),
        weights=torch.tensor([1.0, 1.0, 0.0]),
    )
    assert informative(parts).tolist() == [False, True, False, True]
