"""The round's lengths of the responses scored below and above their group's mean reward
(``response_length_below_group``, ``response_length_above_group``): the lengths a group
baseline gives a negative or a positive advantage (Dr. GRPO, arXiv:2503.20783, section 3.1)."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ppokit.trainer.groups import Generated
from ppokit.trainer.scoring import Scores

# Scores and group sizes whose means are exact in binary: the reference compares exactly.
SCORE = st.sampled_from([0.0, 0.25, 0.5, 1.0])


def _generated(n: int, batches: list[list[tuple[float, int]]]) -> dict[str, float | None]:
    generated = Generated(n, ["r"], [], torch.device("cpu"))
    for batch in batches:
        scores = torch.tensor([s for s, _ in batch], dtype=torch.float32)
        lengths = torch.tensor([length for _, length in batch])
        none = torch.zeros(len(batch), dtype=bool)
        generated.add(Scores(scores, {"r": scores}), lengths, none, lengths)
    out = {k: float(v) for k, v in generated.metrics(groups=True).items()}
    return {k: (v if math.isfinite(v) else None) for k, v in out.items()}


def _reference(n: int, rows: list[tuple[float, int]], side: int) -> float | None:
    picked = []
    for g in range(0, len(rows), n):
        group = rows[g : g + n]
        mean = sum(s for s, _ in group) / n
        picked += [length for s, length in group if (s > mean) - (s < mean) == side]
    return sum(picked) / len(picked) if picked else None


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from([2, 4]),
    st.lists(
        st.lists(st.tuples(SCORE, st.integers(1, 16)), min_size=2, max_size=2),
        min_size=1,
        max_size=4,
    ),
    st.integers(1, 3),
)
def test_the_lengths_below_and_above_the_group_mean_over_every_batch(
    n: int, pairs: list[list[tuple[float, int]]], batches: int
) -> None:
    """Each side's mean length over every generated response of the round, none (null) in a
    round without a response on that side; the groups span the batches' boundaries never."""
    groups = [[row for _ in range(n // 2) for row in pair] for pair in pairs]
    split = [[row for group in groups[i::batches] for row in group] for i in range(batches)]
    split = [b for b in split if b]
    rows = [row for b in split for row in b]
    got = _generated(n, split)
    for key, side in (("response_length_below_group", -1), ("response_length_above_group", 1)):
        want = _reference(n, rows, side)
        assert got[key] == want if want is None else math.isclose(got[key], want, rel_tol=1e-6)


def test_a_group_whose_rewards_are_equal_has_no_side_even_where_its_mean_rounds() -> None:
    """0.1 eight times averages to just under 0.1 in floating point: the group's rewards are
    all equal, its advantage 0, and none of its responses counts on either side."""
    equal = [(0.1, 3)] * 8
    varied = [(1.0, 5)] * 4 + [(0.0, 9)] * 4
    got = _generated(8, [equal + varied])
    assert got["response_length_below_group"] == 9.0
    assert got["response_length_above_group"] == 5.0
    assert _generated(8, [equal])["response_length_below_group"] is None
