"""The reasoning_gym prompt source, reward and tasks: the held-out split never meets the
training stream, a resumed stream continues exactly, ppokit's reward agrees with
reasoning-gym's checker, and a task trains through the CLI."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

pytest.importorskip("reasoning_gym")

from ppokit.cli import app
from ppokit.data import make_prompt_source
from ppokit.errors import UserError
from ppokit.spec import load_spec
from ppokit.tasks import REASONING_GYM_TASKS
from ppokit.tasks.reasoning_gym import ReasoningGym, ReasoningGymReward, held_out
from ppokit.tasks.reasoning_gym_entries import ReasoningGymParams
from ppokit.trainer.evaluation import eval_rows, eval_seed

pytestmark = pytest.mark.usefixtures("clean_registry")


def stream(dataset: str, seed: int, split: str = "train", **config: Any) -> Any:
    params = ReasoningGymParams(dataset=dataset, config=config, split=split, size=1000)
    return ReasoningGym(**params.model_dump())(seed)


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**40), dataset=st.sampled_from(sorted(REASONING_GYM_TASKS)))
def test_a_tasks_held_out_prompts_never_appear_in_its_training_stream(
    seed: int, dataset: str
) -> None:
    spec = load_spec(None, [f"task=rg_{dataset}", f"seed={seed}", "eval.prompts=12"])
    held = eval_rows(spec)
    train = make_prompt_source(spec.data, spec.seed).next_rows(40)
    assert {r["prompt"] for r in held}.isdisjoint(r["prompt"] for r in train)
    assert all(held_out(r["question"]) for r in held)
    assert not any(held_out(r["question"]) for r in train)
    assert eval_seed(seed) != seed


def test_a_small_configuration_still_splits_by_the_question() -> None:
    # chain_sum with one-digit terms has few distinct questions: both splits draw from them,
    # and no question is in both
    train = {
        r["question"]
        for r in stream(
            "chain_sum", 1, min_terms=2, max_terms=2, min_digits=1, max_digits=1
        ).next_rows(300)
    }
    test = {
        r["question"]
        for r in stream(
            "chain_sum", 1, "test", min_terms=2, max_terms=2, min_digits=1, max_digits=1
        ).next_rows(300)
    }
    assert train and test and train.isdisjoint(test)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**40), cut=st.integers(0, 12), back=st.integers(0, 3))
def test_a_stream_resumed_mid_run_continues_exactly(seed: int, cut: int, back: int) -> None:
    whole = stream("chain_sum", seed).next_rows(16)
    first = stream("chain_sum", seed)
    first.next_rows(cut + back)
    first.put_back(back)
    state = json.loads(json.dumps(first.state_dict()))
    resumed = stream("chain_sum", 0)
    resumed.load_state_dict(state)
    assert resumed.next_rows(16 - cut) == whole[cut:]


def test_a_checkpoint_of_another_generator_is_refused() -> None:
    state = stream("countdown", 3).state_dict()
    with pytest.raises(UserError, match="countdown"):
        stream("chain_sum", 3).load_state_dict(state)


def test_rows_are_json_and_state_the_answers_form() -> None:
    for dataset in REASONING_GYM_TASKS:
        row = stream(dataset, 5).next_rows(1)[0]
        assert json.loads(json.dumps(row)) == row
        assert row["prompt"].startswith(row["question"].rstrip())
        assert "<answer>" in row["prompt"]


@pytest.mark.parametrize("dataset", [*REASONING_GYM_TASKS, "arc_1d", "word_ladder"])
def test_the_reward_agrees_with_reasoning_gyms_checker(dataset: str) -> None:
    import reasoning_gym

    rows = stream(dataset, 11).next_rows(4)
    entry = json.loads(rows[0]["entry"])
    data = reasoning_gym.create_dataset(
        dataset, seed=entry["seed"], size=entry["size"], **entry["config"]
    )
    reward = ReasoningGymReward(field="entry", tag="answer")
    responses, entries, expected = [], [], []
    for row in rows:
        original = data[json.loads(row["entry"])["index"]]
        assert original["question"] == row["question"]
        for answer in (row["answer"], "", "0", f"{row['answer']} 1", rows[0]["answer"]):
            responses.append(f"thinking... <answer>{answer}</answer>")
            entries.append(row["entry"])
            expected.append(float(data.score_answer(answer, original)))
        responses.append("no tags")
        entries.append(row["entry"])
        expected.append(float(data.score_answer(None, original)))
    scored = reward(["p"] * len(responses), responses, entry=entries)
    assert scored.scores == pytest.approx(expected)
    assert 1.0 in expected and any(e < 1 for e in expected)
    assert scored.flags["unparsed"] == [r == "no tags" for r in responses]


def test_an_unknown_generator_is_one_line_naming_the_close_one() -> None:
    with pytest.raises(UserError, match="countdown"):
        stream("countdwn", 0)


def test_any_generator_by_name_through_the_generic_task() -> None:
    spec = load_spec(None, ["task=reasoning_gym", "data.source.dataset=puzzle24"])
    assert eval_rows(spec.model_copy(update={"eval": spec.eval.model_copy(update={"prompts": 2})}))[
        0
    ]["prompt"].startswith("Make 24")
    assert spec.eval.data.options["dataset"] == "puzzle24"


def test_a_reasoning_gym_task_trains_through_the_cli(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        app, ["train", "--set", "task=rg_countdown", "--smoke", "--out", str(tmp_path / "r")]
    )
    assert result.exit_code == 0, result.output
