"""pass@k with more samples than k: ``eval.n`` samples per prompt and ``eval.k`` one k or a
list; the unbiased estimator over the n samples, hand-computed, and the spec's checks."""

from __future__ import annotations

from math import comb

import pytest
import torch

from ppokit.spec import SpecError, validate_spec
from ppokit.stats import pass_at_k
from ppokit.trainer.evaluation import Evaluator
from ppokit.trainer.lifecycle.smoke import smoke_spec
from ppokit.trainer.scoring import Scores
from tests.helpers.trainer import learner, small_spec


def test_eval_k_is_one_or_a_list_and_n_defaults_to_the_largest() -> None:
    one = validate_spec({"eval": {"k": 4}}).eval
    assert one is not None and one.ks == [4] and one.samples == 4
    many = validate_spec({"eval": {"k": [8, 1, 4, 4]}}).eval
    assert many is not None and many.ks == [1, 4, 8] and many.samples == 8
    more = validate_spec({"eval": {"k": [1, 2], "n": 10}}).eval
    assert more is not None and more.samples == 10


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"k": [1, 4], "n": 3}, "eval: n (3) must be at least every k of pass@k, got k=4"),
        ({"k": []}, "eval: k: an integer in [1, 1024] or a list of 1 to 32 of them, got []"),
        ({"k": [0, 2]}, "eval: k: an integer in [1, 1024] or a list of 1 to 32 of them"),
        ({"k": "x"}, "eval: k: an integer in [1, 1024] or a list of 1 to 32 of them, got 'x'"),
        ({"k": 2, "n": 0}, "eval.n: Input should be greater than or equal to 1"),
    ],
)
def test_bad_k_and_n_are_refused(section: dict, message: str) -> None:
    with pytest.raises(SpecError) as err:
        validate_spec({"eval": section})
    assert message in err.value.errors[0] and len(err.value.errors) == 1, err.value.errors


def test_smoke_keeps_a_list_of_k_small() -> None:
    spec = validate_spec({"eval": {"k": [1, 4, 16], "n": 32}})
    small = smoke_spec(spec).eval
    assert small is not None and small.ks == [1, 2] and small.samples == 2


def test_pass_at_k_over_n_samples_hand_computed(monkeypatch) -> None:
    """n = 4 samples, k = 1 and 2: pass@1 = c/n, pass@2 = 1 - C(n-c, 2)/C(n, 2)."""
    spec = small_spec(
        None,
        "eval.prompts=3",
        "eval.k=[1, 2]",
        "eval.n=4",
        "eval.batch_size=3",
        "eval.correct_at=1.0",
    )
    lrn = learner(spec)
    sampled = [[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]]
    flat = iter(x for row in sampled for x in row)

    def score(rows, responses, lengths, truncated, checks=None):
        if len(responses) == 3:  # the greedy responses
            return Scores(torch.tensor([1.0, 0.0, 0.0]))
        assert len(responses) == 12  # 3 prompts x n = 4
        return Scores(torch.tensor([next(flat) for _ in responses]))

    monkeypatch.setattr(lrn.setup.scorer, "score", score)
    evaluator = Evaluator.of(spec, lrn.setup)
    metrics = evaluator.run()
    counts = [1, 3, 0]
    assert metrics["eval/pass@1"] == pytest.approx(sum(c / 4 for c in counts) / 3)
    by_hand = sum(1 - comb(4 - c, 2) / comb(4, 2) for c in counts) / 3  # (0.5 + 1 + 0) / 3
    assert metrics["eval/pass@2"] == pytest.approx(by_hand) == pytest.approx(0.5)
    assert metrics["eval/pass@2"] == pytest.approx(sum(pass_at_k(4, c, 2) for c in counts) / 3)
    assert "eval/pass@4" not in metrics
    assert {k for k in metrics if k.startswith("eval/pass@")} == {"eval/pass@1", "eval/pass@2"}
