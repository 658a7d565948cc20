"""Scoring overlapped with generation (rollout.overlap_scoring) and rewards spread over worker
processes (train.reward_workers): scores in the rows' order whatever order the calls end in,
a run the same with and without the overlap, errors and timeouts as without it."""

from __future__ import annotations

import itertools
import random
import time
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ppokit.bounded import Threads
from ppokit.catalogue import NoParams
from ppokit.components.reward import Scored
from ppokit.data import make_prompt_source
from ppokit.errors import ComponentError, ComponentTimeout
from ppokit.trainer import train
from ppokit.trainer.assembly import Checked, Where
from ppokit.trainer.boundary import join_answers, split_groups
from ppokit.trainer.metrics import TIMING, read_metrics
from ppokit.trainer.scoring import start_texts
from tests.helpers import Plugin
from tests.helpers.trainer import GROUP_FILTERED, small_spec

CPU = torch.device("cpu")


# ------------------------------------------------------------- rewards of random latency
class Sleepy:
    """Scores each response by its length plus ``offset``, after sleeping the row's
    ``delay`` (seconds); flags the odd lengths. Declares itself blocking."""

    blocking = True

    def __init__(self, offset: float = 0.0) -> None:
        self.offset = offset

    def __call__(
        self, prompts: list[str], responses: list[str], delay: list[float], **_: Any
    ) -> Scored:
        for d in delay:
            time.sleep(d)
        scores = [len(r) + self.offset for r in responses]
        return Scored(scores, {"odd": [len(r) % 2 == 1 for r in responses]})


def _batch(sizes: list[int]) -> tuple[list[str], list[str]]:
    """Groups of ``sizes`` responses, each group's prompt its own."""
    prompts = [f"p{g}" for g, size in enumerate(sizes) for _ in range(size)]
    responses = ["x" * (1 + (7 * i) % 5) for i in range(len(prompts))]
    return prompts, responses


@settings(max_examples=15, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 4), min_size=1, max_size=6),
    rewards=st.integers(1, 3),
    data=st.data(),
)
def test_started_scores_are_in_row_order_whatever_the_latency(
    sizes: list[int], rewards: int, data: st.DataObject
) -> None:
    """Rewards on the scoring threads, each sleeping a random time per row, give each
    reward's scores and flags in the rows' order, R their weighted sum (= scoring without
    threads)."""
    prompts, responses = _batch(sizes)
    b = len(responses)
    delays = data.draw(st.lists(st.floats(0, 0.004), min_size=b, max_size=b))
    fields = {"delay": delays}
    spec = [(f"r{k}", Sleepy(offset=k), 1.0 + k) for k in range(rewards)]
    threads = Threads(rewards, "test-score")
    got = start_texts(spec, prompts, responses, fields, CPU, threads).result()
    threads.close()
    plain = start_texts(spec, prompts, responses, {"delay": [0.0] * b}, CPU).result()
    lengths = torch.tensor([len(r) for r in responses], dtype=torch.float32)
    for k in range(rewards):
        torch.testing.assert_close(got.parts[f"r{k}"], lengths + k)
        assert got.flags[f"r{k}/odd"].tolist() == [float(len(r) % 2) for r in responses]
    torch.testing.assert_close(got.total, plain.total)
    expected = sum((1.0 + k) * (lengths + k) for k in range(rewards))
    torch.testing.assert_close(got.total, expected)


@given(sizes=st.lists(st.integers(1, 5), min_size=1, max_size=9), parts=st.integers(1, 5))
def test_a_split_keeps_groups_whole_and_joins_in_order(sizes: list[int], parts: int) -> None:
    """Split into at most ``parts`` pieces, each cut where the prompt changes; joined, the
    pieces' answers are the whole call's (scores and flags)."""
    prompts, responses = _batch(sizes)
    fields = {"delay": [0.0] * len(prompts), "answer": list(range(len(prompts)))}
    pieces = split_groups((prompts, responses), fields, parts)
    assert 1 <= len(pieces) <= parts
    assert [p for a, _, _ in pieces for p in a[0]] == prompts
    assert [x for _, k, _ in pieces for x in k["answer"]] == fields["answer"]
    starts = list(itertools.accumulate(n for _, _, n in pieces))[:-1]
    assert all(prompts[s - 1] != prompts[s] for s in starts)  # every piece starts a group
    reward = Sleepy()
    outs = [reward(a[0], a[1], **k) for a, k, _ in pieces]
    whole = reward(prompts, responses, **fields)
    joined = join_answers(outs, [n for _, _, n in pieces])
    assert isinstance(joined, Scored)
    assert joined.scores == whole.scores and joined.flags == whole.flags


def test_joined_tensors_and_a_wrong_count() -> None:
    """Tensor answers join to a tensor; a piece with the wrong number of scores is
    returned as it is, for the contract to refuse."""
    joined = join_answers([torch.tensor([1.0, 2.0]), torch.tensor([3.0])], [2, 1])
    assert isinstance(joined, torch.Tensor) and joined.tolist() == [1.0, 2.0, 3.0]
    assert join_answers([[1.0], [2.0, 3.0]], [1, 1]) == [2.0, 3.0]


@pytest.fixture(scope="module")
def three_workers() -> Any:
    reward = Checked(
        "reward", Where("reward", "sleepy", "tests"), Sleepy(), timeout=30.0, workers=3
    )
    yield reward
    reward.close()


@settings(max_examples=5, deadline=None)
@given(sizes=st.lists(st.integers(1, 3), min_size=2, max_size=8), data=st.data())
def test_a_reward_over_three_processes_answers_in_row_order(
    three_workers: Any, sizes: list[int], data: st.DataObject
) -> None:
    """train.reward_workers: 3 processes, each row sleeping a random time: the scores and
    flags are the rows' in order."""
    prompts, responses = _batch(sizes)
    b = len(responses)
    delays = data.draw(st.lists(st.floats(0, 0.005), min_size=b, max_size=b))
    assert three_workers.waits
    with_threads = start_texts(
        [("sleepy", three_workers, 1.0)], prompts, responses, {"delay": delays}, CPU
    )
    got = with_threads.result()
    assert got.total.tolist() == [float(len(r)) for r in responses]
    assert got.flags["sleepy/odd"].tolist() == [float(len(r) % 2) for r in responses]


def _fails(prompts: list[str], responses: list[str], **_: Any) -> list[float]:
    raise RuntimeError("the verifier said no\nsecond line")


def _hangs(prompts: list[str], responses: list[str], **_: Any) -> list[float]:
    time.sleep(60)
    return [0.0] * len(responses)


def test_an_error_on_a_scoring_thread_is_one_line() -> None:
    fails = Checked("reward", Where("reward", "fails", "tests"), _fails)
    fails.component.blocking = True  # type: ignore[attr-defined]
    threads = Threads(1, "test-score")
    pending = start_texts([("fails", fails, 1.0)], ["p"], ["r"], {}, CPU, threads)
    with pytest.raises(ComponentError) as caught:
        pending.result()
    threads.close()
    message = str(caught.value)
    assert "\n" not in message and "the verifier said no" in message and "fails" in message


def test_a_timeout_holds_on_a_scoring_thread() -> None:
    """A reward in its worker process, called on a scoring thread, is stopped at
    train.reward_timeout as on the trainer's thread."""
    hangs = Checked("reward", Where("reward", "hangs", "tests"), _hangs, timeout=0.5, workers=2)
    try:
        assert hangs.waits  # two processes: it waits on them
        threads = Threads(1, "test-score")
        start = time.monotonic()
        pending = start_texts([("hangs", hangs, 1.0)], ["p", "q"], ["r", "s"], {}, CPU, threads)
        with pytest.raises(ComponentTimeout, match=r"train\.reward_timeout"):
            pending.result()
        assert time.monotonic() - start < 30
        threads.close()
    finally:
        hangs.close()


def test_a_source_gives_back_what_was_put_back() -> None:
    from ppokit.spec import DataSpec

    source = make_prompt_source(DataSpec(), 3)
    first = source.next_rows(2)
    ahead = source.next_rows(3)
    source.put_back(3)
    assert source.drawn == 2 and source.next_rows(3) == ahead
    assert make_prompt_source(DataSpec(), 3).next_rows(5) == first + ahead
    with pytest.raises(ValueError):
        source.put_back(99)


def test_reward_workers_need_worker_processes(tmp_path) -> None:
    with pytest.raises(Exception, match="reward_workers: 2 needs reward_timeout"):
        small_spec(tmp_path, "train.reward_workers=2", "train.reward_timeout=null")


# ------------------------------------------------------------- a run, with and without
def slow_half_constant() -> Any:
    """The demo's prompts of a and b score 0.5 (never informative), those of c and d the
    fraction of the response's characters in a-m; each call sleeps a random moment, and
    the reward declares itself blocking."""

    def reward(
        prompts: list[str], responses: list[str], answer: list[str], **_: Any
    ) -> list[float]:
        time.sleep(random.uniform(0, 0.02))
        return [
            0.5 if s in "ab" else sum("a" <= ch <= "m" for ch in r) / max(1, len(r))
            for r, s in zip(responses, answer, strict=True)
        ]

    reward.blocking = True  # type: ignore[attr-defined]
    return reward


def _plugin() -> Plugin:
    return Plugin().add(
        "reward", "slow_half_constant", slow_half_constant, params=NoParams, summary="slow"
    )


FILTERED = ["reward=slow_half_constant", *GROUP_FILTERED, "train.rounds=2"]


def test_a_run_is_the_same_with_and_without_the_overlap(use_registry, tmp_path) -> None:
    """Two filtered rounds with a blocking reward, overlapped and not, log the same
    metrics (their timings aside): the batch generated ahead and not needed goes back, its
    prompts and torch's random state with it. The overlapped run did generate ahead."""
    use_registry(_plugin())
    on, off = tmp_path / "on", tmp_path / "off"
    train(small_spec(on, *FILTERED))
    train(small_spec(off, *FILTERED, "rollout.overlap_scoring=false"))

    def untimed(run: Any) -> list[dict[str, Any]]:
        return [
            {k: v for k, v in r.items() if k not in TIMING and k != "time_discarded"}
            for r in read_metrics(run)
        ]

    assert untimed(on) == untimed(off)
    assert sum(r["rollout/generation_batches"] for r in untimed(off)) > 2
    assert any(r.get("time_discarded") for r in read_metrics(on))
    assert not any("time_discarded" in r for r in read_metrics(off))


def test_pieces_by_hand() -> None:
    """Groups of 2, 2, 2 over 2 processes: cut at the middle group's end (row 4 ≥ 6/2)."""
    prompts, responses = _batch([2, 2, 2])
    pieces = split_groups((prompts, responses), {}, 2)
    assert [n for _, _, n in pieces] == [4, 2]
    assert [n for _, _, n in split_groups((prompts, responses), {}, 3)] == [2, 2, 2]
    assert [n for _, _, n in split_groups((prompts, responses), {}, 1)] == [6]


def test_lookahead_by_hand() -> None:
    """No batch yet: generate ahead; at a run's share of 1/2 passed, a batch ahead is worth
    it with 0 of 4 groups passed (0 + 2 < 4), not with 2 of 4 (2 + 2 = 4)."""
    from ppokit.trainer.producers.overlapped import Lookahead

    ahead = Lookahead()
    assert ahead.worth(0, 4)
    ahead.add(2, 4)
    assert ahead.worth(0, 4) and ahead.worth(1, 4) and not ahead.worth(2, 4)


@pytest.mark.usefixtures("ctrl_c")
def test_ctrl_c_while_a_reward_is_scored_ends_the_wait() -> None:
    """A Ctrl-C on the trainer's thread while it waits for a reward on a scoring thread is
    a KeyboardInterrupt there at once; closing the reward ends its worker and the thread."""
    import os
    import signal
    import threading

    hangs = Checked("reward", Where("reward", "hangs", "tests"), _hangs, timeout=60, workers=2)
    threads = Threads(1, "test-score")
    try:
        pending = start_texts([("hangs", hangs, 1.0)], ["p", "q"], ["r", "s"], {}, CPU, threads)
        timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
        start = time.monotonic()
        timer.start()
        with pytest.raises(KeyboardInterrupt):
            pending.result()
        assert time.monotonic() - start < 30
    finally:
        hangs.close()
        threads.close()
    assert all(pid is None for pid in hangs.pool.pids)
