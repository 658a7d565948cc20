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
