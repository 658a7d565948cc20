"""Held-out evaluation: the metrics from known rewards, the prompts, determinism, RNG
isolation, and ``ppokit eval`` against the in-run evaluation at the same step."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import typer
from safetensors.torch import load_file
from typer.testing import CliRunner

from ppokit.errors import UserError
from ppokit.evaluate import eval_command, load_models, load_target
from ppokit.export import export_run
from ppokit.spec import Spec
from ppokit.stats import pass_at_k, wilson_half_width, wilson_interval
from ppokit.trainer import loop
from ppokit.trainer.evaluation import Evaluator, eval_rows, eval_seed, isolated_rng
from ppokit.trainer.metrics import TIMING, read_metrics
from ppokit.trainer.scoring import Scores
from tests.helpers import ROOT
from tests.helpers.trainer import learner, small_spec

#: A combined reward the untrained tiny model scores on about half the time (any lowercase
#: letter: +0.5), so the metrics compared below are not all 0.
REWARD = "reward=[demo, {name: regex, pattern: '[a-z]', weight: 0.5}]"
EVAL = [
    "eval.prompts=8",
    "eval.k=3",
    "eval.batch_size=4",
    "eval.every=1",
    "eval.correct_at=0.5",
    REWARD,
]
runner = CliRunner()


@pytest.fixture(autouse=True)
def one_thread() -> Any:
    """One CPU thread, as a run of the tiny model uses (more only contend on a busy CPU)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _spec(tmp: Path | None = None, *overrides: str) -> Spec:
    return small_spec(tmp, *EVAL, *overrides)


def _app() -> typer.Typer:
    app = typer.Typer()
    app.command("eval")(eval_command)

    @app.command("noop")
    def _noop() -> None:
        """A second command, so that ``eval`` is a subcommand as in ppokit's app."""

    return app


def _invoke(*args: str) -> Any:
    return runner.invoke(_app(), ["eval", *args])


def _write_spec(spec: Spec, path: Path) -> Path:
    path.write_text(spec.to_yaml())
    return path


class _Results(dict):
    """{round: metrics} of the hooked evaluations, and the run's actor."""

    actor: Any = None


def _hook_evaluation(monkeypatch: pytest.MonkeyPatch, spec: Spec) -> _Results:
    """Evaluate the run (its Setup, as the loop's own evaluation does) each time the loop
    saves a checkpoint, right after the round's update: {round: metrics}."""
    results = _Results()
    evaluators: list[Evaluator] = []
    run_round, save = loop.run_round, loop.save_checkpoint

    def round_hooked(setup: Any, *rest: Any, **kw: Any) -> Any:
        if not evaluators:
            evaluators.append(Evaluator.of(spec, setup))
            results.actor = setup.models.actor
        return run_round(setup, *rest, **kw)

    def save_hooked(
        out: Path, models: Any, state: Any, source: Any, done: int, yaml: str, *more: Any
    ) -> Any:
        results[done] = evaluators[0].run()
        return save(out, models, state, source, done, yaml, *more)

    monkeypatch.setattr(loop, "run_round", round_hooked)
    monkeypatch.setattr(loop, "save_checkpoint", save_hooked)
    return results


# --------------------------------------------------------------------------- statistics
def test_wilson_half_width_matches_the_textbook_interval() -> None:
    # 5 of 10: the Wilson 95% interval is [0.2366, 0.7634]
    assert wilson_half_width(5, 10) == pytest.approx((0.7634 - 0.2366) / 2, abs=1e-4)
    # 0 of 20: [0, 0.1611]; not 0 as the normal approximation would say
    assert wilson_half_width(0, 20) == pytest.approx(0.1611 / 2, abs=1e-4)
    assert wilson_half_width(20, 20) == pytest.approx(wilson_half_width(0, 20), abs=1e-12)
    assert math.isnan(wilson_half_width(0, 0))
    low, high = wilson_interval(0.5, 10)
    assert (low, high) == (pytest.approx(0.2366, abs=1e-4), pytest.approx(0.7634, abs=1e-4))
    low, high = wilson_interval(0.0, 20)
    assert low == 0.0 and high == pytest.approx(0.1611, abs=1e-4)


def test_eval_seed_is_fixed_and_differs_from_the_run_seed() -> None:
    assert eval_seed(0) == eval_seed(0) != eval_seed(1)
    assert 0 <= eval_seed(0) < 2**63 and eval_seed(0) != 0


def test_metrics_are_computed_from_the_combined_rewards(monkeypatch) -> None:
    spec = _spec(None, "eval.prompts=4", "eval.k=3", "eval.batch_size=2", "eval.correct_at=1.0")
    lrn = learner(spec)
    greedy = [1.0, 0.5, 1.2, 0.0]  # correct: 1, 0, 1, 0 (>= correct_at, equality counts)
    sampled = [[1.0, 0.25, 0.999], [0.0, 0.5, 0.75], [1.0, 1.5, 1.0], [0.0, 1.0, 0.0]]
    flat = iter(x for row in sampled for x in row)
    greedy_iter = iter(greedy)
    sampled_lengths: list[int] = []

    def score(rows, responses, lengths, truncated, checks=None):
        assert len(rows) == len(responses)
        if len(responses) == 2:  # a batch's greedy responses (batch_size 2)
            values = [next(greedy_iter) for _ in responses]
        else:  # its 2 x 3 samples
            assert len(responses) == 6
            values = [next(flat) for _ in responses]
            sampled_lengths.extend(lengths)
        return Scores(torch.tensor(values))

    monkeypatch.setattr(lrn.setup.scorer, "score", score)
    metrics = Evaluator.of(spec, lrn.setup).run()
    counts = [1, 0, 3, 1]
    assert metrics["eval/accuracy"] == 0.5
    assert metrics["eval/pass@3"] == pytest.approx(sum(pass_at_k(3, c, 3) for c in counts) / 4)
    assert metrics["eval/pass@3"] == 0.75  # n = k: a prompt passes when one sample is correct
    assert metrics["eval/accuracy_ci95"] == pytest.approx(wilson_half_width(2, 4))
    assert metrics["eval/reward_mean"] == pytest.approx(sum(map(sum, sampled)) / 12)
    assert metrics["eval/response_length_mean"] == pytest.approx(sum(sampled_lengths) / 12)
    assert metrics["eval/prompts"] == 4
    expected = {"eval/accuracy", "eval/accuracy_ci95", "eval/pass@3"}
    assert set(metrics) == expected | {
        "eval/reward_mean",
        "eval/response_length_mean",
        "eval/prompts",
    }


def test_the_real_rewards_give_consistent_metrics() -> None:
    spec = _spec()
    metrics = Evaluator.of(spec, learner(spec).setup).run()
    assert 0 < metrics["eval/accuracy"] < 1  # neither all nor none: see REWARD
    assert 0 <= metrics["eval/pass@3"] <= 1
    assert 0 < metrics["eval/reward_mean"] <= 1.5
    assert 0 < metrics["eval/response_length_mean"] <= spec.rollout.max_new_tokens
    assert metrics["eval/prompts"] == 8


# --------------------------------------------------------------------------- prompts
def test_prompts_are_the_first_rows_in_order(tmp_path) -> None:
    data = tmp_path / "eval.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"echo {c}", "answer": c}) + "\n" for c in "abcda")
    )
    spec = _spec(None, f"eval.data.source={data}", "eval.prompts=3")  # shuffle on: ignored
    assert [r["prompt"] for r in eval_rows(spec)] == ["echo a", "echo b", "echo c"]
    assert eval_rows(spec) == eval_rows(spec)
    whole = _spec(None, f"eval.data.source={data}", "eval.prompts=50")
    assert len(eval_rows(whole)) == 5  # a data file is read once, never cycled
    generated = eval_rows(_spec(None, "eval.prompts=16"))
    assert generated == eval_rows(_spec(None, "eval.prompts=16"))
    assert generated != eval_rows(_spec(None, "eval.prompts=16", "seed=1"))


def test_max_new_tokens_overrides_the_rollout_for_evaluation_only() -> None:
    spec = _spec(None, "eval.max_new_tokens=2", "rollout.max_new_tokens=4")
    lrn = learner(spec)
    metrics = Evaluator.of(spec, lrn.setup).run()
    assert metrics["eval/response_length_mean"] <= 2
    assert lrn.setup.spec.rollout.max_new_tokens == 4


# --------------------------------------------------------------------------- determinism
def test_two_evaluations_give_the_same_numbers() -> None:
    spec = _spec()
    lrn = learner(spec)
    evaluator = Evaluator.of(spec, lrn.setup)
    first = evaluator.run()
    torch.manual_seed(123)  # whatever the training RNG is doing
    assert evaluator.run() == first
    assert Evaluator.of(spec, learner(spec).setup).run() == first


def test_evaluation_leaves_the_rng_streams_and_the_mode_alone() -> None:
    spec = _spec()
    lrn = learner(spec)
    lrn.setup.models.actor.train()
    torch_state, py_state, np_state = (
        torch.get_rng_state(),
        random.getstate(),
        np.random.get_state(),
    )
    Evaluator.of(spec, lrn.setup).run()
    assert torch.equal(torch.get_rng_state(), torch_state)
    assert random.getstate() == py_state
    assert all(np.array_equal(a, b) for a, b in zip(np.random.get_state(), np_state, strict=True))
    assert lrn.setup.models.actor.training
    lrn.setup.models.actor.eval()
    Evaluator.of(spec, lrn.setup).run()
    assert not lrn.setup.models.actor.training


def test_isolated_rng_seeds_inside_and_restores_after() -> None:
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    with isolated_rng(7, torch.device("cpu")):
        inside = torch.rand(3)
        random.random()
    assert torch.equal(torch.rand(3), expected)
    torch.manual_seed(7)
    assert torch.equal(torch.rand(3), inside)


@pytest.mark.slow
def test_a_run_with_evaluations_trains_exactly_like_one_without(tmp_path, monkeypatch) -> None:
    extra = ["train.rounds=2", "output.save_every=1", "rollout.n=4", "train.ppo_epochs=2"]
    loop.train(small_spec(tmp_path / "plain", REWARD, *extra))  # the same, without eval
    evaluated = _spec(tmp_path / "evaluated", *extra)
    results = _hook_evaluation(monkeypatch, evaluated)
    loop.train(evaluated)
    assert sorted(results) == [1, 2]

    def train_metrics(folder: Path) -> list[dict]:
        return [
            {k: v for k, v in h.items() if k not in TIMING and not k.startswith("eval/")}
            for h in read_metrics(folder)
            if h["round"] > 0
        ]

    assert train_metrics(tmp_path / "plain") == train_metrics(tmp_path / "evaluated")
    shard = "shard-00001-model-00001-of-00001.safetensors"
    for name in (f"actor/{shard}", f"critic/{shard}", f"optim/{shard}"):
        plain = load_file(tmp_path / "plain" / "checkpoint" / name)
        again = load_file(tmp_path / "evaluated" / "checkpoint" / name)
        assert plain.keys() == again.keys(), name
        assert all(torch.equal(plain[k], again[k]) for k in plain), name
    for name in ("optim.json", "rng/process-00000.json", "rng/process-00000.safetensors"):
        plain_bytes = (tmp_path / "plain" / "checkpoint" / name).read_bytes()
        assert plain_bytes == (tmp_path / "evaluated" / "checkpoint" / name).read_bytes(), name


# --------------------------------------------------------------------------- ppokit eval
def test_ppokit_eval_of_the_base_model_matches_an_evaluation_before_training(tmp_path) -> None:
    spec = _spec(tmp_path / "run", "eval.at_start=true")
    spec_file = _write_spec(spec, tmp_path / "spec.yaml")
    result = _invoke("tiny", "--spec", str(spec_file), "--json")
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["kind"] == "model" and data["round"] is None
    # what it is doing, on stderr as it begins (the JSON on stdout stays whole)
    steps = [x for x in result.stderr.splitlines() if x.startswith("ppokit: ")]
    prompts = spec.eval.prompts if spec.eval else 0
    assert steps[0] == "ppokit: importing torch and transformers"
    assert steps[-1] == f"ppokit: evaluating {prompts} held-out prompts"
    assert "ppokit: starting the rollout engine (hf)" in steps
    # the run's learner before its first round (what an at_start evaluation sees)
    assert data["metrics"] == Evaluator.of(spec, learner(spec).setup).run()
    history = read_metrics(Path(loop.train(spec)["output_dir"]))
    start = [h for h in history if h["round"] == 0]
    if start:  # the loop evaluates at the start (once its evaluation is wired in)
        assert {k: start[0][k] for k in data["metrics"]} == data["metrics"]


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_ppokit_eval_of_a_run_matches_its_evaluation_at_that_round(
    tmp_path, monkeypatch, lora: bool
) -> None:
    """(With LoRA the checkpoint holds the adapters alone, put back on the base model.)"""
    if lora:
        pytest.importorskip("peft")
    run = tmp_path / "run"
    extra = ["model.lora.r=4", "model.lora.alpha=8"] if lora else []
    spec = _spec(run, "train.rounds=2", "output.save_every=1", *extra)
    spec_file = _write_spec(spec, tmp_path / "spec.yaml")
    results = _hook_evaluation(monkeypatch, spec)
    loop.train(spec)
    monkeypatch.undo()
    result = _invoke(str(run), "--spec", str(spec_file), "--json")
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["kind"] == "run" and data["round"] == 2
    assert data["metrics"] == results[2]
    # the actor evaluated is the run's at round 2, not the initial one
    trained = {k: v.clone() for k, v in results.actor.state_dict().items()}
    loaded = load_models(load_target(str(run))).actor.state_dict()
    assert trained.keys() == loaded.keys()
    assert all(torch.equal(trained[k], loaded[k]) for k in trained)
    initial = learner(spec).setup.models.actor.state_dict()
    assert any(not torch.equal(initial[k], loaded[k]) for k in loaded)
    logged = [h for h in read_metrics(run) if h["round"] == 2 and "eval/accuracy" in h]
    if logged:  # the loop's own evaluation, once wired in
        assert {k: logged[0][k] for k in data["metrics"]} == data["metrics"]
    # without --spec: the run's own spec
    again = _invoke(str(run), "--json")
    assert again.exit_code == 0, again.stderr
    assert json.loads(again.stdout)["metrics"] == results[2]
    if lora:  # merged adapters compute the same function, not the same floats
        return
    # the run's policy exported as a model directory evaluates the same
    export_run(run, tmp_path / "exported")
    exported = _invoke(str(tmp_path / "exported"), "--spec", str(spec_file), "--json")
    assert exported.exit_code == 0, exported.stderr
    assert json.loads(exported.stdout)["kind"] == "model"
    assert json.loads(exported.stdout)["metrics"] == results[2]


def test_ppokit_eval_prints_a_table(tmp_path) -> None:
    spec_file = _write_spec(_spec(None, "eval.prompts=4"), tmp_path / "spec.yaml")
    result = _invoke("tiny", "--spec", str(spec_file))
    assert result.exit_code == 0, result.stderr
    for key in ("eval/accuracy", "eval/accuracy_ci95", "eval/pass@3", "eval/prompts"):
        assert key in result.stdout


def test_a_spec_without_eval_section_evaluates_its_training_data(tmp_path) -> None:
    target = load_target("tiny", None, ["data.options.symbols=xy"])
    assert target.spec.eval is not None
    assert target.spec.eval.data.options == {"symbols": "xy"}
    assert target.spec.model.actor == "tiny" and target.kind == "model"


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        ("missing", "not found"),
        ("empty_dir", "neither a run folder"),
        ("run_without_checkpoint", "no checkpoint"),
        ("bad_spec", "rollout.n"),
        ("bad_weights", "checkpoint"),
    ],
)
def test_ppokit_eval_errors_are_one_line(tmp_path, setup: str, message: str) -> None:
    args: list[str] = []
    if setup == "missing":
        args = [str(tmp_path / "nope")]
    elif setup == "empty_dir":
        args = [str(tmp_path)]
    elif setup == "run_without_checkpoint":
        (tmp_path / "spec.yaml").write_text("seed: 0\n")
        args = [str(tmp_path)]
    elif setup == "bad_spec":
        (tmp_path / "bad.yaml").write_text("rollout: {n: 0}\n")
        args = ["tiny", "--spec", str(tmp_path / "bad.yaml")]
    else:
        run = tmp_path / "run"
        loop.train(small_spec(run))
        next((run / "checkpoint" / "actor").glob("*.safetensors")).write_bytes(b"broken")
        args = [str(run)]
    result = _invoke(*args)
    assert result.exit_code == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert "Traceback" not in result.output + result.stderr


def test_load_target_refuses_an_unknown_name() -> None:
    with pytest.raises(UserError, match="not found"):
        load_target("no-such-model")


def test_the_loop_evaluates_at_the_start_and_every_n_rounds(tmp_path) -> None:
    out = tmp_path / "run"
    loop.train(_spec(out, "train.rounds=3", "eval.every=2", "eval.at_start=true"))
    history = read_metrics(out)
    evaluated = [h["round"] for h in history if "eval/accuracy" in h]
    assert evaluated[:2] == [0, 2] and 1 not in evaluated
    assert all(h.get("time_eval", 0) > 0 for h in history if h["round"] in evaluated)
    start = history[0]
    assert start["round"] == 0 and start["reward_mean"] is None  # an evaluation only
    assert (out / "curves.png").is_file()


def test_a_spec_that_names_a_variant_and_task_is_composed_for_eval(tmp_path: Path) -> None:
    """The packaged demo (variant ppo_demo, task demo) and a spec file naming a variant and a
    task give eval the task's reward, data and generation length."""
    from ppokit.evaluate import load_target

    demo = load_target("tiny").spec
    assert (demo.variant, demo.task, demo.rollout.max_new_tokens) == ("ppo_demo", "demo", 4)
    assert [r.name for r in demo.reward] == ["demo"]
    spec_file = tmp_path / "s.yaml"
    spec_file.write_text("variant: grpo\ntask: arithmetic\n")
    spec = load_target("tiny", spec_file).spec
    assert spec.rollout.max_new_tokens == 256 and spec.data.source == "arithmetic"
    assert [r.name for r in spec.reward] == ["math_verify"]


def test_the_evaluation_reads_a_source_written_as_a_mapping_in_order() -> None:
    """The evaluation prompts of a source written as a mapping: a generator's, and a file's
    in the file's order (its shuffle turned off where the source reads it)."""
    from ppokit.spec import load_spec
    from ppokit.trainer.evaluation import eval_rows

    generated = load_spec(
        None,
        base={
            "data": {"source": {"name": "arithmetic", "terms": 3}},
            "reward": "math_verify",
            "eval": {"prompts": 4},
        },
    )
    assert [
        r["prompt"].count(" + ") + r["prompt"].count(" - ") + r["prompt"].count(" * ")
        for r in eval_rows(generated)
    ] == [2] * 4
    path = ROOT / "examples" / "data" / "arithmetic_sample.jsonl"
    first = [json.loads(line)["prompt"] for line in path.read_text().splitlines()[:3]]
    for source in ({"name": "file", "path": str(path)}, str(path)):
        spec = load_spec(
            None, base={"data": {"source": source}, "reward": "math_verify", "eval": {"prompts": 3}}
        )
        assert [r["prompt"] for r in eval_rows(spec)] == first
