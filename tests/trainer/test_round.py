"""One round of each advantage family, gradient accumulation, value positions, truncation
and both KL placements on the tiny model."""

from __future__ import annotations

import pytest
import torch

from ppokit.trainer import train
from ppokit.trainer.metrics import read_metrics
from ppokit.trainer.rollout import Rollout
from tests.helpers.trainer import accumulate, demo_rows, learner, small_spec

#: A reward that differs between responses of a random tiny model.
VARIED_REWARD = ["reward.name=regex", "reward.pattern='[a-m]'"]

FAMILIES = {
    "gae_separate": [],
    "gae_shared": ["model.critic=shared"],
    "grpo": ["advantage=grpo", "critic=null"],
    "remax": ["advantage=remax", "critic=null"],
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_one_round_per_family(tmp_path, family: str) -> None:
    spec = small_spec(tmp_path, "rollout.n=4", "output.sample_every=1", *FAMILIES[family])
    result = train(spec)
    (record,) = read_metrics(tmp_path)
    assert result["rounds"] == 1 and record["round"] == 1
    for key in ("reward_mean", "entropy", "policy_loss", "approx_kl", "grad_norm_actor"):
        assert record[key] is not None, key
    assert record["clipfrac"] is not None  # ppo_clip declares `clipped`
    has_critic = family.startswith("gae")
    assert (record["value_loss"] is not None) == has_critic
    assert (record["grad_norm_critic"] is not None) == has_critic
    assert any((tmp_path / "checkpoint" / "actor").glob("*.safetensors"))
    assert any((tmp_path / "checkpoint" / "critic").glob("*.safetensors")) == has_critic
    assert (tmp_path / "samples.jsonl").read_text().strip()
    assert (tmp_path / "curves.png").is_file()


def _grads(lrn, data, micro: int) -> list[torch.Tensor]:
    b = data.batch.batch_size
    accumulate(lrn, data, torch.arange(b), micro, train_actor=True)
    params = [*lrn.setup.models.actor.parameters(), *lrn.setup.models.critic_parameters()]
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in params]


@pytest.mark.parametrize(
    "extra",
    [
        [],
        ["model.critic=shared", "policy.aggregation=seq_mean_token_mean"],
        ["advantage=grpo", "critic=null", "policy.aggregation=seq_mean_token_sum_norm"],
        ["kl.coef=0.2", "kl.placement=loss", "policy.nll_coef=0.3", "policy.entropy_coef=0.1"],
    ],
)
def test_micro_batches_give_the_minibatch_gradient(tmp_path, extra: list[str]) -> None:
    spec = small_spec(tmp_path, "rollout.n=4", "rollout.max_new_tokens=6", *VARIED_REWARD, *extra)
    lrn = learner(spec)
    rows = demo_rows(4)
    data, _ = lrn.collect(rows, [r["prompt"] for r in rows])
    # perturb the policy so ratios differ from 1 (clipping and KL terms are active)
    with torch.no_grad():
        for p in lrn.setup.models.actor.parameters():
            p.add_(0.05 * torch.randn_like(p))
    whole = _grads(lrn, data, 16)
    micro = _grads(lrn, data, 4)
    assert any(g.abs().sum() > 0 for g in whole)
    for a, b in zip(whole, micro, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_value_at_t_depends_only_on_the_prefix(tmp_path) -> None:
    for kind in ("separate", "shared"):
        lrn = learner(small_spec(tmp_path, f"model.critic={kind}"))
        tok = lrn.setup.models.tokenizer
        enc = tok(["ab=", "c="], padding=True, return_tensors="pt")
        resp = torch.tensor([[5, 6, 7, 8, 9], [10, 11, 12, 13, 14]])
        mask = torch.ones_like(resp, dtype=torch.bool)
        t = 2
        changed = resp.clone()
        changed[:, t] = 40
        outs = []
        with torch.no_grad():
            for r in (resp, changed):
                ro = Rollout(enc.input_ids, enc.attention_mask, r, mask, mask[:, 0], None)
                shared = None
                if lrn.setup.models.shared_critic:
                    shared = lrn.setup.forwards.actor(lrn.setup.models.actor, ro)[2]
                outs.append(
                    lrn.setup.assembly.value(lrn.setup.forwards.critic_head_out(ro, shared))
                )
        # V(s_u) for u <= t reads tokens before u only: unchanged; V(s_{t+1}) sees token t
        torch.testing.assert_close(outs[0][:, : t + 1], outs[1][:, : t + 1])
        assert not torch.allclose(outs[0][:, t + 1], outs[1][:, t + 1])


@pytest.mark.parametrize("rule", ["terminal", "bootstrap", "exclude", "penalty"])
def test_truncation_flags_and_rules(tmp_path, rule: str) -> None:
    spec = small_spec(tmp_path, f"truncation={rule}", "rollout.max_new_tokens=2", "rollout.n=4")
    lrn = learner(spec)
    rows = demo_rows(4)
    data, _ = lrn.collect(rows, [r["prompt"] for r in rows])
    ro = data.rollout
    eos = lrn.setup.models.tokenizer.eos_token_id
    has_eos = (ro.response_ids == eos).any(1)
    assert torch.equal(ro.truncated, ~has_eos)
    assert ro.truncated.any()  # a random tiny model rarely ends within 2 tokens
    assert torch.equal(ro.truncated, ro.response_mask.all(1) & ~has_eos)
    batch = data.batch
    assert torch.isfinite(data.advantages).all()
    trunc = ro.truncated
    if rule == "bootstrap":  # V(s_T) kept on truncated rows only
        assert torch.equal(batch.terminal_values[~trunc], torch.zeros(int((~trunc).sum())))
        torch.testing.assert_close(batch.terminal_values[trunc], batch.bootstrap_values[trunc])
    elif rule == "exclude":  # truncated rows leave both losses
        assert not data.actor_mask[trunc].any()
        assert not data.value_mask[trunc].any()
        assert data.actor_mask[~trunc].any(1).all()
    elif rule == "penalty":
        last = batch.token_rewards[batch.last_mask]
        assert torch.equal(last[trunc], torch.full((int(trunc.sum()),), -1.0))
    else:
        assert torch.equal(batch.terminal_values, torch.zeros(batch.batch_size))


def test_kl_in_the_reward(tmp_path) -> None:
    spec = small_spec(tmp_path, "kl.coef=0.5", "kl.placement=reward", "kl.estimator=k1")
    lrn = learner(spec)
    with torch.no_grad():  # make the actor differ from the reference
        for p in lrn.setup.models.actor.parameters():
            p.add_(0.05 * torch.randn_like(p))
    rows = demo_rows(4)
    data, result = lrn.collect(rows, [r["prompt"] for r in rows])
    b = data.batch
    outcome = torch.where(b.last_mask, result.scores[:, None], 0.0)
    k1 = (b.logp_old - b.logp_ref) * b.maskf
    torch.testing.assert_close(b.token_rewards, outcome - 0.5 * k1)
    assert k1.abs().sum() > 0
    torch.testing.assert_close(result.metrics["kl"], k1.sum(1).mean())


def test_kl_in_the_loss_and_adaptive_coefficient(tmp_path) -> None:
    spec = small_spec(
        tmp_path,
        "kl.coef=0.1",
        "kl.placement=loss",
        "kl.estimator=k3",  # non-negative: the KL is > 0 once the actor has moved
        "kl.target=0.01",
        "kl.horizon=100",
        "train.rounds=3",
        "train.actor_lr=0.01",
    )
    train(spec)
    history = read_metrics(tmp_path)
    assert [h["round"] for h in history] == [1, 2, 3]
    assert history[0]["kl"] == pytest.approx(0.0, abs=1e-5)  # the reference is the initial actor
    assert history[-1]["kl"] > 0
    # round 3 saw a KL above target: beta grew by (1 + 0.2 * B / horizon) per round
    assert history[0]["kl_coef"] == pytest.approx(0.1)
    assert history[-1]["kl_coef"] > history[1]["kl_coef"] or history[1]["kl"] <= 0.01


def test_a_prompt_longer_than_the_context_is_an_error_or_truncated() -> None:
    import warnings

    import torch

    from ppokit.errors import UserError
    from ppokit.spec import validate_spec
    from ppokit.trainer.rollout import fit_context

    spec = validate_spec({"rollout": {"max_new_tokens": 4}})
    ids = torch.arange(20).reshape(2, 10)
    attn = torch.ones(2, 10, dtype=torch.long)
    attn[1, :5] = 0  # row 1: 5 padding tokens on the left
    with pytest.raises(UserError, match="10 tokens plus 4 new tokens does not fit"):
        fit_context(ids, attn, 12, 4, spec.data.long_prompts)
    data = spec.data.model_copy(update={"long_prompts": "truncate"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cut, cut_attn = fit_context(ids, attn, 12, 4, data.long_prompts)
    assert "its first 2 tokens are cut" in str(caught[0].message)
    assert torch.equal(cut, ids[:, 2:]) and torch.equal(cut_attn, attn[:, 2:])
    short = torch.ones(2, 10, dtype=torch.long)
    short[:, :3] = 0  # only padding beyond the room: cut silently
    kept, _ = fit_context(ids, short, 12, 4, spec.data.long_prompts)
    assert torch.equal(kept, ids[:, 2:])


def test_the_stack_from_ppokit_train_to_the_clipped_surrogate_is_the_documented_one(
    tmp_path, monkeypatch
) -> None:
    """docs/design.md names every frame from ``ppokit train`` to the clipped surrogate: at
    most 8, and exactly those."""
    import inspect
    import re
    import sys
    from pathlib import Path

    from typer.testing import CliRunner

    from ppokit import cli
    from ppokit.components.policy_loss import impl
    from tests.helpers.trainer import SMALL

    design = (Path(__file__).resolve().parents[2] / "docs" / "design.md").read_text()
    paragraph = re.search(r"the stack is (\d+) frames deep.*?\n\n", design, re.S)
    assert paragraph is not None
    documented = re.findall(r"`([\w.]+)`", paragraph.group(0).split(":", 1)[1])
    assert len(documented) == int(paragraph.group(1)) <= 8
    stacks: list[list[str]] = []
    real = impl.PPOClip.__call__
    command = inspect.unwrap(cli.train).__code__  # the command itself, not its error handler

    def spy(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        frame, names = sys._getframe(1), ["__call__"]  # this call stands for PPOClip's
        while frame is not None and frame.f_code is not command:
            names.append(frame.f_code.co_name)
            frame = frame.f_back
        assert frame is not None, "not called from ppokit train"
        stacks.append([*names, "train"][::-1])
        return real(self, *args, **kwargs)

    monkeypatch.setattr(impl.PPOClip, "__call__", spy)
    sets = [a for item in [*SMALL, "critic=null", "advantage=grpo"] for a in ("--set", item)]
    result = CliRunner().invoke(cli.app, ["train", *sets, "--out", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    assert stacks and stacks[0] == [name.rpartition(".")[2] for name in documented]


def test_the_rounds_micro_batches_give_the_minibatch_update(tmp_path) -> None:
    """A whole round (run_round's own update loops) with micro-batches of a quarter of the
    minibatch updates the parameters as with one micro-batch (float rounding apart)."""
    params = []
    for micro in ("null", "4"):
        spec = small_spec(
            tmp_path, "rollout.n=4", *VARIED_REWARD, "kl.coef=0.2", "kl.placement=loss",
            "policy.entropy_coef=0.1", f"train.micro_batch_size={micro}",
        )  # fmt: skip
        lrn = learner(spec)
        rows = demo_rows(4)
        torch.manual_seed(3)  # the minibatch order
        result = lrn.round(rows, [r["prompt"] for r in rows])
        assert not result.skipped
        params.append([p.detach().clone() for p in lrn.setup.models.actor.parameters()])
    whole, micro_batched = params
    start = list(learner(spec).setup.models.actor.parameters())  # the same seed: the same weights
    assert any(not torch.equal(a, b) for a, b in zip(start, whole, strict=True))
    for a, b in zip(whole, micro_batched, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
