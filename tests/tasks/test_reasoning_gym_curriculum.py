"""reasoning-gym's curricula as a setting of the reasoning_gym source: the levels rise exactly
when the windowed mean reward reaches the threshold, one attribute at a time, never past the
last level; the levels resume exactly; without a curriculum the rows are unchanged; a
generator without one is refused at validation; a run reports its levels."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

pytest.importorskip("reasoning_gym")

from ppokit.cli import app
from ppokit.errors import UserError
from ppokit.spec import SpecError, load_spec
from ppokit.tasks.curriculum import Levels
from ppokit.tasks.reasoning_gym import ReasoningGym
from ppokit.tasks.reasoning_gym_entries import ReasoningGymParams
from ppokit.trainer.checkpoint.layout import rng_stem

pytestmark = pytest.mark.usefixtures("clean_registry")

FIELDS = ("dataset", "config", "size", "split", "instruction", "curriculum")


def stream(seed: int, dataset: str = "basic_arithmetic", **params: Any) -> Any:
    p = ReasoningGymParams(dataset=dataset, size=1000, **params)
    return ReasoningGym(**{k: getattr(p, k) for k in FIELDS})(seed)


def test_levels_rise_exactly_when_the_windowed_mean_reaches_the_threshold() -> None:
    levels = Levels({"a": 3, "b": 2}, threshold=0.5, window=2)
    rewards = [0.4, 0.6, 1.0, 0.0, 0.9, 0.0, 1.0, 1.0, 1.0, 1.0]
    # 0.4: one reward, fewer than the window; (0.4 + 0.6) / 2 = 0.5: a rises, the history
    # restarts; 1.0 alone: no; (1.0 + 0.0) / 2: b rises (b's last level); 0.9 alone, then
    # (0.9 + 0.0) / 2 = 0.45: no; (0.0 + 1.0) / 2: a rises to its last level; then every
    # attribute is at its last level: nothing rises
    raised = [levels.observe(r) for r in rewards]
    assert raised == [None, "a", None, "b", None, None, "a", None, None, None]
    assert levels.levels == {"a": 2, "b": 1} and levels.done()


def model(sizes: dict[str, int], threshold: float, window: int, rewards: list[float]) -> list[Any]:
    """What the levels do, restated: the rise of each round (or None)."""
    level, turn, since, out = dict.fromkeys(sizes, 0), 0, [], []
    for r in rewards:
        room = [a for a in sizes if level[a] < sizes[a] - 1]
        since.append(r)
        if room and len(since) >= window and sum(since[-window:]) / window >= threshold:
            names = list(sizes)
            order = names[turn:] + names[:turn]
            name = next(a for a in order if level[a] < sizes[a] - 1)
            level[name] += 1
            turn = (names.index(name) + 1) % len(names)
            since = []
            out.append(name)
        else:
            out.append(None)
    return out


sizes_st = st.dictionaries(st.sampled_from("abcd"), st.integers(1, 4), min_size=1)
rewards_st = st.lists(st.sampled_from([0.0, 0.25, 0.5, 0.75, 1.0]), max_size=40)


@settings(max_examples=60, deadline=None)
@given(sizes=sizes_st, threshold=st.sampled_from([0.0, 0.25, 0.5, 0.75, 1.0]),
       window=st.integers(1, 4), rewards=rewards_st)  # fmt: skip
def test_levels_rise_round_robin_and_never_past_the_last(
    sizes: dict[str, int], threshold: float, window: int, rewards: list[float]
) -> None:
    levels = Levels(sizes, threshold, window)
    raised = [levels.observe(r) for r in rewards]
    assert raised == model(sizes, threshold, window, rewards)
    assert all(0 <= levels.levels[a] <= n - 1 for a, n in sizes.items())
    assert sum(levels.levels.values()) == sum(r is not None for r in raised)


@settings(max_examples=40, deadline=None)
@given(sizes=sizes_st, window=st.integers(1, 4), rewards=rewards_st, cut=st.integers(0, 40))
def test_levels_resumed_from_their_state_move_as_the_uninterrupted_ones(
    sizes: dict[str, int], window: int, rewards: list[float], cut: int
) -> None:
    whole = Levels(sizes, 0.5, window)
    expected = [whole.observe(r) for r in rewards]
    first = Levels(sizes, 0.5, window)
    got = [first.observe(r) for r in rewards[:cut]]
    resumed = Levels(sizes, 0.5, window)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    got += [resumed.observe(r) for r in rewards[cut:]]
    assert got == expected and resumed.state_dict() == whole.state_dict()


def test_a_state_of_other_attributes_is_one_line() -> None:
    with pytest.raises(UserError, match="does not fit"):
        Levels({"a": 2}, 0.5, 1).load_state_dict({"levels": {"b": 0}, "turn": 0, "history": []})
    with pytest.raises(UserError, match="out of range"):
        Levels({"a": 2}, 0.5, 1).load_state_dict({"levels": {"a": 2}, "turn": 0, "history": []})


def rounds(source: Any, rewards: list[float], per_round: int = 3) -> list[Any]:
    """Each round: its rows, then the source hears its reward."""
    out = []
    for i, reward in enumerate(rewards):
        out.append(source.next_rows(per_round))
        out.append(source.observe(i + 1, reward))
    return out


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**40), cut=st.integers(0, 8),
       rewards=st.lists(st.sampled_from([0.0, 1.0]), min_size=8, max_size=8))  # fmt: skip
def test_a_stream_resumed_mid_curriculum_draws_the_uninterrupted_rows(
    seed: int, cut: int, rewards: list[float]
) -> None:
    curriculum = {"threshold": 0.5, "window": 2}
    whole = rounds(stream(seed, curriculum=curriculum), rewards)
    first = stream(seed, curriculum=curriculum)
    before = rounds(first, rewards[:cut])
    resumed = stream(0, curriculum=curriculum)
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    assert before + rounds(resumed, rewards[cut:]) == whole


def test_rows_follow_the_levels_and_name_their_configuration() -> None:
    source = stream(3, curriculum={"threshold": 0.5, "window": 1})
    first = source.next_rows(20)
    assert {json.loads(r["entry"])["config"]["max_terms"] for r in first} == {2}
    assert source.observe(1, 0.2) == {"curriculum/num_terms": 0.0, "curriculum/num_digits": 0.0}
    assert source.observe(2, 0.9) == {"curriculum/num_terms": 1.0, "curriculum/num_digits": 0.0}
    rows = source.next_rows(20)
    entries = [json.loads(r["entry"]) for r in rows]
    assert {e["config"]["max_terms"] for e in entries} == {3}  # level 1: 2 to 3 terms
    assert {r["metadata"]["num_terms"] for r in rows} == {2, 3}
    import reasoning_gym  # the reward rebuilds each entry from its configuration

    for row, e in zip(rows, entries, strict=True):
        data = reasoning_gym.create_dataset(
            e["dataset"], seed=e["seed"], size=e["size"], **e["config"]
        )
        assert data[e["index"]]["question"] == row["question"]


def test_without_a_curriculum_the_rows_are_unchanged() -> None:
    out: list[Any] = []
    for dataset, split in (("basic_arithmetic", "train"), ("chain_sum", "test")):
        source = stream(7, dataset, split=split)
        out += source.next_rows(6)
        out.append(source.state_dict())
        assert source.observe(1, 1.0) == {}
    digest = hashlib.sha256(json.dumps(out, sort_keys=True).encode()).hexdigest()
    # the rows and the state of the source before curricula existed
    assert digest == "1a8d74e895602cd4deee96b56a9daeab68070808a286738a8639ff54eb3a89a1"


def test_a_generator_without_a_curriculum_is_one_line_at_validation() -> None:
    with pytest.raises(SpecError) as raised:
        load_spec(None, ["task=rg_gsm_symbolic", "data.source.curriculum={window: 2}"])
    (line,) = raised.value.errors
    assert "no curriculum for 'gsm_symbolic'" in line and "\n" not in line
    result = CliRunner().invoke(
        app, ["validate", "rg_gsm_symbolic", "--set", "data.source.curriculum={window: 2}"]
    )
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "no curriculum" in result.output


def test_a_config_field_the_curriculum_sets_is_refused() -> None:
    with pytest.raises(SpecError, match="min_terms"):
        load_spec(
            None,
            [
                "task=rg_basic_arithmetic",
                "data.source.curriculum={window: 2}",
                "data.source.config={min_terms: 3}",
            ],
        )


def test_a_run_reports_its_levels_rising(tmp_path: Path) -> None:
    out = tmp_path / "r"
    result = CliRunner().invoke(
        app,
        [
            "train",
            "--set",
            "task=rg_basic_arithmetic",
            "--set",
            "data.source.curriculum={threshold: 0.0, window: 1}",
            "--smoke",
            "--out",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    levels = [
        (r["curriculum/num_terms"], r["curriculum/num_digits"]) for r in lines if r["round"] > 0
    ]
    assert levels == [(1.0, 0.0), (1.0, 1.0)]
    saved = (out / "checkpoint" / f"{rng_stem(0)}.json").read_text()  # the source's state
    assert '"levels": {"num_terms": 1, "num_digits": 1}' in saved
