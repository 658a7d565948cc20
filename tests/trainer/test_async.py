"""Asynchronous rollouts on the tiny model: the hf engine's copy samples from the weights
one update behind the trainer's (float32: log μ equals those weights' log-probs), LoRA copies
only the adapters, and the spec refuses or warns about what does not fit the schedule."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
import torch

from ppokit.explain import explain
from ppokit.spec import SpecError, spec_warnings
from ppokit.trainer import train
from ppokit.trainer.metrics import read_metrics
from ppokit.trainer.producers import Asynchronous
from ppokit.trainer.prompts import format_prompts
from tests.helpers.trainer import demo_rows, learner, small_spec

STALE = ["rollout.max_staleness=1", "train.actor_lr=0.01", "train.rounds=4"]


def _draw(lrn: Any) -> Any:
    seen = [0]

    def draw() -> tuple[list[dict[str, Any]], list[str]]:
        rows = demo_rows(4, seed=seen[0])
        seen[0] += 1
        return rows, format_prompts(rows, lrn.setup.models.tokenizer, lrn.setup.spec.data)

    return draw


@pytest.mark.parametrize("engine", ["hf", "{name: hf, drop_ended: true}"])
def test_a_stale_batch_was_sampled_by_the_weights_one_update_earlier(tmp_path, engine) -> None:
    """Staleness 1, float32: every trained batch's log μ is the log-probs of the weights one
    update before the trainer's (1e-5) and not the trainer's own; the first two rounds train
    on samples of the initial weights; the rows record that version. With ``model.generate``
    and with the engine's own loop (``drop_ended``), from the engine's own generator."""
    lrn = learner(small_spec(tmp_path, *STALE, f"rollout.engine={engine}"))
    actor = lrn.setup.models.actor
    assert lrn.setup.engine.engine.model is not actor  # the engine samples from a copy of its own
    weights = {0: copy.deepcopy(actor)}  # version -> the actor's weights after that many updates
    rollouts = Asynchronous(lrn.setup, _draw(lrn), start=0)
    try:
        for k in range(1, 5):
            result = lrn.round_of(rollouts, k)
            ro = result.data.rollout
            version = max(0, k - 2)
            assert ro.version is not None and ro.version.tolist() == [version] * len(ro.version)
            assert float(result.metrics["rollout/staleness_max"]) == (k - 1) - version
            mask = ro.response_mask
            with torch.no_grad():
                sampler = lrn.setup.forwards.actor(weights[version], ro)[0] * mask
                before_update = lrn.setup.forwards.actor(weights[k - 1], ro)[0] * mask
            torch.testing.assert_close(ro.logp_rollout, sampler, atol=1e-5, rtol=0)
            if version != k - 1:  # π_old: the weights the update started from, not μ's
                assert (ro.logp_rollout - before_update).abs().max() > 1e-3
                torch.testing.assert_close(result.data.batch.logp_old, before_update)
            weights[k] = copy.deepcopy(actor)
            assert any(
                not torch.equal(a, b)
                for a, b in zip(weights[k].parameters(), weights[k - 1].parameters(), strict=True)
            )
    finally:
        rollouts.close()
        lrn.close()


def test_lora_copies_the_adapters_and_shares_the_base(tmp_path) -> None:
    lrn = learner(small_spec(tmp_path, *STALE, "model.lora={r: 4, alpha: 8}", "kl=null"))
    copy_ = lrn.setup.engine.engine.model
    mine = dict(copy_.named_parameters())
    theirs = dict(lrn.setup.models.actor.named_parameters())
    assert mine.keys() == theirs.keys()
    for name, p in theirs.items():
        if p.requires_grad:  # an adapter: a tensor of its own, equal until a push
            assert mine[name] is not p and torch.equal(mine[name], p)
        else:  # a base weight: the same tensor
            assert mine[name] is p
    with torch.no_grad():
        adapter = next(p for p in lrn.setup.models.actor.parameters() if p.requires_grad)
        adapter.add_(1.0)
    name = next(n for n, p in theirs.items() if p is adapter)
    assert not torch.equal(mine[name], adapter)
    lrn.setup.engine.sync()
    assert torch.equal(mine[name], adapter)
    lrn.close()


def test_an_asynchronous_run_with_episodes_remax_and_evaluation(tmp_path) -> None:
    """The echo game's episodes are played in the generation thread (the environment's calls
    there), ReMax's greedy baseline comes from the batch's weights, the evaluation after a
    round samples from the updated ones; the staleness and the waits are in every record."""
    out = tmp_path / "run"
    spec = small_spec(
        out,
        "rollout.max_staleness=1",
        "train.rounds=3",
        "critic=null",
        "rollout.n=1",
        "advantage=remax",
        "policy.loss=reinforce",
        "policy.correction=token_tis",
        "rollout.environment=echo",
        "data.options={turns: 3}",
        "reward=[]",
        "eval={prompts: 4, k: 1, every: 2, at_start: false}",
    )
    summary = train(spec)
    assert summary["rounds"] == 3
    records = read_metrics(out)
    assert [r["rollout/staleness_max"] for r in records] == [0.0, 1.0, 1.0]
    assert all(r["rollout/turns_mean"] > 1 for r in records)
    assert all(r["time_wait_engine"] >= 0 and r["time_wait_trainer"] >= 0 for r in records)
    assert "eval/accuracy" in records[1] and "eval/accuracy" in records[2]
    assert json.loads((out / "checkpoint" / "state.json").read_text())["round"] == 3
    assert not (out / "checkpoint" / "ahead").exists()  # nothing after the last round


def test_an_asynchronous_run_generates_no_greedy_batch_that_nothing_reads(
    tmp_path, monkeypatch
) -> None:
    """Without a component that reads a greedy baseline (GRPO), each round of an
    asynchronous run calls the engine once: for its sampled batch, never for a greedy one it
    would throw away (which would also advance a stateful environment)."""
    from ppokit.trainer.boundary import CheckedEngine

    calls: list[bool] = []
    generate = CheckedEngine.generate

    def counted(self, ids, attn, sampling):  # type: ignore[no-untyped-def]
        calls.append(bool(sampling.greedy))
        return generate(self, ids, attn, sampling)

    monkeypatch.setattr(CheckedEngine, "generate", counted)
    spec = small_spec(
        tmp_path / "run", "rollout.max_staleness=1", "train.rounds=3", "advantage=grpo",
        "critic=null", "policy.correction=token_tis",
    )  # fmt: skip
    assert train(spec)["rounds"] == 3
    assert calls == [False, False, False]


def test_the_spec_refuses_dynamic_sampling_and_warns_without_a_correction(tmp_path) -> None:
    with pytest.raises(SpecError) as err:
        small_spec(tmp_path, "rollout.max_staleness=1", "rollout.filter=informative")
    assert err.value.errors == [
        "rollout.filter: dynamic sampling (informative) decides during a round how many "
        "batches to generate, which batches generated ahead cannot follow: set "
        "rollout.filter: none or rollout.max_staleness: 0"
    ]
    assert spec_warnings(small_spec(tmp_path)) == []
    (line,) = spec_warnings(small_spec(tmp_path, "rollout.max_staleness=2"))
    assert line.startswith("policy.correction: none with rollout.max_staleness 2:")
    assert "against π_old at the update's weights" in line
    bypass = small_spec(tmp_path, "rollout.max_staleness=1", "rollout.logp_old=rollout")
    assert "against the engine's log μ itself" in spec_warnings(bypass)[0]
    fixed = small_spec(tmp_path, "rollout.max_staleness=1", "policy.correction=token_tis")
    assert spec_warnings(fixed) == []


def test_explain_states_the_decoupled_objective(tmp_path) -> None:
    text = explain(small_spec(tmp_path, "rollout.max_staleness=1", "policy.correction=token_tis"))
    for line in (
        "asynchronous: round k's batch comes from the weights after max(0, k − 2) updates "
        "(rollout.max_staleness: 1), generated while the rounds before it update",
        "μ: the engine's weights, up to 1 update(s) behind; π_old: a forward pass at the "
        "weights the update starts from (decoupled PPO)",
        "L_π = token_mean(ppo_clip(logp, logp_old, A, mask') · ω[:, None] · c, mask')",
        "c = token_tis(π_old/μ): the weight of the gap between the stale sampling weights "
        "and π_old",
    ):
        assert line in text, line
    sync = explain(small_spec(tmp_path))
    assert "rollout.max_staleness:" not in sync and "decoupled" not in sync
