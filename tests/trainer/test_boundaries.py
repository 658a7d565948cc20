"""Components are checked where they cross into the trainer: a reward returns exactly one
number per response, estimators [B, T] float tensors without grad, a position mask [B, T],
a prompt weight [B], a truncation rule a RolloutBatch, the elementwise losses [B, T] (the
losses differentiable), an aggregation a scalar; a factory that raises and a reward that
hangs are reported too. Each error is one line naming the slot, the component and its
plugin. A reward on the meta device, or one whose scores overflow once weighted, is named
too (not blamed on the estimator that meets the NaN)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from torch import Tensor

from ppokit.batch import RolloutBatch
from ppokit.errors import ComponentError, ComponentTimeout, NonFiniteError, UserError
from ppokit.trainer.assembly import Assembly, Where, as_scores
from tests.helpers import Plugin
from tests.helpers.trainer import demo_rows, learner, small_spec

B, T = 4, 3
EXPECT_SCORES = "expected one number per response: a tensor of shape [4] or a list of 4 numbers"


# ---------------------------------------------------------------------- test components
def bad_reward(mode: str = "ok") -> Callable[..., Any]:
    """Returns what ``mode`` names instead of one score per response."""

    def reward(prompts: list[str], responses: list[str], **fields: Any) -> Any:
        n = len(responses)
        return {
            "ok": [0.5] * n,
            "numpy": np.full(n, 0.5),
            "ints": torch.ones(n, dtype=torch.long),
            "bools": [True] * n,
            "scalars": [torch.tensor(0.5)] * n,
            "one": 1.0,
            "one_list": [1.0],
            "one_tensor": torch.ones(1),
            "column": torch.ones(n, 1),
            "strings": ["right"] * n,
            "none": None,
            "dict": {"score": [1.0] * n},
            "complex": torch.ones(n, dtype=torch.complex64),
            "meta": torch.zeros(n, device="meta"),
            "meta_scalars": [torch.zeros((), device="meta")] * n,
            "sparse": torch.ones(n).to_sparse(),
            "unreadable": [Unreadable(0.5)] * n,
            "huge": [1e35] * n,  # finite in float32, not once weighted by 1e6
        }[mode]

    return reward


class Unreadable(float):
    """A number whose conversion to float raises."""

    def __float__(self) -> float:
        raise ValueError("this number cannot be read")


def bad_estimate(mode: str = "ok") -> Callable[[RolloutBatch], Any]:
    """An advantage / critic target / position mask / prompt weight gone wrong."""

    def estimate(batch: RolloutBatch) -> Any:
        b, t = batch.response_mask.shape
        return {
            "ok": torch.zeros(b, t),
            "bool": batch.response_mask,
            "rows": torch.zeros(b),
            "positions": torch.ones(b, t),
            "grad": torch.zeros(b, t, requires_grad=True),
            "long": torch.zeros(b, t, dtype=torch.long),
            "list": [[0.0] * t] * b,
            "batch": batch,
            "meta": torch.zeros(b, t, device="meta"),
            "sparse": torch.zeros(b, t).to_sparse(),
        }[mode]

    return estimate


def bad_policy_loss(mode: str = "ok") -> Callable[..., Any]:
    def loss(logp: Tensor, logp_old: Tensor, adv: Tensor, mask: Tensor) -> Any:
        out = -(logp - logp_old).exp() * adv
        return {"ok": out, "mean": out.mean(), "detached": out.detach(), "rows": out.sum(1)}[mode]

    return loss


def bad_regression(mode: str = "ok") -> Callable[..., Any]:
    def loss(pred: Tensor, target: Tensor, old: Tensor | None = None) -> Any:
        out = (pred - target) ** 2
        return {"ok": out, "rows": out.mean(1), "detached": out.detach()}[mode]

    return loss


def bad_kl(mode: str = "ok") -> Callable[..., Any]:
    def kl(logp: Tensor, logp_ref: Tensor) -> Any:
        out = logp - logp_ref
        return {"ok": out, "rows": out.sum(1)}[mode]

    return kl


def bad_aggregation(mode: str = "ok") -> Callable[..., Any]:
    def agg(loss: Tensor, mask: Tensor, denom: Tensor | None = None) -> Any:
        total = (loss * mask).sum(1)
        return {"ok": total.sum(), "rows": total, "one": total.sum()[None], "float": 1.0}[mode]

    return agg


def bad_truncation(mode: str = "ok") -> Callable[[RolloutBatch], Any]:
    def rule(batch: RolloutBatch) -> Any:
        return {"ok": batch, "tensor": batch.token_rewards, "rows": batch.rows(slice(0, 2))}[mode]

    return rule


def boom(bins: int = 3) -> Any:
    """A factory that fails when created."""
    raise ValueError(f"{bins} bins are too few")


def slow(seconds: float = 30.0) -> Callable[..., Any]:
    """A reward that hangs for ``seconds``."""

    def reward(prompts: list[str], responses: list[str], **fields: Any) -> list[float]:
        time.sleep(seconds)
        return [0.0] * len(responses)

    return reward


def raising(message: str = "no answer column") -> Callable[..., Any]:
    def reward(prompts: list[str], responses: list[str], **fields: Any) -> list[float]:
        raise KeyError(message)

    return reward


def plugin() -> Plugin:
    p = Plugin()
    for kind, name, factory in [
        ("reward", "bad_reward", bad_reward),
        ("reward", "slow", slow),
        ("reward", "raising", raising),
        ("advantage", "bad_advantage", bad_estimate),
        ("critic_target", "bad_target", bad_estimate),
        ("position_mask", "bad_mask", bad_estimate),
        ("prompt_weight", "bad_weight", bad_estimate),
        ("truncation", "bad_truncation", bad_truncation),
        ("policy_loss", "bad_policy_loss", bad_policy_loss),
        ("regression_loss", "bad_regression", bad_regression),
        ("regression_loss", "boom", boom),
        ("kl_estimator", "bad_kl", bad_kl),
        ("aggregation", "bad_aggregation", bad_aggregation),
    ]:
        p.add(kind, name, factory, summary=f"a {kind} gone wrong")
    return p


@pytest.fixture
def assemble(use_registry: Callable[..., Any]) -> Iterator[Callable[..., Assembly]]:
    """``assemble(*overrides)``: the Assembly of a small spec with the test plugin (test0)."""
    use_registry(plugin())
    made: list[Assembly] = []

    def make(*overrides: str) -> Assembly:
        made.append(Assembly.from_spec(small_spec(None, *overrides)))
        return made[-1]

    yield make
    for asm in made:  # their worker processes end
        asm.close()


def _batch() -> RolloutBatch:
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    return RolloutBatch(
        response_mask=mask,
        token_rewards=torch.zeros(B, T),
        logp_old=torch.zeros(B, T),
        values=torch.zeros(B, T),
        group_ids=torch.arange(B) // 2,
    )


def _call_reward(asm: Assembly, index: int = 0) -> Tensor:
    _name, fn, _weight = asm.rewards[index]
    responses = ["a", "bb", "ccc", "dddd"]
    return fn(["p"] * B, responses, answer=["a"] * B, lengths=[1, 2, 3, 4], truncated=[False] * B)


def _one_line_error(exc: pytest.ExceptionInfo[BaseException], start: str) -> None:
    text = str(exc.value)
    assert isinstance(exc.value, UserError) and "\n" not in text
    assert text.startswith(start), text


# ---------------------------------------------------------------------- rewards
@pytest.mark.parametrize("mode", ["ok", "numpy", "ints", "bools", "scalars"])
def test_a_reward_may_return_a_tensor_an_array_or_a_list(assemble, mode: str) -> None:
    scores = _call_reward(assemble("reward.name=bad_reward", f"reward.mode={mode}"))
    assert scores.dtype == torch.float32 and scores.shape == (B,)


@pytest.mark.parametrize(
    ("mode", "returned"),
    [
        ("one", "a float"),
        ("one_list", "1 scores for 4 responses"),
        ("one_tensor", "a float32 tensor of shape [1] for 4 responses"),
        ("column", "a float32 tensor of shape [4, 1] for 4 responses"),
        ("strings", "a list holding a str"),
        ("none", "None"),
        ("dict", "a dict"),
        ("complex", "a complex64 tensor of shape [4]"),
        ("meta", "a tensor on the meta device, which holds no values"),
        ("meta_scalars", "a list holding a tensor on the meta device, which holds no values"),
        ("sparse", "a tensor of layout sparse_coo, not a dense one"),
    ],
)
def test_a_reward_returns_one_number_per_response(assemble, mode: str, returned: str) -> None:
    asm = assemble("reward=[demo, {name: bad_reward, mode: " + mode + "}]")
    _call_reward(asm, 0)  # the demo reward is fine
    with pytest.raises(ComponentError) as err:
        _call_reward(asm, 1)
    assert str(err.value) == (
        f"reward.1 (bad_reward, plugin test0) returned {returned}: {EXPECT_SCORES}"
    )


def test_a_reward_value_that_cannot_be_converted_is_named(assemble) -> None:
    asm = assemble("reward.name=bad_reward", "reward.mode=unreadable")
    with pytest.raises(ComponentError) as err:
        _call_reward(asm)
    assert str(err.value) == (
        "reward (bad_reward, plugin test0) returned a list that cannot be read as scores "
        "(ValueError: this number cannot be read)"
    )


def test_as_scores_without_a_component() -> None:
    torch.testing.assert_close(as_scores([1, 2.5], 2), torch.tensor([1.0, 2.5]))
    with pytest.raises(ComponentError, match=r"^reward returned a float: expected one number"):
        as_scores(1.0, 16)


# ---------------------------------------------------------------------- estimators
SHAPE = "[4, 3] (B, T)"
ESTIMATOR_CASES = [
    # (override, attribute, mode, the error after "<slot> (<name>, plugin test0) returned ")
    ("advantage", "advantage", "bad_advantage", "ok", None),
    ("advantage", "advantage", "bad_advantage", "rows", f"a float32 tensor of shape [4]: "
     f"expected a float tensor of shape {SHAPE} without grad"),
    ("advantage", "advantage", "bad_advantage", "long", f"an int64 tensor of shape [4, 3]: "
     f"expected a float tensor of shape {SHAPE} without grad"),
    ("advantage", "advantage", "bad_advantage", "list", f"a list: "
     f"expected a float tensor of shape {SHAPE} without grad"),
    ("advantage", "advantage", "bad_advantage", "grad", "a tensor that requires grad: an "
     "estimate is detached (docs/design.md, convention 3)"),
    ("advantage", "advantage", "bad_advantage", "meta", "a tensor on the meta device, which "
     f"holds no values: expected a float tensor of shape {SHAPE} without grad"),
    ("critic.target", "critic_target", "bad_target", "sparse", "a tensor of layout sparse_coo, "
     f"not a dense one: expected a float tensor of shape {SHAPE} without grad"),
    ("critic.target", "critic_target", "bad_target", "positions", None),
    ("critic.target", "critic_target", "bad_target", "batch", "a RolloutBatch of shape [4, 3]: "
     f"expected a float tensor of shape {SHAPE} without grad"),
    ("critic.mask", "critic_mask", "bad_mask", "bool", None),
    ("critic.mask", "critic_mask", "bad_mask", "rows", "a float32 tensor of shape [4]: "
     f"expected a float or bool tensor of shape {SHAPE} without grad"),
    ("policy.weight", "policy_weight", "bad_weight", "rows", None),
    ("critic.weight", "critic_weight", "bad_weight", "positions", "a float32 tensor of shape "
     "[4, 3]: expected a float tensor of shape [4] (B) without grad"),
    ("truncation", "truncation", "bad_truncation", "ok", None),
    ("truncation", "truncation", "bad_truncation", "tensor", "a float32 tensor of shape [4, 3]: "
     f"expected a RolloutBatch of shape {SHAPE}"),
    ("truncation", "truncation", "bad_truncation", "rows", "a RolloutBatch of shape [2, 3]: "
     f"expected a RolloutBatch of shape {SHAPE}"),
]  # fmt: skip


@pytest.mark.parametrize(("slot", "attribute", "name", "mode", "error"), ESTIMATOR_CASES)
def test_estimates_are_checked(
    assemble, slot: str, attribute: str, name: str, mode: str, error: str | None
) -> None:
    asm = assemble(f"{slot}={name}", f"{slot}.mode={mode}")
    component = getattr(asm, attribute)
    if error is None:
        component(_batch())
        return
    with pytest.raises(ComponentError) as err:
        component(_batch())
    assert str(err.value) == f"{slot} ({name}, plugin test0) returned {error}"


# ---------------------------------------------------------------------- losses
def _logp() -> Tensor:
    return torch.randn(B, T, requires_grad=True)


LOSS_CASES = [
    ("policy.loss", "policy_loss", "bad_policy_loss", "ok", None),
    ("policy.loss", "policy_loss", "bad_policy_loss", "mean", "a float32 tensor of shape [] "
     f"that requires grad: expected a float tensor of shape {SHAPE}"),
    ("policy.loss", "policy_loss", "bad_policy_loss", "detached", "a tensor without grad: a "
     "loss is differentiable in its first argument"),
    ("critic.loss", "critic_loss", "bad_regression", "rows", "a float32 tensor of shape [4] "
     f"that requires grad: expected a float tensor of shape {SHAPE}"),
    ("critic.loss", "critic_loss", "bad_regression", "detached", "a tensor without grad: a "
     "loss is differentiable in its first argument"),
    ("kl.estimator", "kl", "bad_kl", "rows", "a float32 tensor of shape [4] that requires "
     f"grad: expected a float tensor of shape {SHAPE}"),
    ("policy.aggregation", "policy_agg", "bad_aggregation", "ok", None),
    ("policy.aggregation", "policy_agg", "bad_aggregation", "rows", "a float32 tensor of shape "
     "[4] that requires grad: expected a float scalar (a 0-d tensor)"),
    ("critic.aggregation", "critic_agg", "bad_aggregation", "one", "a float32 tensor of shape "
     "[1] that requires grad: expected a float scalar (a 0-d tensor)"),
    ("critic.aggregation", "critic_agg", "bad_aggregation", "float", "a float: expected a "
     "float scalar (a 0-d tensor)"),
]  # fmt: skip


@pytest.mark.parametrize(("slot", "attribute", "name", "mode", "error"), LOSS_CASES)
def test_losses_are_checked(
    assemble, slot: str, attribute: str, name: str, mode: str, error: str | None
) -> None:
    extra = ["kl.coef=0.1"] if slot.startswith("kl") else []
    asm = assemble(f"{slot}={name}", f"{slot}.mode={mode}", *extra)
    component = getattr(asm, attribute)
    mask = _batch().response_mask
    args = {
        "policy_loss": lambda: (_logp(), torch.zeros(B, T), torch.ones(B, T), mask),
        "critic_loss": lambda: (_logp(), torch.zeros(B, T), torch.zeros(B, T)),
        "kl": lambda: (_logp(), torch.zeros(B, T)),
        "policy_agg": lambda: (_logp(), mask),
        "critic_agg": lambda: (_logp(), mask),
    }[attribute]()
    if error is None:
        out = component(*args)
        out.sum().backward()  # still differentiable through the check
        return
    with pytest.raises(ComponentError) as err:
        component(*args)
    assert str(err.value) == f"{slot} ({name}, plugin test0) returned {error}"


def test_the_differentiability_check_is_off_without_grad(assemble) -> None:
    """Under no_grad (the KL of the reward placement, metrics) a loss needs no graph."""
    asm = assemble("policy.loss.name=bad_policy_loss", "policy.loss.mode=detached")
    args = (_logp(), torch.zeros(B, T), torch.ones(B, T), _batch().response_mask)
    with torch.no_grad():
        out = asm.policy_loss(*args)
    assert out.shape == (B, T) and not out.requires_grad  # returned as it is
    with pytest.raises(ComponentError, match="without grad"):  # with grad: the check is on
        asm.policy_loss(*args)


def test_optional_members_pass_through(assemble) -> None:
    asm = assemble("critic.loss=clipped_mse")
    assert callable(asm.policy_loss.clipped)  # ppo_clip's
    assert callable(asm.policy_agg.denominator)  # token_mean's
    assert callable(asm.critic_loss.clipped) and asm.head_size == 1
    assert not hasattr(asm.advantage, "clipped")
    assert asm.where["policy.loss"] == Where("policy.loss", "ppo_clip", "ppokit")


# ---------------------------------------------------------------------- factories, timeouts
def test_a_factory_that_raises_names_its_slot(assemble) -> None:
    with pytest.raises(ComponentError) as err:
        assemble("critic.loss.name=boom", "critic.loss.bins=2")
    assert str(err.value) == (
        "critic.loss (boom, plugin test0) failed to start: ValueError: 2 bins are too few "
        f"(at tests/trainer/test_boundaries.py:{boom.__code__.co_firstlineno + 2})"
    )
    assert isinstance(err.value.__cause__, ValueError)


def test_a_hung_reward_is_bounded_by_reward_timeout(assemble) -> None:
    asm = assemble("reward.name=slow", "train.reward_timeout=0.2")
    with pytest.raises(ComponentTimeout) as err:
        _call_reward(asm)
    assert str(err.value) == (
        "reward (slow, plugin test0) did not return within train.reward_timeout (0.2 s): its "
        "worker process was stopped and the run stops"
    )
    _one_line_error(err, "reward (slow, plugin test0)")


def test_a_reward_within_its_timeout_and_its_own_errors(assemble) -> None:
    asm = assemble("reward=[{name: slow, seconds: 0.01}, raising]", "train.reward_timeout=5")
    assert torch.equal(_call_reward(asm, 0), torch.zeros(B))
    with pytest.raises(ComponentError) as err:  # its own error: one line, where it was raised
        _call_reward(asm, 1)
    text = str(err.value)
    assert text.startswith("reward.1 (raising, plugin test0) failed: KeyError: 'no answer column'")
    assert text.endswith(f"test_boundaries.py:{raising.__code__.co_firstlineno + 2})")


def pid(prompts: list[str], responses: list[str], **fields: Any) -> list[float]:
    return [float(os.getpid())] * len(responses)


def test_a_bounded_reward_runs_in_a_worker_process_an_unbounded_one_here(use_registry) -> None:
    use_registry(Plugin().add("reward", "pid", lambda: pid, summary="its process"))
    for timeout, here in (("5", False), ("null", True)):
        asm = Assembly.from_spec(
            small_spec(None, "reward.name=pid", f"train.reward_timeout={timeout}")
        )
        try:
            assert (_call_reward(asm)[0].item() == os.getpid()) is here
        finally:
            asm.close()


# ---------------------------------------------------------------------- in a round
def test_a_round_reports_a_broken_reward_and_a_broken_loss(use_registry) -> None:
    use_registry(plugin())
    fast = ["rollout.prompts_per_round=2", "rollout.max_new_tokens=3", "train.ppo_epochs=1"]
    rows = demo_rows(2)
    prompts = [r["prompt"] for r in rows]
    lrn = learner(small_spec(None, *fast, "reward.name=bad_reward", "reward.mode=one"))
    with pytest.raises(ComponentError) as err:
        lrn.collect(rows, prompts)
    assert str(err.value) == f"reward (bad_reward, plugin test0) returned a float: {EXPECT_SCORES}"

    lrn = learner(
        small_spec(None, *fast, "policy.loss.name=bad_policy_loss", "policy.loss.mode=mean")
    )
    with pytest.raises(ComponentError) as err:
        lrn.round(rows, prompts)
    _one_line_error(err, "policy.loss (bad_policy_loss, plugin test0) returned a float32 tensor")


def test_a_round_names_a_reward_on_the_meta_device(use_registry) -> None:
    use_registry(plugin())
    fast = ["rollout.prompts_per_round=2", "rollout.max_new_tokens=3"]
    rows = demo_rows(2)
    lrn = learner(small_spec(None, *fast, "reward.name=bad_reward", "reward.mode=meta"))
    with pytest.raises(ComponentError) as err:
        lrn.collect(rows, [r["prompt"] for r in rows])
    assert str(err.value) == (
        "reward (bad_reward, plugin test0) returned a tensor on the meta device, which holds "
        f"no values: {EXPECT_SCORES}"
    )


def test_a_reward_weight_is_bounded_in_the_spec() -> None:
    from ppokit.spec import MAX_REWARD_WEIGHT, SpecError

    with pytest.raises(SpecError) as err:
        small_spec(None, "reward.weight=1e308")
    assert err.value.errors == ["reward.0.weight: Input should be less than or equal to 1000000"]
    assert MAX_REWARD_WEIGHT == 1e6
    assert small_spec(None, "reward.weight=-1e6").reward[0].weight == -1e6


def test_an_overflowing_weighted_reward_is_blamed_on_the_rewards(use_registry) -> None:
    """Finite scores times a weight within the bound overflow float32: the error names the
    rewards' weighted sum, not the advantage estimator that would meet the inf first."""
    use_registry(plugin())
    fast = ["rollout.prompts_per_round=2", "rollout.max_new_tokens=3"]
    rows = demo_rows(2)
    huge = "reward=[demo, {name: bad_reward, mode: huge, weight: 1e6}]"
    lrn = learner(small_spec(None, *fast, huge))
    with pytest.raises(NonFiniteError) as err:
        lrn.collect(rows, [r["prompt"] for r in rows])
    text = str(err.value)
    assert "the rewards' weighted sum R produced inf at 4 of 4 responses" in text, text
    assert "gae" not in text and "\n" not in text


def test_each_kinds_contract_is_declared_beside_its_protocol() -> None:
    """The return checks and the optional members come from each kind package's CONTRACT."""
    from ppokit.components import KIND_PACKAGES
    from ppokit.slots import KINDS
    from ppokit.trainer.assembly import CONTRACTS, optional

    declared = {k for k, p in zip(KINDS, KIND_PACKAGES, strict=True) if hasattr(p, "CONTRACT")}
    # the engine and the prompt source are started once, not called in the round: their own
    assert declared == set(KINDS) - {"rollout_engine", "prompt_source"} == set(CONTRACTS)
    assert optional(object(), "policy_loss", "clipped") is None  # declared, absent
    with pytest.raises(KeyError, match="declares no optional member 'clipped'"):
        optional(object(), "advantage", "clipped")
