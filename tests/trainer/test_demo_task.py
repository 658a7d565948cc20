"""The demo task: prompts, the reward, and the bound on prompt-independent policies."""

from __future__ import annotations

import random

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ppokit.tasks.demo import SPAN, SYMBOLS, DemoReward, echo_score, make_row


def test_reward_hand_cases() -> None:
    reward = DemoReward()
    out = reward(
        ["echo a", "echo b", "echo c", "echo d"], ["aaaa", "bxb", "", "dddddd"], answer=list("abcd")
    )
    assert torch.allclose(out, torch.tensor([1.0, 0.5, 0.0, 1.0]))
    # without an answer field the symbol is read from the prompt
    assert torch.allclose(reward(["echo c"], ["cc"]), torch.tensor([0.5]))


@given(st.integers(0, 10_000))
@settings(max_examples=50, deadline=None)
def test_rows_show_their_answer(seed: int) -> None:
    row = make_row(random.Random(seed))
    assert row["answer"] in SYMBOLS
    assert row["prompt"] == f"echo {row['answer']}"


@given(st.text(alphabet=SYMBOLS + "xy", max_size=6))
@settings(max_examples=100, deadline=None)
def test_prompt_independent_response_scores_at_most_one_over_k(response: str) -> None:
    # a fixed response, averaged over uniformly drawn symbols, scores <= 1/K (< 0.3)
    mean = sum(echo_score(response, s) for s in SYMBOLS) / len(SYMBOLS)
    assert mean <= 1 / len(SYMBOLS) + 1e-9
    assert 0.0 <= echo_score(response, response[:1] or "a") <= 1.0
    assert echo_score(SYMBOLS[0] * SPAN, SYMBOLS[0]) == 1.0


@given(st.lists(st.text(alphabet=SYMBOLS + "xy", max_size=6), min_size=3, max_size=3))
@settings(max_examples=100, deadline=None)
def test_ignoring_the_echo_games_observations_scores_at_most_one_half(turns: list[str]) -> None:
    """The echo environment over 3 turns: turns 2 and 3 answer symbols drawn independently
    of the prompt, shown only in the observations. Responses that do not read them (fixed
    given the prompt's symbol) score, averaged over those symbols, at most
    1/3 + 2/3 · 1/K = 0.5 with K = 4 symbols."""
    from ppokit.components.environment.impl import Echo

    echo = Echo(field="symbols")
    for first in SYMBOLS:
        total = 0.0
        for second in SYMBOLS:
            for third in SYMBOLS:
                row = {"symbols": first + second + third}
                total += sum(echo.step(row, r, k).reward for k, r in enumerate(turns))
        mean = total / len(SYMBOLS) ** 2
        assert mean <= 1 / 3 + 2 / 3 / len(SYMBOLS) + 1e-9
    best = {"symbols": "abc"}
    assert sum(echo.step(best, s * SPAN, k).reward for k, s in enumerate("abc")) == 1.0
