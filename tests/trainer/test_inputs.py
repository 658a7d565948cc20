"""Inputs that are not aliases: a reward that edits its inputs in place changes nothing
another reward, a group filter or the samples see (each gets its own copies, in a worker
process or here); an episode's row is a deep copy of the data row; data columns cannot
shadow what the trainer passes a reward (a clash is one line, and TRL's names always mean
the model's output); rewards score the model's own text, with the transcript as a field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from ppokit.components.reward import RESERVED_FIELDS
from ppokit.errors import UserError
from ppokit.trainer.assembly import Assembly
from ppokit.trainer.rollout import Rollout
from ppokit.trainer.scoring import Scorer
from tests.helpers import Plugin
from tests.helpers.trainer import learner, small_spec


def vandal(prompts: list[str], responses: list[str], **fields: Any) -> list[float]:
    """Edits every input it was given, in place."""
    responses[0] = "hacked"
    responses.append("more")
    prompts.clear()
    fields["answer"][0] = "forged"
    fields["nested"][0].append("x")
    return [0.0] * len(fields["lengths"])


def witness(prompts: list[str], responses: list[str], **fields: Any) -> list[float]:
    """1 for each response that reaches it as the model wrote it, with its data intact."""
    ok = len(prompts) == 2 and fields["answer"] == ["a", "b"] and fields["nested"] == [[], []]
    return [float(ok and r == f"r{i}") for i, r in enumerate(responses)]


@pytest.mark.parametrize("timeout", ["5", "null"])
def test_a_reward_that_edits_its_inputs_changes_nothing_for_others(use_registry, timeout) -> None:
    use_registry(
        Plugin()
        .add("reward", "vandal", lambda: vandal, summary="edits")
        .add("reward", "witness", lambda: witness, summary="sees")
    )
    spec = small_spec(None, "reward=[vandal, witness]", f"train.reward_timeout={timeout}")
    asm = Assembly.from_spec(spec)
    try:
        rows = [{"prompt": "p", "answer": a, "nested": []} for a in "ab"]
        responses = ["r0", "r1"]
        parts = (
            Scorer(asm, None, torch.device("cpu")).score(rows, responses, [1, 1], [False] * 2).parts
        )
    finally:
        asm.close()
    assert parts["witness"].tolist() == [1.0, 1.0]
    assert responses == ["r0", "r1"] and rows[0] == {"prompt": "p", "answer": "a", "nested": []}


def test_data_columns_cannot_shadow_what_a_reward_is_passed(tmp_path: Path) -> None:
    from ppokit.data import JsonlSource

    for column in RESERVED_FIELDS:
        data = tmp_path / f"{column}.jsonl"
        data.write_text(json.dumps({"prompt": "p", column: 1}) + "\n")
        with pytest.raises(UserError) as info:
            JsonlSource(0, data)
        assert f"the column {column!r} has the name of a field ppokit passes" in str(info.value)
    data.write_text('{"prompt": "p", "lengths": 1}\n')
    renamed = JsonlSource(0, data, columns={"n_tokens": "lengths"})  # mapped away: fine
    assert renamed.row(0) == {"prompt": "p", "n_tokens": 1}


def trl(prompts: list[str], completions: list[str], **kwargs: Any) -> list[float]:
    return [float(c == "model") for c in completions]


def test_a_column_named_completions_never_replaces_the_models_output(
    use_registry, tmp_path: Path
) -> None:
    code = tmp_path / "trl_reward.py"
    code.write_text(
        "def reward(prompts, completions, **kwargs):\n"
        "    return [float(c == 'model') for c in completions]\n"
    )
    from ppokit.components.reward.impl import PythonReward

    reward = PythonReward(function=f"{code}:reward")
    assert reward(["p"], ["model"], completions=["column"], lengths=[1]) == [1.0]
    asm = Assembly.from_spec(
        small_spec(None, f"reward={{name: python, function: '{code}:reward'}}")
    )
    try:
        scorer = Scorer(asm, None, torch.device("cpu"))
        with pytest.raises(UserError, match="data column 'completions' has the name"):
            scorer.score([{"prompt": "p", "completions": "x"}], ["model"], [1], [False])
    finally:
        asm.close()


def test_rewards_score_the_models_turns_and_may_ask_for_the_transcript(tmp_path: Path) -> None:
    lrn = learner(small_spec(tmp_path))
    tok = lrn.setup.models.tokenizer
    model, env = (tok(t, add_special_tokens=False)["input_ids"] for t in ("ab", "cd"))
    ids = torch.tensor([model + env + model])
    mask = torch.tensor([[True] * len(model) + [False] * len(env) + [True] * len(model)])
    env_mask = torch.tensor([[False] * len(model) + [True] * len(env) + [False] * len(model)])
    ro = Rollout(
        torch.ones(1, 1, dtype=torch.long),
        torch.ones(1, 1, dtype=torch.long),
        ids,
        mask,
        torch.zeros(1, dtype=torch.bool),
        None,
        env_mask=env_mask,
    )
    texts, lengths, _, transcripts = lrn.setup.scorer.decode(ro)
    assert texts == ["abab"] and transcripts == ["abcdab"]  # the environment's "cd" apart
    assert lengths == [2 * len(model)]


class Appends:
    """Appends to a list inside its episode's row (state of the episode, where it belongs)."""

    def __init__(self) -> None:
        self.lists: list[list[str]] = []

    def reset(self, row: dict[str, Any]) -> str | None:
        row["history"].append("reset")
        self.lists.append(row["history"])
        return None

    def step(self, row: dict[str, Any], response: str, turn: int) -> Any:
        from ppokit.environments import Step

        row["history"].append(response)
        return Step(None, float(len(row["history"])), True)


@pytest.mark.parametrize("timeout", [5.0, None])
def test_every_episode_gets_a_deep_copy_of_its_data_row(tmp_path: Path, timeout) -> None:
    from ppokit.components.rollout_engine import Sampling
    from ppokit.trainer.assembly import CheckedEnvironment, Where
    from ppokit.trainer.episodes import Sampler
    from tests.trainer.test_multiturn import Script

    lrn = learner(small_spec(tmp_path))
    tok = lrn.setup.models.tokenizer
    env = Appends()
    checked = CheckedEnvironment(Where("rollout.environment", "appends", "test"), env, timeout)
    sampler = Sampler(
        Script(tok, ["ab"], tok.eos_token_id),
        checked,
        lrn.setup.encode,
        tok,
        lrn.setup.spec.rollout,
    )
    rows = [{"prompt": "a", "history": []}]
    ro = sampler(rows, ["a"], lrn.setup.spec.data, Sampling(n=3))
    checked.close()
    assert rows == [{"prompt": "a", "history": []}]  # the data row is untouched
    assert ro.turn_rewards is not None
    assert ro.turn_rewards.sum(1).tolist() == [2.0, 2.0, 2.0]  # each episode its own list
    if timeout is None:
        assert len({id(x) for x in env.lists}) == 3
