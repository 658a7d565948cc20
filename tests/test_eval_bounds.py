"""An evaluation is bounded like a round: eval.prompts x (eval.k + 1) responses (greedy and
sampled) x their tokens (eval.max_new_tokens, else rollout.max_new_tokens) at most
MAX_ROUND_POSITIONS, checked when the spec is validated (``ppokit validate``, ``ppokit train``,
``ppokit eval --set ...``) with one line naming ``eval``, before any model is loaded."""

from __future__ import annotations

from typing import Any

import pytest
from typer.testing import CliRunner

from ppokit import evaluate
from ppokit.cli import app
from ppokit.spec import MAX_ROUND_POSITIONS, SpecError, validate_spec

pytestmark = pytest.mark.usefixtures("clean_registry")


def most_prompts(k: int, tokens: int) -> int:
    """The most prompts an evaluation of ``k`` samples of ``tokens`` tokens may have."""
    return MAX_ROUND_POSITIONS // ((k + 1) * tokens)


def eval_errors(data: dict[str, Any]) -> list[str]:
    try:
        validate_spec(data)
    except SpecError as exc:
        return [e for e in exc.errors if e.startswith("eval")]
    return []


def test_the_issue_case_is_refused_in_one_line() -> None:
    errors = eval_errors({"eval": {"prompts": 10**6, "k": 1024}})
    assert errors == [
        "eval: an evaluation of 1025000000 responses x 16 tokens is 1.64e+10 positions, more "
        "than any memory holds or any run finishes (at most 2.15e+09): lower eval.prompts, "
        "eval.n (or the largest eval.k) or eval.max_new_tokens (prompts x (n + 1) responses)"
    ]


@pytest.mark.parametrize(("k", "tokens"), [(4, 1024), (1024, 2), (1, 1 << 20), (63, 512)])
def test_the_bound_is_exact(k: int, tokens: int) -> None:
    top = most_prompts(k, tokens)
    if top > 1 << 20:  # eval.prompts' own bound comes first
        pytest.fail(f"choose a case inside eval.prompts' bound: {top}")
    at = {"eval": {"prompts": top, "k": k, "max_new_tokens": tokens}}
    over = {"eval": {"prompts": top + 1, "k": k, "max_new_tokens": tokens}}
    assert eval_errors(at) == []
    assert len(eval_errors(over)) == 1


def test_the_rollouts_length_counts_without_eval_max_new_tokens() -> None:
    k, tokens = 1023, 8
    top = most_prompts(k, tokens)
    spec = {"rollout": {"max_new_tokens": tokens}, "eval": {"prompts": top, "k": k}}
    assert eval_errors(spec) == []
    spec["rollout"]["max_new_tokens"] = tokens + 1  # type: ignore[index]
    assert eval_errors(spec)[0].startswith(f"eval: an evaluation of {top * (k + 1)} responses")
    spec["eval"]["max_new_tokens"] = tokens  # type: ignore[index]
    assert eval_errors(spec) == []  # eval.max_new_tokens replaces the rollout's


def test_a_round_and_an_evaluation_are_reported_together() -> None:
    with pytest.raises(SpecError) as exc:
        validate_spec(
            {
                "rollout": {"prompts_per_round": 1 << 20, "n": 4096, "max_new_tokens": 1},
                "eval": {"prompts": 1 << 20, "k": 1024, "max_new_tokens": 16},
            }
        )
    starts = [e.split(":", 1)[0] for e in exc.value.errors]
    assert "rollout" in starts and "eval" in starts


runner = CliRunner()


def test_validate_and_eval_set_refuse_it_before_loading_a_model(
    tmp_spec: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_spec("eval: {prompts: 1000000, k: 1024}\n")
    result = runner.invoke(app, ["validate", str(path)])
    assert result.exit_code == 1 and "eval: an evaluation of 1025000000" in result.stderr
    assert "Traceback" not in result.output
    built: list[Any] = []
    monkeypatch.setattr(evaluate, "load_models", built.append)
    result = runner.invoke(
        app, ["eval", "tiny", "--set", "eval.prompts=1000000", "--set", "eval.k=1024"]
    )
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("demo.yaml: eval: an evaluation of"), lines
    assert built == []  # refused before any model was built
