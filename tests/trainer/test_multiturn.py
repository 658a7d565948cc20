"""Multi-turn rollouts (``rollout.environment``): episodes played turn by turn on the engine,
the environment's tokens in the batch but outside every training mask, turn rewards where
they happen, GAE across turns, the built-in environments, and the echo game learning."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from ppokit import ops
from ppokit.batch import RolloutBatch
from ppokit.components.environment.impl import Calculator, Echo, evaluate
from ppokit.components.rollout_engine import Generation, Sampling
from ppokit.environments import ENDS, Step
from ppokit.errors import ComponentError, ComponentTimeout
from ppokit.spec import SpecError
from ppokit.trainer.assembly import CheckedEnvironment, Where
from ppokit.trainer.episodes import Sampler
from ppokit.trainer.metrics import read_once
from tests.helpers.trainer import Trainee, learner, small_spec

MULTI = ["data.options.turns=3", "rollout.environment=echo", "reward=[]"]


# ------------------------------------------------------------------ a scripted episode
@dataclass
class Script:
    """An engine that answers turn k with ``turns[k]`` (then EOS), recording each context
    it was given; log μ of every token -0.5."""

    tokenizer: Any
    turns: list[str]
    eos: int
    contexts: list[list[str]] = field(default_factory=list)
    calls: int = 0

    def start(self, context: Any) -> None: ...

    def generate(self, ids: Tensor, mask: Tensor, sampling: Sampling) -> Generation:
        seen = [
            self.tokenizer.decode(row[m.bool()].tolist(), skip_special_tokens=False)
            for row, m in zip(ids, mask, strict=True)
        ]
        self.contexts.append(seen)
        text = self.turns[self.calls]
        self.calls += 1
        tokens = [*self.tokenizer(text, add_special_tokens=False)["input_ids"], self.eos]
        tokens = tokens[: sampling.max_new_tokens]
        out = torch.tensor([tokens] * ids.shape[0])
        ended = tokens[-1] == self.eos
        return Generation(
            out,
            torch.ones_like(out, dtype=torch.bool),
            torch.full((ids.shape[0],), not ended),
            torch.full(out.shape, -0.5),
        )


class Scripted:
    """Observation ``<k>`` after turn k, reward k + 1; row 0 says done after turn 1, row 1
    never does."""

    def reset(self, row: dict[str, Any]) -> str | None:
        row["seen"] = []
        return "|" if row["prompt"].endswith("b") else None

    def step(self, row: dict[str, Any], response: str, turn: int) -> Step:
        row["seen"].append(response)
        return Step(f"<{turn}>", float(turn + 1), done=row["id"] == 0 and turn == 1)


def _sampler(lrn: Trainee, engine: Any, env: Any, **changes: Any) -> Sampler:
    rollout = lrn.setup.spec.rollout.model_copy(update=changes)
    checked = CheckedEnvironment(Where("rollout.environment", "scripted", "test"), env, None)
    return Sampler(engine, checked, lrn.setup.encode, lrn.setup.models.tokenizer, rollout)


def _ids(lrn: Trainee, text: str) -> list[int]:
    return list(lrn.setup.models.tokenizer(text, add_special_tokens=False)["input_ids"])


def test_an_episode_is_the_model_turns_and_the_observations_in_order(tmp_path) -> None:
    lrn = learner(small_spec(tmp_path))
    tok = lrn.setup.models.tokenizer
    eos = tok.eos_token_id
    engine = Script(tok, ["ab", "c", "de", "f"], eos)
    rows = [{"prompt": "echo a", "id": 0}, {"prompt": "echo b", "id": 1}]
    sampler = _sampler(lrn, engine, Scripted(), max_turns=3, max_new_tokens=4)
    ro = sampler(
        rows, [r["prompt"] for r in rows], lrn.setup.spec.data, Sampling(n=1, max_new_tokens=4)
    )

    assert ro.env_mask is not None and ro.turn_rewards is not None
    assert ro.turns is not None and ro.ended is not None
    model, env = ro.response_mask, ro.env_mask
    assert not (model & env).any()
    # row 0: ab</s> <0> c</s> (done); row 1: ab</s> <0> c</s> <1> de</s> (max_turns)
    expect = {
        0: [("ab", True), ("<0>", False), ("c", True)],
        1: [("ab", True), ("<0>", False), ("c", True), ("<1>", False), ("de", True)],
    }
    for row, pieces in expect.items():
        ids: list[int] = []
        is_model: list[bool] = []
        for text, by_model in pieces:
            piece = _ids(lrn, text) + ([eos] if by_model else [])
            ids += piece
            is_model += [by_model] * len(piece)
        n = len(ids)
        assert ro.response_ids[row, :n].tolist() == ids
        assert model[row, :n].tolist() == is_model
        assert env[row, :n].tolist() == [not m for m in is_model]
        assert not ro.present[row, n:].any()
        # log μ on the model's tokens only; each turn's reward on its last token
        logp = ro.logp_rollout
        assert logp is not None
        assert logp[row].tolist()[:n] == [-0.5 if m else 0.0 for m in is_model]
        ends = [i for i in range(n) if is_model[i] and (i + 1 == n or not is_model[i + 1])]
        rewards = ro.turn_rewards[row]
        assert rewards[ends].tolist() == [float(k + 1) for k in range(len(ends))]
        assert rewards.sum().item() == sum(range(1, len(ends) + 1))
    assert ro.turns.tolist() == [2, 3]
    assert [ENDS[e] for e in ro.ended.tolist()] == ["done", "max_turns"]
    assert ro.truncated.tolist() == [False, True]  # not ended by the environment
    # the opening follows the prompt; each turn sees the prompt and the transcript so far
    assert engine.contexts[0] == ["echo a", "echo b|"]
    assert engine.contexts[1] == ["echo aab</s><0>", "echo b|ab</s><0>"]
    assert engine.contexts[2] == ["echo b|ab</s><0>c</s><1>"]  # row 0 is done


def test_the_default_budget_is_every_turn_and_observation(tmp_path) -> None:
    rollout = small_spec(tmp_path, *MULTI, "rollout.max_turns=3").rollout
    turn, obs = rollout.max_new_tokens, rollout.max_observation_tokens
    assert rollout.episode_budget() == 3 * turn + 2 * obs
    assert rollout.episode_budget(10, markup=5) == 3 * 10 + 2 * (obs + 5)
    fixed = rollout.model_copy(update={"max_episode_tokens": 7})
    assert fixed.episode_budget(10, markup=5) == 7


def test_the_budget_ends_an_episode_and_cuts_a_turn(tmp_path) -> None:
    lrn = learner(small_spec(tmp_path))
    tok = lrn.setup.models.tokenizer
    rows = [{"prompt": "echo a", "id": 1}]
    # 3 + 3 observation tokens, then a turn of 2 of its 4 tokens: 8
    engine = Script(tok, ["ab", "cde", "fgh"], tok.eos_token_id)
    sampler = _sampler(lrn, engine, Scripted(), max_turns=4, max_episode_tokens=8)
    ro = sampler(rows, ["echo a"], lrn.setup.spec.data, Sampling(n=1, max_new_tokens=4))
    assert ro.present.sum().item() == 8
    assert ro.ended is not None and ENDS[int(ro.ended[0])] == "budget"
    assert ro.truncated.tolist() == [True]
    # an observation that would leave no room for a token ends it before the observation
    engine = Script(tok, ["ab", "c"], tok.eos_token_id)
    sampler = _sampler(lrn, engine, Scripted(), max_turns=4, max_episode_tokens=6)
    ro = sampler(rows, ["echo a"], lrn.setup.spec.data, Sampling(n=1, max_new_tokens=4))
    assert ro.present.sum().item() == 3 and ro.env_mask is not None and not ro.env_mask.any()
    assert ro.ended is not None and ENDS[int(ro.ended[0])] == "budget"


def test_an_observation_is_a_chat_message_when_the_data_uses_a_template(tmp_path) -> None:
    spec = small_spec(tmp_path, "data.chat_template=true")
    lrn = learner(spec)
    tok = lrn.setup.models.tokenizer
    tok.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    engine = Script(tok, ["ab", "c"], tok.eos_token_id)
    rows = [{"prompt": "echo a", "id": 0}]
    for role in ("user", "tool"):
        engine.calls = 0
        sampler = _sampler(lrn, engine, Scripted(), max_turns=2, observation_role=role)
        ro = sampler(rows, ["P"], spec.data, Sampling(n=1, max_new_tokens=4))
        text = tok.decode(ro.response_ids[0][ro.present[0]].tolist(), skip_special_tokens=False)
        # after the turn's EOS the template's newline, then the message and the next turn
        assert text == f"ab</s>\n<{role}><0></s>\n<assistant>c</s>"
    # a turn cut before EOS is closed by the whole of the template's closing
    engine = Script(tok, ["abcdef", "c"], tok.eos_token_id)
    sampler = _sampler(lrn, engine, Scripted(), max_turns=2)
    ro = sampler(rows, ["P"], spec.data, Sampling(n=1, max_new_tokens=3))
    text = tok.decode(ro.response_ids[0][ro.present[0]].tolist(), skip_special_tokens=False)
    assert text == "abc</s>\n<user><0></s>\n<assistant>c</s>"


def test_a_broken_environment_is_one_line_naming_it(tmp_path) -> None:
    lrn = learner(small_spec(tmp_path))
    tok = lrn.setup.models.tokenizer

    class Broken(Scripted):
        def __init__(self, out: Any) -> None:
            self.out = out

        def step(self, row: dict[str, Any], response: str, turn: int) -> Any:
            if isinstance(self.out, Exception):
                raise self.out
            return self.out

    cases = {
        "returned a str: expected a Step": "text",
        "the reward nan": Step("x", math.nan),
        "done=1": Step("x", 0.0, 1),  # type: ignore[arg-type]
        "failed in step: KeyError": KeyError("board"),
    }
    for expected, out in cases.items():
        engine = Script(tok, ["ab", "c"], tok.eos_token_id)
        sampler = _sampler(lrn, engine, Broken(out))
        with pytest.raises(ComponentError) as info:
            sampler([{"prompt": "a", "id": 1}], ["a"], lrn.setup.spec.data, Sampling(n=1))
        message = str(info.value)
        assert "\n" not in message and message.startswith("rollout.environment (scripted")
        assert expected in message, message


class Slow(Scripted):
    """An environment whose step holds the interpreter in C code for minutes."""

    def step(self, row: dict[str, Any], response: str, turn: int) -> Step:
        import re

        re.fullmatch(r"(a+)+$", "a" * 40 + "b")  # exponential backtracking, in C
        return Step(None)


def test_an_environment_that_hangs_is_stopped_at_its_timeout(tmp_path) -> None:
    lrn = learner(small_spec(tmp_path))
    checked = CheckedEnvironment(Where("rollout.environment", "slow", "test"), Slow(), 0.5)
    assert checked.pool is not None
    checked.pool.start()
    (pid,) = checked.pool.pids
    engine = Script(lrn.setup.models.tokenizer, ["ab"], lrn.setup.models.tokenizer.eos_token_id)
    sampler = Sampler(
        engine, checked, lrn.setup.encode, lrn.setup.models.tokenizer, lrn.setup.spec.rollout
    )
    with pytest.raises(ComponentTimeout, match=r"rollout\.environment_timeout \(0\.5 s\)"):
        sampler([{"prompt": "a"}], ["a"], lrn.setup.spec.data, Sampling(n=1))
    assert checked.pool.pids == [None]  # its process was killed, and is gone
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    checked.close()


# ------------------------------------------------------------------ a round with the echo game
def test_a_round_keeps_the_environment_out_of_every_training_mask(tmp_path) -> None:
    spec = small_spec(tmp_path, *MULTI, "kl.estimator=k3", "kl.coef=0.1", "rollout.n=4")
    lrn = learner(spec)
    from ppokit.data import make_prompt_source

    rows = make_prompt_source(spec.data, 0).next_rows(spec.rollout.prompts_per_round)
    assert all(len(r["symbols"]) == 3 and r["symbols"][0] == r["answer"] for r in rows)
    data, result = lrn.collect(rows, [r["prompt"] for r in rows])
    assert data is not None
    batch, ro = data.batch, data.rollout
    assert batch.env_mask is not None and torch.equal(batch.env_mask, ro.env_mask)
    env = batch.env_mask
    assert env.any() and not (env & batch.response_mask).any()
    assert not (data.actor_mask & env).any()
    assert data.value_mask is not None and not (data.value_mask.bool() & env).any()
    for x in (batch.token_rewards, batch.values, batch.logp_old, batch.logp_ref, data.advantages):
        assert x is not None and not x[env].any()
    # three turns, each scored where it ends: R is the sum of the turn rewards
    assert ro.turns is not None and ro.turns.eq(3).all()
    torch.testing.assert_close(batch.scores, result.scores)
    metrics = read_once(result.metrics)
    assert metrics["rollout/turns_mean"] == 3.0
    assert metrics["rollout/ended_done"] == 1.0
    assert metrics["rollout/env_tokens_mean"] == len("\necho x") * 2
    # the samples are whole transcripts
    assert all(text.count("\necho ") == 2 for text in result.responses)


def test_the_evaluation_plays_episodes(tmp_path) -> None:
    """Greedy and sampled episodes of the echo game, scored by their turn rewards; every
    turn of every episode reaches the environment."""
    from ppokit.trainer.evaluation import Evaluator

    spec = small_spec(tmp_path, *MULTI, "eval.prompts=6", "eval.k=[1,2]", "eval.correct_at=0.3")
    lrn = learner(spec)
    evaluator = Evaluator.of(spec, lrn.setup)
    assert all("symbols" in row for row in evaluator.rows)
    calls: list[int] = []
    steps = lrn.setup.assembly.environment.steps

    def counted(rows: list[dict[str, Any]], responses: list[str], turn: int) -> list[Step]:
        calls.extend([turn] * len(rows))
        return steps(rows, responses, turn)

    lrn.setup.assembly.environment.steps = counted  # type: ignore[method-assign]
    metrics = evaluator.run()
    # 6 prompts x (1 greedy + 2 sampled) episodes of 3 turns each
    assert sorted(calls) == sorted([0, 1, 2] * 6 * 3)
    assert metrics["eval/prompts"] == 6.0
    reward = metrics["eval/reward_mean"]
    assert reward is not None and 0.0 <= reward <= 1.0


def test_no_reward_needs_an_environment(tmp_path) -> None:
    with pytest.raises(SpecError, match="reward: give at least one reward"):
        small_spec(tmp_path, "reward=[]")
    lrn = learner(small_spec(tmp_path, "rollout.environment=echo", "reward=[]"))
    with pytest.raises(ComponentError, match=r"failed in reset: .* 'symbols' column"):
        lrn.collect([{"prompt": "echo a", "answer": "a"}], ["echo a"])
    with pytest.raises(SpecError, match=r"rollout\.environment: unknown environment 'ecko'"):
        small_spec(tmp_path, "rollout.environment=ecko")


# ------------------------------------------------------------------ GAE across turns
@st.composite
def episodes(draw: st.DrawFn) -> tuple[RolloutBatch, Tensor]:
    """Rows of alternating model turns and observations (each 1-4 tokens), padding after;
    turn rewards on the turns' last tokens, random values and terminal values."""
    b = draw(st.integers(1, 4))
    rows = []
    for _ in range(b):
        turns = draw(st.integers(1, 4))
        spans: list[tuple[bool, int]] = []
        for k in range(turns):
            spans.append((True, draw(st.integers(1, 4))))
            if k + 1 < turns:
                spans.append((False, draw(st.integers(1, 4))))
        rows.append(spans)
    t = max(sum(n for _, n in spans) for spans in rows) + draw(st.integers(0, 2))
    model = torch.zeros(b, t, dtype=torch.bool)
    env = torch.zeros(b, t, dtype=torch.bool)
    rewards = torch.zeros(b, t)
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    for i, spans in enumerate(rows):
        at = 0
        for by_model, n in spans:
            (model if by_model else env)[i, at : at + n] = True
            if by_model:
                rewards[i, at + n - 1] = float(torch.randn((), generator=g))
            at += n
    values = torch.randn(b, t, generator=g) * model
    batch = RolloutBatch(
        response_mask=model,
        token_rewards=rewards,
        values=values,
        truncated=torch.rand(b, generator=g) < 0.5,
        bootstrap_values=torch.randn(b, generator=g),
        env_mask=env,
    )
    return batch, env


def _gae_loop(batch: RolloutBatch, gamma: float, lam: float) -> Tensor:
    """GAE by a per-step loop over each row's model positions, the environment's skipped."""
    assert batch.values is not None
    out = torch.zeros_like(batch.token_rewards, dtype=torch.float64)
    for i in range(batch.batch_size):
        steps = batch.response_mask[i].nonzero().flatten().tolist()
        nxt = float(batch.terminal_values[i])
        running = 0.0
        for t in reversed(steps):
            v = float(batch.values[i, t])
            delta = float(batch.token_rewards[i, t]) + gamma * nxt - v
            running = delta + gamma * lam * running
            out[i, t] = running
            nxt = v
    return out


@settings(max_examples=60, deadline=None)
@given(episodes(), st.sampled_from([1.0, 0.99, 0.9]), st.sampled_from([1.0, 0.95, 0.0]))
def test_gae_on_a_multi_turn_row_skips_the_environment(
    case: tuple[RolloutBatch, Tensor], gamma: float, lam: float
) -> None:
    batch, env = case
    adv = ops.gae(batch, gamma, lam)
    torch.testing.assert_close(adv.double(), _gae_loop(batch, gamma, lam), atol=1e-5, rtol=1e-5)
    assert not adv[env].any()
    # the environment's tokens change nothing: the same rows without them, compacted
    if lam == 1.0:  # telescoping across turns: A_t = Σ γ^j r_{t+j} + γ^m V_end − V_t
        assert batch.values is not None
        for i in range(batch.batch_size):
            steps = batch.response_mask[i].nonzero().flatten().tolist()
            r = batch.token_rewards[i, steps].double()
            for j, t in enumerate(steps):
                ahead = r[j:]
                powers = gamma ** torch.arange(len(ahead), dtype=torch.float64)
                ret = (powers * ahead).sum() + gamma ** len(ahead) * float(batch.terminal_values[i])
                expected = ret - float(batch.values[i, t])
                assert abs(float(adv[i, t]) - float(expected)) < 1e-4


# ------------------------------------------------------------------ built-in environments
def test_the_calculator_evaluates_exact_arithmetic_and_nothing_else() -> None:
    assert evaluate("2+3*4") == "14"
    assert evaluate(" (1 + 2) * -3 ") == "-9"
    assert evaluate("7/2") == "3.5"
    assert evaluate("1/3") == "0.333333"
    assert evaluate("2**10 // 3 % 7") == str(2**10 // 3 % 7)
    assert evaluate("0.1 + 0.2") == "0.3"  # exact rationals, not floats
    for bad in ("__import__('os')", "x + 1", "2**1000", "9**9**9", "1/0", "3 % 0", "[1]", ""):
        with pytest.raises(ValueError):
            evaluate(bad)
    calc = Calculator(open="<calc>", close="</calc>", max_length=20, open_first=False)
    assert calc.step({}, "the answer is 5", 0) == Step(None, 0.0, True)
    assert calc.step({}, "<calc>1+1</calc> and <calc>6*7</calc>", 0) == Step("Result: 42")
    assert calc.step({}, "<calc>a</calc>", 0).observation.startswith("Error: only numbers")
    assert calc.step({}, f"<calc>{'1+' * 20}1</calc>", 0).observation.startswith("Error: an")
    assert calc.step({}, "<calc>1+1", 0).done  # an unclosed call is no call
    assert calc.reset({}) is None
    first = Calculator(open="<calc>", close="</calc>", max_length=20, open_first=True)
    assert first.reset({}) == "<calc>"  # the first turn continues the opened call
    assert first.step({}, "6*7</calc>", 0) == Step("Result: 42")
    assert first.step({}, "6*7</calc>", 1).done  # later turns open their own calls


def test_the_echo_game_scores_each_turn_on_its_symbol() -> None:
    echo = Echo(field="symbols")
    row = {"prompt": "echo a", "symbols": "abc"}
    assert echo.reset(row) is None
    assert echo.step(row, "aaxa", 0) == Step("\necho b", 0.75 / 3)
    assert echo.step(row, "bbbb", 1) == Step("\necho c", 1 / 3)
    assert echo.step(row, "zzzz", 2) == Step(None, 0.0, True)
    with pytest.raises(ValueError, match="symbols"):
        echo.reset({"prompt": "echo a"})


@pytest.mark.slow
def test_the_echo_game_learns_on_the_demo_model(tmp_path) -> None:
    """Above what ignoring the observations can score (1/3 + 2/3 · 1/4 = 0.5)."""
    from ppokit import train
    from ppokit.runfolder import read_metrics
    from ppokit.spec import load_spec

    root = Path(__file__).resolve().parents[2]
    spec = load_spec(
        root / "examples" / "specs" / "echo_multiturn.yaml",
        [f"output.dir={tmp_path}", "train.rounds=60", "output.progress=false"],
    )
    train(spec)
    history = read_metrics(tmp_path)
    late = [h["reward_mean"] for h in history[-10:]]
    assert sum(late) / len(late) > 0.6
    assert history[0]["reward_mean"] < 0.2


# ------------------------------------------------------------------ state across episodes
class Counting:
    """Keeps the number of episodes it has seen on ``self`` (state across episodes, in its
    worker process), and checkpoints it: each turn's reward is that count's last digit."""

    def __init__(self) -> None:
        self.episodes = 0

    def reset(self, row: dict[str, Any]) -> str | None:
        self.episodes += 1
        row["episode"] = self.episodes
        return None

    def step(self, row: dict[str, Any], response: str, turn: int) -> Step:
        return Step(None, float(row["episode"] % 10), True)

    def state_dict(self) -> dict[str, Any]:
        return {"episodes": self.episodes}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.episodes = int(state["episodes"])


def test_the_environments_state_is_checkpointed(use_registry, tmp_path: Path) -> None:
    from ppokit.trainer.loop import train
    from ppokit.trainer.metrics import TIMING, read_metrics
    from tests.helpers import Plugin

    use_registry(Plugin().add("environment", "counting", Counting, summary="counts"))
    sets = ["rollout.environment=counting", "reward=[]", "output.save_every=1"]

    def rewards(out: Path) -> list[Any]:
        return [
            {k: v for k, v in h.items() if k not in TIMING and k != "time_round"}
            for h in read_metrics(out)
        ]

    train(small_spec(tmp_path / "whole", *sets, "train.rounds=2"))
    train(small_spec(tmp_path / "cut", *sets, "train.rounds=1"))
    train(small_spec(tmp_path / "cut", *sets, "train.rounds=2"), resume=True)
    whole, cut = rewards(tmp_path / "whole"), rewards(tmp_path / "cut")
    assert whole[1]["reward_mean"] != whole[0]["reward_mean"]  # the state changes the reward
    assert cut == whole
