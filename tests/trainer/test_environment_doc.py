"""docs/environments.md stays true: the plugin environment it prints registers and trains
multi-turn episodes on the demo model, its game is the one the page describes, a broken
environment is named in one line, and every spec snippet on the page validates."""

from __future__ import annotations

import itertools
import json
import random
import re
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from ppokit.environments import Step
from ppokit.errors import ComponentError
from ppokit.spec import load_spec
from ppokit.tasks.demo import make_row
from ppokit.trainer import train
from ppokit.trainer.metrics import read_metrics
from tests.helpers import module_from_page
from tests.helpers.trainer import learner, small_spec

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "environments.md"
#: The page's plugin spec, on the small demo model.
GUESS = [
    "rollout.environment=guess",
    "data.options={turns: 2}",
    "rollout.max_turns=3",
    "reward=[]",
]


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", PAGE.read_text(), re.S | re.M)


@pytest.fixture
def guess(use_registry, tmp_path, monkeypatch) -> Any:
    """The page's plugin, installed in the registry as plugin ``test0``."""
    module = module_from_page("environments.md", "ppokit_guess", tmp_path)
    monkeypatch.setitem(sys.modules, "ppokit_guess", module)
    use_registry(module)
    return module


def _rows(n: int) -> list[dict[str, Any]]:
    rng = random.Random(0)
    return [make_row(rng, turns=2) for _ in range(n)]


# ---------------------------------------------------------------------- the plugin trains
def test_the_documented_environment_trains(guess, tmp_path) -> None:
    out = tmp_path / "run"
    spec = small_spec(out, *GUESS, "train.rounds=3", "output.sample_every=1")
    summary = train(spec)
    assert summary["rounds"] == 3
    history = read_metrics(out)
    assert [h["round"] for h in history] == [1, 2, 3]
    for h in history:
        assert h["rollout/turns_mean"] > 1  # the game went on past the first guess
        assert h["rollout/env_tokens_mean"] > 0
        ends = [h[f"rollout/ended_{e}"] for e in ("done", "max_turns", "budget")]
        assert sum(ends) == pytest.approx(1.0)
        # the model's tokens only: at most max_turns turns of max_new_tokens
        assert 0 < h["response_length_mean"] <= 3 * 4
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert {s["round"] for s in samples} == {1, 2, 3}
    observation = re.compile(r"\n(higher|lower|guess): [abcd]*\n")
    for s in samples:
        assert re.fullmatch(r"echo [abcd]", s["prompt"])
        # a transcript: the environment's observations between the model's turns
        if s["reward"] < 1:
            assert observation.search(s["response"]), s
        assert s["reward"] in (0.0, 1.0)  # the turn reward: 1 for the right guess


def test_the_page_plays_the_documented_game(guess) -> None:
    env = guess.Guess(field="symbols", alphabet="abcd")
    # the printed episode: prompt echo b, secret d
    row = {"prompt": "echo b", "answer": "b", "symbols": "bd"}
    text = "echo b" + env.reset(row)
    for turn, answer in enumerate(["bbbb", "cccc", "dddd"]):
        step = env.step(row, answer, turn)
        assert isinstance(step, Step)
        text += answer + (step.observation or "")
    assert step == Step(None, 1.0, True)
    (printed,) = [b for b in _blocks("text") if b.startswith("echo b\n")]
    assert text == printed.rstrip("\n")
    assert row["guess_left"] == "d"  # the episode's state, in its row

    def play(secret: str, policy: Any, turns: int = 3) -> bool:
        row = {"symbols": "a" + secret}
        env.reset(row)
        # any() stops at the first done, as the episode does
        return any(env.step(row, policy(row, turn), turn).done for turn in range(turns))

    # three turns win every secret: b first, then the first symbol still possible
    assert all(play(s, lambda row, t: "b" if t == 0 else row["guess_left"][0]) for s in "abcd")
    # a policy that ignores the observations wins at most 3 of the 4 secrets
    for guesses in itertools.product("abcd", repeat=3):
        assert sum(play(s, lambda row, t, g=guesses: g[t]) for s in "abcd") <= 3
    # a response that is not a symbol is answered with the symbols still possible
    row = {"symbols": "ac"}
    env.reset(row)
    assert env.step(row, "  zz", 0) == Step("\nguess: abcd\n", 0.0, False)
    with pytest.raises(ValueError, match="'symbols' column"):
        env.reset({"prompt": "echo a"})


# ---------------------------------------------------------------------- broken environments
def _broken_step(mode: str) -> Any:
    def step(self: Any, row: dict[str, Any], response: str, turn: int) -> Any:
        if mode == "raise":
            raise RuntimeError("the game broke")
        if mode == "tuple":
            return ("higher", 0.0, False)
        if mode == "reward":
            return Step("\nhigher\n", float("nan"))
        if mode == "slow":
            time.sleep(1.0)
        return Step(None, 1.0, True)

    return step


@pytest.mark.parametrize(
    ("mode", "extra", "message"),
    [
        ("raise", [], r"failed in step: RuntimeError: the game broke"),
        ("tuple", [], r"returned a tuple: expected a Step\(observation"),
        ("reward", [], r"returned the reward nan: expected a finite number"),
        (
            "slow",
            ["rollout.environment_timeout=0.2"],
            r"did not return from step within rollout.environment_timeout \(0.2 s\)",
        ),
    ],
)
def test_a_broken_environment_is_named_in_one_line(
    guess, tmp_path, monkeypatch, mode: str, extra: list[str], message: str
) -> None:
    monkeypatch.setattr(guess.Guess, "step", _broken_step(mode))
    lrn = learner(small_spec(tmp_path, *GUESS, *extra))
    rows = _rows(4)
    with pytest.raises(ComponentError) as info:
        lrn.round(rows, [r["prompt"] for r in rows], round_no=1)
    text = str(info.value)
    assert text.startswith("rollout.environment (guess, plugin test0) "), text
    assert re.search(message, text), text
    assert "\n" not in text


def test_a_failing_reset_is_named_in_one_line(guess, tmp_path) -> None:
    # without data.options.turns the demo rows have no 'symbols' column: reset raises
    spec = small_spec(tmp_path, *[o for o in GUESS if not o.startswith("data.")])
    rng = random.Random(0)
    rows = [make_row(rng) for _ in range(4)]
    with pytest.raises(ComponentError) as info:
        learner(spec).round(rows, [r["prompt"] for r in rows], round_no=1)
    text = str(info.value)
    assert text.startswith("rollout.environment (guess, plugin test0) failed in reset: ")
    assert "ValueError: the 'symbols' column must end with one of 'abcd'" in text
    assert "\n" not in text


# ---------------------------------------------------------------------- the page's specs
def test_every_spec_snippet_on_the_page_validates(guess, tmp_path) -> None:
    snippets = [b for b in _blocks("yaml") if "rollout:" in b]
    assert len(snippets) >= 4  # the echo example, calculator, echo, the plugin's spec
    names = set()
    for i, text in enumerate(snippets):
        path = tmp_path / f"snippet{i}.yaml"
        path.write_text(text)
        spec = load_spec(path)
        names.add(spec.rollout.environment.name)
    assert names == {"echo", "calculator", "guess"}
    toml = next(b for b in re.findall(r"^```toml\n(.*?)^```", PAGE.read_text(), re.S | re.M))
    assert 'guess = "ppokit_guess"' in toml and "[project.entry-points.ppokit]" in toml
