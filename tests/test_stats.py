"""ppokit.stats: the Student-t interval and pass@k, on hand-computed cases and properties."""

from __future__ import annotations

import math
from itertools import combinations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ppokit.stats import mean_ci95, pass_at_k, student_t_cdf, student_t_quantile

# t_{0.975, df} from printed tables (e.g. NIST/SEMATECH e-Handbook, table 1.3.6.7.2)
T975 = {
    1: 12.706205,
    2: 4.302653,
    3: 3.182446,
    4: 2.776445,
    5: 2.570582,
    9: 2.262157,
    10: 2.228139,
    20: 2.085963,
    30: 2.042272,
    60: 2.000298,
    100: 1.983972,
    1000: 1.962339,
}


@pytest.mark.parametrize(("df", "expected"), sorted(T975.items()))
def test_t_quantile_matches_tables(df: int, expected: float) -> None:
    assert student_t_quantile(0.975, df) == pytest.approx(expected, abs=2e-6)


def test_t_quantile_other_levels_and_limits() -> None:
    assert student_t_quantile(0.995, 4) == pytest.approx(4.604095, abs=2e-6)
    assert student_t_quantile(0.95, 7) == pytest.approx(1.894579, abs=2e-6)
    assert student_t_quantile(0.5, 3) == 0.0
    assert student_t_quantile(0.025, 2) == pytest.approx(-4.302653, abs=2e-6)
    # large df: the normal quantile
    assert student_t_quantile(0.975, 1e9) == pytest.approx(1.959964, abs=2e-6)
    # the CDF inverts the quantile
    for df in (1, 2, 3, 7.5, 40):
        for p in (0.6, 0.9, 0.975, 0.999):
            assert student_t_cdf(student_t_quantile(p, df), df) == pytest.approx(p, abs=1e-10)
    assert student_t_cdf(0.0, 5) == 0.5
    assert student_t_cdf(math.inf, 5) == 1.0
    with pytest.raises(ValueError):
        student_t_quantile(1.0, 3)
    with pytest.raises(ValueError):
        student_t_quantile(0.5, 0)


def test_mean_ci95_hand_computed() -> None:
    # [1, 2, 3]: mean 2, s = 1, half-width t_{0.975,2} * 1/sqrt(3) = 4.302653 * 0.57735
    mean, half = mean_ci95([1, 2, 3])
    assert mean == 2.0
    assert half == pytest.approx(2.48414, abs=1e-5)
    # [0.5, 0.7]: mean 0.6, s = 0.141421, half = 12.706205 * 0.141421 / sqrt(2) = 1.270621
    mean, half = mean_ci95([0.5, 0.7])
    assert mean == pytest.approx(0.6)
    assert half == pytest.approx(1.2706205, abs=1e-6)
    # identical values: no spread
    assert mean_ci95([4.0, 4.0, 4.0]) == (4.0, 0.0)


def test_mean_ci95_one_value_and_none() -> None:
    mean, half = mean_ci95([0.25])
    assert mean == 0.25
    assert math.isnan(half)
    with pytest.raises(ValueError):
        mean_ci95([])


def _pass_at_k_combinatorial(n: int, c: int, k: int) -> float:
    """pass@k by enumerating every draw of k of the n samples."""
    draws = list(combinations(range(n), k))
    return sum(any(i < c for i in d) for d in draws) / len(draws)


def test_pass_at_k_hand_computed() -> None:
    # 1 - C(3,2)/C(5,2) = 1 - 3/10
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)
    # pass@1 is the fraction correct
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    # 1 - C(6,3)/C(10,3) = 1 - 20/120
    assert pass_at_k(10, 4, 3) == pytest.approx(1 - 20 / 120)
    assert pass_at_k(5, 0, 3) == 0.0
    # n - c < k: every draw holds a correct sample
    assert pass_at_k(5, 3, 3) == 1.0
    assert pass_at_k(4, 4, 1) == 1.0
    for n, c, k in [(6, 2, 3), (7, 3, 2), (8, 1, 8), (5, 5, 5)]:
        assert pass_at_k(n, c, k) == pytest.approx(_pass_at_k_combinatorial(n, c, k))


def test_pass_at_k_rejects_bad_arguments() -> None:
    for n, c, k in [(0, 0, 1), (5, 6, 1), (5, -1, 1), (5, 2, 0), (5, 2, 6)]:
        with pytest.raises(ValueError):
            pass_at_k(n, c, k)


@st.composite
def nck(draw: st.DrawFn) -> tuple[int, int, int]:
    n = draw(st.integers(1, 300))
    return n, draw(st.integers(0, n)), draw(st.integers(1, n))


@settings(max_examples=200, deadline=None)
@given(nck())
def test_pass_at_k_properties(args: tuple[int, int, int]) -> None:
    n, c, k = args
    p = pass_at_k(n, c, k)
    assert 0.0 <= p <= 1.0
    if c < n:
        assert pass_at_k(n, c + 1, k) >= p  # more correct samples: never lower
    if k < n:
        assert pass_at_k(n, c, k + 1) >= p  # more draws: never lower
    assert (p == 0.0) == (c == 0)


values_lists = st.lists(
    st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False), min_size=2, max_size=40
)


@settings(max_examples=200, deadline=None)
@given(values_lists, st.floats(-1e3, 1e3, allow_nan=False).filter(lambda a: abs(a) > 1e-3))
def test_mean_ci95_properties(values: list[float], scale: float) -> None:
    mean, half = mean_ci95(values)
    assert half >= 0.0
    assert mean - half <= mean <= mean + half
    assert min(values) - 1e-6 * (1 + abs(mean)) <= mean <= max(values) + 1e-6 * (1 + abs(mean))
    scaled_mean, scaled_half = mean_ci95([scale * v for v in values])
    assert scaled_mean == pytest.approx(scale * mean, rel=1e-9, abs=1e-6)
    assert scaled_half == pytest.approx(abs(scale) * half, rel=1e-9, abs=1e-6)
    # shifting the values moves the mean, not the width
    shifted_mean, shifted_half = mean_ci95([v + 10.0 for v in values])
    assert shifted_mean == pytest.approx(mean + 10.0, rel=1e-9, abs=1e-6)
    assert shifted_half == pytest.approx(half, rel=1e-6, abs=1e-6)
