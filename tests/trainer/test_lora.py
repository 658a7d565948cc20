"""LoRA adapters through peft (``model.lora``) on the tiny model: what trains, the reference
policy as the actor with its adapters disabled, separate and shared critics, spec-level
errors; and models named by a Hub id (never reached here: the hub is offline)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from ppokit.data import make_prompt_source
from ppokit.errors import UserError
from ppokit.trainer import train
from ppokit.trainer.checkpoint import load_checkpoint
from ppokit.trainer.logprobs import token_logprobs
from ppokit.trainer.metrics import read_metrics
from ppokit.trainer.models import Models, build_models, is_peft, trunk_of
from ppokit.trainer.rollout import Rollout
from tests.helpers.trainer import Trainee, accumulate, demo_rows, learner, small_spec

pytest.importorskip("peft")

LORA = ["model.lora.r=4", "model.lora.alpha=8"]
KL = ["kl.coef=0.1", "kl.placement=loss"]
NO_CRITIC = ["advantage=grpo", "critic=null", "rollout.n=4"]
#: A reward that differs between responses of a random tiny model.
VARIED_REWARD = ["reward.name=regex", "reward.pattern='[a-m]'"]


def _named(module: nn.Module) -> dict[str, nn.Parameter]:
    return dict(module.named_parameters())


def _snapshot(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in module.named_parameters()}


def _perturb_adapters(module: nn.Module, seed: int = 0) -> None:
    """Random non-zero adapters (lora_B starts at 0: the adapted model equals the base)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)


def _reference_logprobs(models: Models, lrn: Trainee, ro: Rollout) -> torch.Tensor:
    """log π_ref of the responses through ``Models.reference()`` (what round.py runs)."""
    with torch.no_grad(), models.reference() as ref:
        hidden = lrn.setup.forwards.hidden(ref, ro)
        logp, _ = token_logprobs(
            hidden[:, :-1], ref.get_output_embeddings(), ro.response_ids, entropy=False
        )
    return logp


def _rollout(lrn: Trainee, seed: int = 0) -> Rollout:
    torch.manual_seed(seed)
    rows = demo_rows(4, seed)
    return lrn.sample([r["prompt"] for r in rows], 2)


def _update(lrn: Trainee, seed: int = 1) -> None:
    torch.manual_seed(seed)
    rows = demo_rows(4, seed)
    lrn.round(rows, [r["prompt"] for r in rows])


# ---------------------------------------------------------------------- the actor
def test_only_the_adapters_train() -> None:
    models = build_models(small_spec(None, *LORA, *NO_CRITIC), 1)
    assert models.lora and is_peft(models.actor)
    params = _named(models.actor)
    trainable = {n for n, p in params.items() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert all(not p.requires_grad for n, p in params.items() if "lora_" not in n)
    assert {id(p) for p in models.actor_parameters()} == {id(params[n]) for n in trainable}
    # the trainer's view: a causal LM with an output head and a decoder trunk
    assert isinstance(models.actor.get_output_embeddings(), nn.Linear)
    trunk = trunk_of(models.actor)
    assert type(trunk).__name__ == "LlamaModel"
    assert any("lora_A" in n for n, _ in trunk.named_modules())


def test_the_reference_is_the_actor_with_its_adapters_disabled() -> None:
    spec = small_spec(None, *LORA, *KL, *NO_CRITIC)
    lrn = learner(spec)
    models = lrn.setup.models
    assert models.ref is None and models.has_reference
    plain = build_models(small_spec(None, *KL, *NO_CRITIC), 1)  # same seed, no LoRA
    assert plain.ref is not None and not plain.lora
    # one copy of the weights: the plain run holds the actor and its reference copy
    base = sum(p.numel() for n, p in models.actor.named_parameters() if "lora_" not in n)
    assert base == sum(p.numel() for p in plain.actor.parameters())
    _perturb_adapters(models.actor)
    ro = _rollout(lrn)
    ref = _reference_logprobs(models, lrn, ro)
    expected = _reference_logprobs(plain, lrn, ro)
    assert torch.equal(ref, expected)  # exactly the base model's
    with torch.no_grad():
        adapted, _, _ = lrn.setup.forwards.actor(models.actor, ro)
    assert not torch.allclose(adapted, ref)  # the adapters are on outside reference()
    assert torch.equal(lrn.setup.forwards.reference_logprobs(ro), expected)


def test_reference_restores_the_train_mode_and_the_adapters() -> None:
    models = build_models(small_spec(None, *LORA, *KL, *NO_CRITIC), 1)
    models.actor.train()
    with models.reference() as ref:
        assert ref is models.actor and not ref.training
    assert models.actor.training
    plain = build_models(small_spec(None, *NO_CRITIC), 1)
    assert not plain.has_reference
    with pytest.raises(RuntimeError, match="no reference"), plain.reference():
        pass


@pytest.mark.parametrize("extra", [[], ["model.gradient_checkpointing=true"]])
def test_an_update_changes_the_adapters_only(extra: list[str]) -> None:
    lrn = learner(small_spec(None, *LORA, *NO_CRITIC, *VARIED_REWARD, *extra))
    before = _snapshot(lrn.setup.models.actor)
    _update(lrn)
    after = _snapshot(lrn.setup.models.actor)
    base = [n for n in before if "lora_" not in n]
    adapters = [n for n in before if "lora_" in n]
    assert base and adapters
    assert all(torch.equal(before[n], after[n]) for n in base)
    assert any(not torch.equal(before[n], after[n]) for n in adapters if "lora_B" in n)


# ---------------------------------------------------------------------- critics
def test_a_separate_critic_has_adapters_of_its_own_on_shared_frozen_weights() -> None:
    lrn = learner(small_spec(None, *LORA, *VARIED_REWARD))
    models = lrn.setup.models
    critic = models.critic
    assert critic is not None and critic.trunk is not None and is_peft(critic.trunk)
    critic_params = list(models.critic_parameters())
    names = {id(p): n for n, p in critic.named_parameters()}
    trainable = {names[id(p)] for p in critic_params}
    assert {"head.weight", "head.bias"} <= trainable
    assert all(n.startswith("head.") or "lora_" in n for n in trainable)
    assert not {id(p) for p in critic_params} & {id(p) for p in models.actor_parameters()}
    # the frozen base weights are the actor's own tensors, not a second copy
    actor_base = {p.data_ptr() for n, p in models.actor.named_parameters() if "lora_" not in n}
    for n, p in critic.trunk.named_parameters():
        if "lora_" not in n:
            assert p.data_ptr() in actor_base and not p.requires_grad, n
    before_actor, before_critic = _snapshot(models.actor), _snapshot(critic)
    _update(lrn)
    after_actor, after_critic = _snapshot(models.actor), _snapshot(critic)
    for before, after in ((before_actor, after_actor), (before_critic, after_critic)):
        assert all(torch.equal(before[n], after[n]) for n in before if "lora_" not in n and ".head" not in n and not n.startswith("head."))  # fmt: skip
        assert any(not torch.equal(before[n], after[n]) for n in before if "lora_B" in n)
    assert not torch.equal(before_critic["head.weight"], after_critic["head.weight"])


def test_a_shared_critic_trains_its_head_and_the_actors_adapters() -> None:
    spec = small_spec(None, *LORA, "model.critic=shared", *VARIED_REWARD)
    lrn = learner(spec)
    models = lrn.setup.models
    assert models.critic is not None and models.critic.trunk is None and models.shared_critic
    assert {id(p) for p in models.critic_parameters()} == {
        id(p) for p in models.critic.head.parameters()
    }
    rows = demo_rows(4, 1)
    data, _ = lrn.collect(rows, [r["prompt"] for r in rows])
    b = data.batch.batch_size

    def adapter_grads(vf_coef: float) -> list[torch.Tensor]:
        lrn.setup.spec.train.vf_coef = vf_coef
        accumulate(lrn, data, torch.arange(b), b, train_actor=True)
        return [p.grad.clone() for p in models.actor_parameters()]

    with_critic, without = adapter_grads(1.0), adapter_grads(0.0)
    assert any(not torch.allclose(a, c) for a, c in zip(with_critic, without, strict=True))
    assert all(p.grad is not None for p in models.critic.head.parameters())


# ---------------------------------------------------------------------- errors
def test_target_modules_the_model_lacks_are_a_spec_error() -> None:
    spec = small_spec(None, *LORA, "model.lora.target_modules=[q, nope]")
    with pytest.raises(UserError) as info:
        build_models(spec, 1)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("model.lora.target_modules:")
    assert "'q', 'nope'" in message and "q_proj" in message and "down_proj" in message


def test_a_module_peft_cannot_adapt_is_a_spec_error() -> None:
    spec = small_spec(None, *LORA, "model.lora.target_modules=[input_layernorm]")
    with pytest.raises(UserError, match=r"^model\.lora\.target_modules: .*not supported") as info:
        build_models(spec, 1)
    assert "\n" not in str(info.value)


def test_named_target_modules_get_the_adapters() -> None:
    spec = small_spec(None, *LORA, *NO_CRITIC, "model.lora.target_modules=[q_proj, v_proj]")
    models = build_models(spec, 1)
    adapted = {n.split(".")[-4] for n, _ in models.actor.named_parameters() if "lora_A" in n}
    assert adapted == {"q_proj", "v_proj"}


# ---------------------------------------------------------------------- runs
def test_a_lora_run_with_a_kl_section_trains_and_resumes(tmp_path: Path) -> None:
    extra = [*LORA, *KL, *VARIED_REWARD, "output.save_every=1"]
    train(small_spec(tmp_path, "train.rounds=1", *extra))
    result = train(small_spec(tmp_path, "train.rounds=2", *extra), resume=True)
    assert result["rounds"] == 2 and result["resumed_from"] == 1
    records = read_metrics(tmp_path)
    assert [r["round"] for r in records] == [1, 2]
    assert all(r["kl"] is not None for r in records)
    assert records[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # adapters start at zero


def test_a_lora_checkpoint_stores_the_trained_parameters_alone(tmp_path: Path) -> None:
    """The actor's and a separate critic's adapters and the value head: not the frozen base
    weights, which are read again from the spec's model; a resume restores the adapters
    exactly, and refuses base weights other than those they were trained on."""
    spec = small_spec(tmp_path, *LORA, "train.rounds=1")
    train(spec)
    ckpt = tmp_path / "checkpoint"
    (actor,) = (ckpt / "actor").glob("*.safetensors")
    (critic,) = (ckpt / "critic").glob("*.safetensors")
    trained = learner(spec)
    actor_keys, critic_keys = set(load_file(actor)), set(load_file(critic))
    assert actor_keys == {
        n for n, p in trained.setup.models.actor.named_parameters() if p.requires_grad
    }
    assert all("lora_" in k for k in actor_keys)
    assert {k for k in critic_keys if "lora_" not in k} == {"head.weight", "head.bias"}
    assert len(critic_keys) > 2
    source = make_prompt_source(spec.data, spec.seed)
    assert load_checkpoint(tmp_path, trained.setup.models, trained.state, source) == 1
    saved = load_file(actor)
    for name, p in trained.setup.models.actor.named_parameters():
        if name in saved:
            assert torch.equal(p.detach(), saved[name]), name
    other = learner(spec)
    with torch.no_grad():  # another base model under the same adapters
        next(p for p in other.setup.models.actor.parameters() if not p.requires_grad).add_(1e-3)
    with pytest.raises(UserError, match="other base weights than those of the spec's"):
        load_checkpoint(
            tmp_path, other.setup.models, other.state, make_prompt_source(spec.data, spec.seed)
        )


# ---------------------------------------------------------------------- models by name
@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """The hub is offline; any connection attempt fails the test."""

    def refuse(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError(f"network access attempted: {args[1:2]}")

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


@pytest.mark.usefixtures("offline")
@pytest.mark.parametrize("key", ["model.actor", "model.critic_init"])
def test_an_unreachable_model_id_is_one_clear_error(key: str) -> None:
    spec = small_spec(None, f"{key}=ppokit-tests/no-such-model", "model.revision=v1")
    with pytest.raises(UserError) as info:
        build_models(spec, 1)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(
        f"{key}: 'ppokit-tests/no-such-model' is neither a local Hugging Face model directory "
        "nor a model id that could be downloaded: "
    )


@pytest.mark.usefixtures("offline")
def test_a_folder_without_a_config_is_not_looked_up_on_the_hub(tmp_path: Path) -> None:
    (tmp_path / "weights").mkdir()
    spec = small_spec(None, f"model.actor={tmp_path / 'weights'}")
    with pytest.raises(UserError, match=r"folder without config\.json"):
        build_models(spec, 1)
