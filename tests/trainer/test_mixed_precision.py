"""bfloat16 autocast on a CPU (``model.dtype``): what ``auto`` picks, and a bf16 round keeps
its weights, optimizer state, log-probs, estimates and losses in float32, with log π_old
and log π_ref from the same autocast as the update."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ppokit.spec import CPU_BF16_MIN_PARAMETERS
from ppokit.trainer import models as models_module
from ppokit.trainer.metrics import read_once
from ppokit.trainer.models import build_models, resolve_device
from ppokit.trainer.optim import MasterAdamW
from tests.helpers.trainer import demo_rows, learner, small_spec


@pytest.mark.parametrize("units", [True, False], ids=["AMX", "no AMX"])
def test_auto_is_bf16_on_a_cpu_with_amx_for_a_large_enough_model(
    monkeypatch: Any, units: bool
) -> None:
    monkeypatch.setattr(models_module, "cpu_bf16_units", lambda: units)
    large, small = CPU_BF16_MIN_PARAMETERS, CPU_BF16_MIN_PARAMETERS - 1
    assert resolve_device("cpu", "auto", large).amp_dtype == (torch.bfloat16 if units else None)
    assert resolve_device("cpu", "auto", small).amp_dtype is None
    assert resolve_device("cpu", "auto").amp_dtype is None  # the size not known yet
    assert resolve_device("cpu", "float32", large).amp_dtype is None
    assert resolve_device("cpu", "bfloat16", small).amp_dtype == torch.bfloat16


def test_the_demo_model_stays_float32_and_a_large_one_gets_bf16(monkeypatch: Any) -> None:
    """The tiny demo model is far below the size where bf16 pays: auto keeps float32 (its
    runs are unchanged); above the size, on a CPU with AMX, the run says it chose bf16."""
    monkeypatch.setattr(models_module, "cpu_bf16_units", lambda: True)
    spec = small_spec(None, "kl={estimator: k3, coef: 0.1, placement: loss}")
    assert build_models(spec, 1).runtime.amp_dtype is None
    monkeypatch.setattr(models_module, "CPU_BF16_MIN_PARAMETERS", 1)
    steps: list[str] = []

    class Steps:
        def step(self, text: str) -> None:
            steps.append(text)

        def status(self, text: str) -> None:
            pass

    models = build_models(spec, 1, report=Steps())  # type: ignore[arg-type]
    assert models.runtime.amp_dtype == torch.bfloat16
    assert any(s.startswith("bfloat16 autocast (model.dtype auto") for s in steps)


@pytest.mark.parametrize("budget", [None, 40], ids=["rows", "token budget"])
def test_a_bf16_round_keeps_float32_state_and_one_autocast(budget: int | None) -> None:
    """One epoch, one minibatch: the update's first forward is log π_old's own computation,
    so the ratio is exactly 1 (approx_kl 0, nothing clipped), and the reference (the same
    weights) gives KL 0 exactly; every weight, optimizer state and estimate is float32; the
    log-probs are bf16 autocast's, not float32's."""
    extra = [] if budget is None else [f"train.micro_batch_tokens={budget}"]
    spec = small_spec(
        None, "model.dtype=bfloat16", "rollout.logp_old=forward", "train.ppo_epochs=1",
        "kl={estimator: k3, coef: 0.1, placement: loss}", "model.tiny.hidden_size=64",
        "model.tiny.intermediate_size=128", *extra,
    )  # fmt: skip
    lrn = learner(spec)
    rows = demo_rows(4)
    result = lrn.round(rows, [r["prompt"] for r in rows], 1)
    metrics = read_once(result.metrics)
    assert metrics["approx_kl"] == 0.0 and metrics["clipfrac"] == 0.0
    assert metrics["kl"] == 0.0
    assert metrics["grad_norm_actor"] is not None and metrics["grad_norm_actor"] > 0
    data = result.data
    for x in (data.batch.logp_old, data.batch.logp_ref, data.batch.values, data.advantages):
        assert x is not None and x.dtype == torch.float32
    params = [*lrn.setup.models.actor.parameters(), *lrn.setup.models.critic_parameters()]
    assert {p.dtype for p in params} == {torch.float32}
    state = [
        v for opt in (lrn.state.optimizers.actor, lrn.state.optimizers.critic) if opt is not None
        for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.numel() > 1
    ]  # fmt: skip
    assert state and {v.dtype for v in state} == {torch.float32}
    # the same weights in float32 give other log-probs: the passes ran under bf16 autocast
    runtime = lrn.setup.models.runtime
    ro = data.rollout
    with torch.no_grad():
        lrn.setup.models.runtime = models_module.Runtime(runtime.device, None)
        try:
            full = lrn.setup.forwards.reference_logprobs(ro) * ro.response_mask
        finally:
            lrn.setup.models.runtime = runtime
        bf16 = lrn.setup.forwards.reference_logprobs(ro) * ro.response_mask
    assert not torch.equal(full, bf16)
    torch.testing.assert_close(bf16, data.batch.logp_ref, rtol=0, atol=0)


def _bf16_round(*extra: str) -> tuple[Any, dict[str, Any]]:
    spec = small_spec(
        None, "model.dtype=bfloat16", "rollout.logp_old=forward", "train.ppo_epochs=1",
        "kl={estimator: k3, coef: 0.1, placement: loss}", "model.tiny.hidden_size=64",
        "model.tiny.intermediate_size=128", "train.micro_batch_size=4", *extra,
    )  # fmt: skip
    lrn = learner(spec)
    rows = demo_rows(4)
    return lrn, read_once(lrn.round(rows, [r["prompt"] for r in rows], 1).metrics)


def test_master_weights_store_bf16_weights_and_step_float32_masters() -> None:
    """``model.master_weights``: the weights (actor, critic, reference) are bfloat16 and the
    passes run without autocast; AdamW's moments and masters are float32 and its masters
    keep what bfloat16 rounds away; the round's loss and gradient norm are the autocast
    round's within bfloat16 rounding (micro-batches: gradients summed in float32); log π_old
    is the update's first forward (ratio 1) and the reference the same weights (KL 0)."""
    lrn, metrics = _bf16_round("model.master_weights=true")
    models = lrn.setup.models
    assert models.runtime.master
    assert metrics["approx_kl"] == 0.0 and metrics["kl"] == 0.0
    weights = [*models.actor.parameters(), *models.critic_parameters()]
    assert models.ref is not None and models.critic is not None
    weights += [*models.ref.parameters()]
    assert {p.dtype for p in weights} == {torch.bfloat16}
    opt = lrn.state.optimizers.actor
    assert isinstance(opt, MasterAdamW)
    state = [v for s in opt.state.values() for k, v in s.items() if k != "step"]
    assert state and {v.dtype for v in state} == {torch.float32}
    masters = [opt.state[p]["master"] for p in models.actor.parameters()]
    for p, m in zip(models.actor.parameters(), masters, strict=True):
        assert torch.equal(p, m.to(torch.bfloat16))  # the weight is its master, rounded
    assert any(not torch.equal(m, m.to(torch.bfloat16).float()) for m in masters)
    _, autocast_metrics = _bf16_round()
    for key in ("grad_norm_actor", "grad_norm_critic", "value_loss", "policy_loss"):
        assert metrics[key] == pytest.approx(autocast_metrics[key], rel=1e-2, abs=1e-6), key
    # a checkpoint of the optimizer keeps the masters (and moments) in float32
    again = MasterAdamW(models.actor.parameters(), lr=1e-3)
    again.load_state_dict(opt.state_dict())
    for p, m in zip(models.actor.parameters(), masters, strict=True):
        assert again.state[p]["master"].dtype == torch.float32
        assert torch.equal(again.state[p]["master"], m)
