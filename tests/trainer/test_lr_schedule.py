"""The learning-rate schedule (``train.lr_schedule``: constant, linear, cosine, with
``warmup_steps`` and ``min_lr_ratio``) is transformers' own, evaluated at each optimizer
step's number (1-based), over the run's optimizer steps; a run interrupted and resumed
follows the same rates as an uninterrupted one (the scheduler's state is checkpointed)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from transformers import (
    get_constant_schedule_with_warmup,
    get_cosine_schedule_with_warmup,
    get_cosine_with_min_lr_schedule_with_warmup,
    get_linear_schedule_with_warmup,
)

import ppokit.trainer.loop as loop_module
from ppokit.spec import TrainSpec
from ppokit.trainer import train
from ppokit.trainer.lifecycle.ending import Interrupted
from ppokit.trainer.metrics import TIMING, read_metrics
from ppokit.trainer.optim import lr_factor, optimizer_steps
from tests.helpers.trainer import small_spec


def rates(made: torch.optim.lr_scheduler.LambdaLR, steps: int) -> list[float]:
    """The factor transformers' schedule gives step k (1-based), k = 1..steps."""
    shape = made.lr_lambdas[0]
    return [float(shape(k)) for k in range(1, steps + 1)]


def probe() -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)


def ours(steps: int, **train: object) -> list[float]:
    factor = lr_factor(TrainSpec(**train), steps)
    return [factor(k) for k in range(steps)]


@pytest.mark.parametrize("warmup", [0, 1, 5])
def test_linear_and_cosine_are_transformers_schedules(warmup: int) -> None:
    n = 40
    assert ours(n, warmup_steps=warmup, lr_schedule="linear") == pytest.approx(
        rates(get_linear_schedule_with_warmup(probe(), warmup, n), n)
    )
    assert ours(n, warmup_steps=warmup, lr_schedule="cosine") == pytest.approx(
        rates(get_cosine_schedule_with_warmup(probe(), warmup, n), n)
    )
    assert ours(n, warmup_steps=warmup, lr_schedule="cosine", min_lr_ratio=0.1) == pytest.approx(
        rates(get_cosine_with_min_lr_schedule_with_warmup(probe(), warmup, n, min_lr_rate=0.1), n)
    )
    assert ours(n, warmup_steps=warmup) == pytest.approx(
        rates(get_constant_schedule_with_warmup(probe(), warmup), n)
    )


def test_the_warm_up_and_the_ends() -> None:
    """The warm-up's first step is not at rate 0 (ppokit's warm-up as before: (k+1)/W);
    the last step is at min_lr_ratio; a linear decay is a straight line to it."""
    assert ours(10, warmup_steps=4) == [0.25, 0.5, 0.75] + [1.0] * 7
    linear = ours(10, lr_schedule="linear", min_lr_ratio=0.1)
    assert linear[-1] == pytest.approx(0.1)
    steps = [b - a for a, b in itertools.pairwise(linear)]
    assert steps == pytest.approx([steps[0]] * len(steps)) and steps[0] < 0
    cosine = ours(10, lr_schedule="cosine", min_lr_ratio=0.2, warmup_steps=2)
    assert cosine[:2] == [0.5, 1.0] and cosine[-1] == pytest.approx(0.2)
    assert all(a >= b for a, b in itertools.pairwise(cosine[1:]))
    assert lr_factor(TrainSpec(lr_schedule="cosine"), 10)(50) == pytest.approx(0.0)  # stays
    assert ours(5, lr_schedule="linear", min_lr_ratio=1.0) == [1.0] * 5


def test_the_steps_of_a_run_are_counted() -> None:
    spec = small_spec(
        None,
        "train.rounds=5",
        "train.critic_warmup_rounds=2",
        "train.ppo_epochs=3",
        "rollout.prompts_per_round=4",
        "rollout.n=3",
        "train.minibatch_size=4",
    )  # 12 responses: 3 minibatches a pass
    assert optimizer_steps(spec) == (3 * 3 * 3, 5 * 3 * 3)


COSINE = [
    "train.lr_schedule=cosine",
    "train.min_lr_ratio=0.1",
    "train.warmup_steps=2",
    "rollout.n=4",
    "train.minibatch_size=4",
    "train.ppo_epochs=2",
]


def _untimed(history: list[dict]) -> list[dict]:
    return [{k: v for k, v in h.items() if k not in TIMING} for h in history]


def test_a_cosine_run_ends_at_its_floor_and_resumes_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    whole, split = tmp_path / "whole", tmp_path / "split"
    seen: list[float] = []
    real = loop_module.run_round

    def run_round(setup, state, *rest, **kw):  # type: ignore[no-untyped-def]
        result = real(setup, state, *rest, **kw)
        seen.append(state.optimizers.actor.param_groups[0]["lr"])
        return result

    monkeypatch.setattr(loop_module, "run_round", run_round)
    spec = small_spec(whole, "train.rounds=4", *COSINE)
    train(spec)
    steps = optimizer_steps(spec)[0]
    assert steps == 4 * 4 * 2  # 4 rounds of 16 responses: 4 minibatches of 4, 2 passes
    # after the last step the scheduler points at step steps + 1: the floor, kept
    assert seen[-1] == pytest.approx(spec.train.actor_lr * 0.1)
    assert seen[0] < spec.train.actor_lr

    def interrupted(setup, state, produced, *, round_no, **kw):  # type: ignore[no-untyped-def]
        if round_no == 3:
            raise KeyboardInterrupt
        return real(setup, state, produced, round_no=round_no, **kw)

    monkeypatch.setattr(loop_module, "run_round", interrupted)
    with pytest.raises(Interrupted):
        train(small_spec(split, "train.rounds=4", "output.save_every=1", *COSINE))
    monkeypatch.setattr(loop_module, "run_round", real)
    train(small_spec(split, "train.rounds=4", "output.save_every=1", *COSINE), resume=True)
    assert _untimed(read_metrics(whole)) == _untimed(read_metrics(split))
