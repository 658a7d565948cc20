"""One bad number never destroys a run: a NaN or inf reward, advantage, loss or gradient norm
is caught where it appears, before any parameter changes; ``train.on_nonfinite: stop`` ends
the run with a one-line NonFiniteError naming the round, the slot, the component and its
plugin, ``skip`` drops the round's update (or that optimizer step), counts it in
``skipped_steps`` and stops after ``train.max_skipped_steps`` in a row."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import Tensor

from ppokit.errors import NonFiniteError, UserError
from ppokit.trainer import train
from ppokit.trainer.checks import NonFinite
from ppokit.trainer.metrics import read_metrics
from tests.helpers import Plugin
from tests.helpers.trainer import Trainee, demo_rows, learner, small_spec

#: Small and fast: 2 prompts × 2 responses of 3 tokens, one optimizer step per round.
FAST = ["rollout.prompts_per_round=2", "rollout.max_new_tokens=3", "train.ppo_epochs=1"]
#: No critic (the actor's step alone).
NO_CRITIC = ["critic=null", "advantage=grpo"]


# ---------------------------------------------------------------------- test components
class NanAt:
    """A reward that differs between responses, NaN (or ``value``) for the first response
    on calls ``bad_from`` to ``bad_until`` (one call per round)."""

    def __init__(self, bad_from: int = 1, bad_until: int = 1 << 30, value: str = "nan") -> None:
        self.bad_from, self.bad_until, self.value = bad_from, bad_until, float(value)
        self.calls = 0

    def __call__(self, prompts: list[str], responses: list[str], **fields: Any) -> list[float]:
        self.calls += 1
        scores = [float(len(r) % 3) for r in responses]
        if self.bad_from <= self.calls <= self.bad_until:
            scores[0] = self.value
        return scores


class InfAdvantage:
    """The outcome reward on the last token, with inf at the first position on call ``at``."""

    def __init__(self, at: int = 1) -> None:
        self.at, self.calls = at, 0

    def __call__(self, batch: Any) -> Tensor:
        self.calls += 1
        adv = batch.token_rewards.float().clone()
        if self.calls == self.at:
            adv[0, 0] = math.inf
        return adv


class NanLoss:
    """−ρ·A, plus NaN at every response position on calls ``bad_from`` to ``bad_until``
    (one call per optimizer step here)."""

    def __init__(self, bad_from: int = 1, bad_until: int = 1 << 30) -> None:
        self.bad_from, self.bad_until, self.calls = bad_from, bad_until, 0

    def __call__(self, logp: Tensor, logp_old: Tensor, adv: Tensor, mask: Tensor) -> Tensor:
        self.calls += 1
        loss = -(logp - logp_old).exp() * adv
        if self.bad_from <= self.calls <= self.bad_until:
            loss = loss + torch.where(mask, torch.nan, 0.0)
        return loss


def sqrt_loss() -> Callable[..., Tensor]:
    """A loss whose value is 0 and finite but whose gradient is NaN: sqrt(|x − x|)."""

    def loss(logp: Tensor, logp_old: Tensor, adv: Tensor, mask: Tensor) -> Tensor:
        return (logp - logp.detach()).abs().sqrt()

    return loss


def plugin() -> Plugin:
    return (
        Plugin()
        .add("reward", "nan_at", NanAt, summary="NaN on chosen calls")
        .add("advantage", "inf_adv", InfAdvantage, summary="inf on a chosen call")
        .add("policy_loss", "nan_loss", NanLoss, summary="NaN on chosen calls")
        .add("policy_loss", "sqrt_loss", sqrt_loss, summary="a NaN gradient")
    )


# ---------------------------------------------------------------------- helpers
def _params(lrn: Trainee) -> list[Tensor]:
    return [
        p.detach().clone()
        for p in [*lrn.setup.models.actor.parameters(), *lrn.setup.models.critic_parameters()]
    ]


def _same(a: list[Tensor], b: list[Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _all_finite(lrn: Trainee) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in _params(lrn))


def _collect(lrn: Trainee, seed: int = 0, round_no: int | None = None) -> tuple[Any, Any]:
    """Steps 1-4 of the next round (or round ``round_no``)."""
    rows = demo_rows(2, seed)
    return lrn.collect(rows, [r["prompt"] for r in rows], round_no)


def _round(lrn: Trainee, seed: int = 0, round_no: int | None = None) -> Any:
    rows = demo_rows(2, seed)
    return lrn.round(rows, [r["prompt"] for r in rows], round_no)


def _no_grads(lrn: Trainee) -> bool:
    return all(
        p.grad is None
        for p in [*lrn.setup.models.actor.parameters(), *lrn.setup.models.critic_parameters()]
    )


# ---------------------------------------------------------------------- stop
#: (overrides, the round it fails in, where: collect or update, the message)
STOP_CASES = {
    "reward": (
        ["reward.name=nan_at", "reward.bad_from=2"],
        2,
        "collect",
        r"^round 2: reward \(nan_at, plugin test0\) produced NaN at 1 of 4 responses$",
    ),
    "reward_inf_of_two": (
        ["reward=[demo, {name: nan_at, value: '-inf'}]"],
        1,
        "collect",
        r"^round 1: reward\.1 \(nan_at, plugin test0\) produced inf at 1 of 4 responses$",
    ),
    "advantage": (
        ["advantage=inf_adv", "critic=null"],
        1,
        "collect",
        r"^round 1: advantage \(inf_adv, plugin test0\) produced inf at 1 of \d+ positions$",
    ),
    "policy_loss": (
        ["policy.loss=nan_loss", *NO_CRITIC],
        1,
        "update",
        r"^round 1: policy\.loss \(nan_loss, plugin test0\) produced NaN at \d+ of \d+ "
        r"positions$",
    ),
    "gradient_norm": (
        ["policy.loss=sqrt_loss"],
        1,
        "update",
        r"^round 1: the actor's gradient norm is NaN \(policy\.loss sqrt_loss, plugin test0\)$",
    ),
}


@pytest.mark.parametrize("case", sorted(STOP_CASES))
def test_stop_names_the_slot_and_changes_no_parameter(use_registry, case: str) -> None:
    overrides, bad_round, phase, message = STOP_CASES[case]
    use_registry(plugin())
    lrn = learner(small_spec(None, *FAST, *overrides))
    for r in range(1, bad_round):
        _round(lrn, seed=r)
    before = _params(lrn)
    sched = lrn.state.optimizers.actor_schedule.last_epoch
    if phase == "update":  # steps 1-4 of the round pass
        _collect(lrn, seed=bad_round, round_no=bad_round)
    with pytest.raises(NonFiniteError, match=message) as err:
        _round(lrn, seed=bad_round, round_no=bad_round)
    assert isinstance(err.value, UserError) and "\n" not in str(err.value)
    assert _same(before, _params(lrn)) and _all_finite(lrn)
    assert lrn.state.optimizers.actor_schedule.last_epoch == sched  # the scheduler did not step
    if phase == "update":
        assert _no_grads(lrn)  # the bad gradients were dropped


# ---------------------------------------------------------------------- skip
def test_skip_drops_a_bad_rounds_update_and_goes_on(use_registry) -> None:
    use_registry(plugin())
    spec = small_spec(
        None,
        *FAST,
        "reward.name=nan_at",
        "reward.bad_from=2",
        "reward.bad_until=2",
        "train.on_nonfinite=skip",
    )
    lrn = learner(spec)
    start = _params(lrn)
    first = _round(lrn, seed=1)
    assert float(first.metrics["skipped_steps"]) == 0 and not first.skipped
    after_one = _params(lrn)
    assert not _same(start, after_one)
    kl_coef, sched = lrn.state.kl_coef.clone(), lrn.state.optimizers.actor_schedule.last_epoch

    result = _round(lrn, seed=2)  # NaN reward: the round's update is skipped
    assert _same(after_one, _params(lrn)) and _all_finite(lrn)
    assert float(result.metrics["skipped_steps"]) == 1
    assert result.skipped == [
        "round 2: reward (nan_at, plugin test0) produced NaN at 1 of 4 responses: the "
        "round's update is skipped"
    ]
    assert (
        torch.equal(lrn.state.kl_coef, kl_coef)
        and lrn.state.optimizers.actor_schedule.last_epoch == sched
    )
    assert lrn.state.guard.bad_in_row == 1

    third = _round(lrn, seed=3)  # training continues
    assert float(third.metrics["skipped_steps"]) == 0
    assert not _same(after_one, _params(lrn)) and _all_finite(lrn)
    assert lrn.state.guard.bad_in_row == 0


def test_skip_stops_after_max_skipped_steps_in_a_row(use_registry) -> None:
    use_registry(plugin())
    spec = small_spec(
        None,
        *FAST,
        *NO_CRITIC,
        "policy.loss=nan_loss",
        "policy.loss.bad_from=2",
        "train.on_nonfinite=skip",
        "train.max_skipped_steps=2",
    )
    lrn = learner(spec)
    _round(lrn, seed=1)
    good = _params(lrn)
    sched = lrn.state.optimizers.actor_schedule.last_epoch
    result = _round(lrn, seed=2)  # a NaN loss: that optimizer step is skipped
    assert float(result.metrics["skipped_steps"]) == 1
    assert len(result.skipped) == 1 and result.skipped[0].startswith(
        "round 2: policy.loss (nan_loss, plugin test0) produced NaN at "
    )
    assert result.skipped[0].endswith(": the optimizer step is skipped")
    assert "policy_loss" not in result.metrics  # a skipped step's metrics are not reported
    assert _same(good, _params(lrn)) and lrn.state.optimizers.actor_schedule.last_epoch == sched
    with pytest.raises(
        NonFiniteError,
        match=r"^round 3: policy\.loss \(nan_loss, plugin test0\) produced NaN at \d+ of \d+ "
        r"positions; 2 in a row \(train\.max_skipped_steps: 2\)$",
    ):
        _round(lrn, seed=3)
    assert _same(good, _params(lrn)) and _all_finite(lrn)


def test_the_counter_reads_once_and_reports_the_first_bad_label() -> None:
    checks = NonFinite()
    checks.add("a", torch.ones(3))
    checks.add("b", torch.tensor([1.0, math.nan, math.inf, -math.inf]), "responses")
    checks.add("c", torch.tensor(math.nan), "scalar")
    assert checks.read_problem() == "b produced NaN at 1 and inf at 2 of 4 responses"
    checks = NonFinite()
    checks.add("loss", torch.tensor(1.0), "scalar", "policy.loss x, plugin p")
    checks.add("norm", torch.tensor(math.inf), "scalar", "policy.loss x, plugin p")
    assert checks.read_problem() == "norm is inf (policy.loss x, plugin p)"
    checks.add("agg", torch.tensor(math.nan), "scalar")
    assert checks.read_problem() == "norm is inf (policy.loss x, plugin p)"  # first added first
    assert NonFinite().read_problem() is None


# ---------------------------------------------------------------------- a whole run
def test_a_nan_reward_ends_the_run_and_keeps_the_last_good_checkpoint(
    use_registry, tmp_path
) -> None:
    use_registry(plugin())
    spec = small_spec(
        tmp_path,
        *FAST,
        "train.rounds=4",
        "output.save_every=1",
        "reward.name=nan_at",
        "reward.bad_from=3",
    )
    with pytest.raises(NonFiniteError, match=r"^round 3: reward \(nan_at, plugin test0\)"):
        train(spec)
    ckpt = tmp_path / "checkpoint"
    assert json.loads((ckpt / "state.json").read_text())["round"] == 2
    assert [h["round"] for h in read_metrics(tmp_path)] == [1, 2]
    files = sorted(ckpt.rglob("*.safetensors"))
    assert any(f.parent.name == "actor" for f in files)
    for f in files:
        for name, tensor in load_file(str(f)).items():
            if tensor.is_floating_point():
                assert torch.isfinite(tensor).all(), f"{f}: {name}"
