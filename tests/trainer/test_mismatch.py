"""The engine/trainer mismatch where it breaks: the round's share of tokens whose π_old/μ
leaves the clip band and the importance weights' effective sample size (docs/engines.md),
the share of π/π_old outside the band during the update, and the ``stale_push`` sign of
docs/health.md on a run whose engine skips one weight push (and not on one that does not)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from ppokit.batch import RolloutBatch
from ppokit.components.rollout_engine import impl
from ppokit.spec import HealthSpec
from ppokit.trainer import train
from ppokit.trainer.estimation import clip_band, mismatch_metrics
from ppokit.trainer.health import check
from ppokit.trainer.metrics import read_metrics
from tests.helpers.trainer import small_spec


def _batch(delta: list[list[float]], mask: list[list[bool]]) -> RolloutBatch:
    m = torch.tensor(mask)
    logp_rollout = torch.full(m.shape, -1.0)
    return RolloutBatch(
        response_mask=m,
        token_rewards=torch.zeros(m.shape),
        logp_old=logp_rollout + torch.tensor(delta),
        logp_rollout=logp_rollout,
        group_ids=torch.arange(m.shape[0]),
    )


def test_the_share_outside_the_band_and_the_effective_sample_size() -> None:
    delta = [[0.0, math.log(1.3), 5.0], [math.log(0.7), 0.1, 0.0]]
    mask = [[True, True, False], [True, True, True]]  # the 5.0 is padding
    out = mismatch_metrics(_batch(delta, mask), (0.8, 1.2))
    w = torch.tensor([1.0, 1.3, 0.7, math.exp(0.1), 1.0])
    assert out["rollout/mismatch_outside"].item() == pytest.approx(2 / 5)
    ess = (w.sum() ** 2 / (5 * (w**2).sum())).item()
    assert out["rollout/mismatch_ess"].item() == pytest.approx(ess)
    equal = mismatch_metrics(_batch([[0.3, 0.3]], [[True, True]]))  # w constant: ESS/N = 1
    assert equal["rollout/mismatch_ess"].item() == pytest.approx(1.0)
    assert equal["rollout/mismatch_outside"].item() == 1.0  # e^0.3 > 1.2
    huge = mismatch_metrics(_batch([[200.0, 0.0]], [[True, True]]))  # one weight dominates
    assert huge["rollout/mismatch_ess"].item() == pytest.approx(0.5)


def test_the_band_is_the_policy_loss_clip() -> None:
    assert clip_band(small_spec()) == pytest.approx((0.8, 1.2))
    spec = small_spec(None, "policy.loss={name: ppo_clip, clip_low: 0.1, clip_high: 0.28}")
    assert clip_band(spec) == pytest.approx((0.9, 1.28))


def test_a_skipped_push_jumps_over_the_median_once() -> None:
    health = HealthSpec(grad_window=3)
    history = [{"round": r, "rollout/mismatch_k3": 2e-3} for r in range(1, 4)]
    jump = {"round": 4, "rollout/mismatch_k3": 3.5e-3}
    names = {f.sign.name for f in check(jump, history, health)}
    assert names == {"stale_push"}  # on its one round, not health.rounds of them
    assert check({**jump, "rollout/mismatch_k3": 2.9e-3}, history, health) == []
    stale = {**jump, "rollout/staleness_max": 1.0}  # asynchronous: by design
    assert check(stale, history, health) == []
    assert check(jump, [], health) == []  # no round before: nothing to compare with


def _run(tmp_path: Path, monkeypatch, skip: int | None) -> list[dict]:
    """The tiny model with an engine holding its own copy of the weights (the hf engine's
    frozen copy), whose push number ``skip`` does nothing."""
    pushes = []
    start, sync = impl.HFEngine.start, impl.HFEngine.sync

    def own_copy(self, context) -> None:
        start(self, context)
        self.model = impl.frozen_copy(context.model)

    def push(self) -> None:
        pushes.append(1)
        if len(pushes) != skip:
            sync(self)

    monkeypatch.setattr(impl.HFEngine, "start", own_copy)
    monkeypatch.setattr(impl.HFEngine, "sync", push)
    monkeypatch.setattr(impl.HFEngine, "samples_from_policy", property(lambda self: False))
    train(small_spec(tmp_path / "run", "train.rounds=4", "train.actor_lr=0.005"))
    return read_metrics(tmp_path / "run")


def test_a_skipped_push_fires_the_stale_push_sign(tmp_path: Path, monkeypatch) -> None:
    records = _run(tmp_path, monkeypatch, skip=2)  # the push after round 2's update
    assert [r.get("health/stale_push") for r in records] == [None, None, 1.0, None]
    assert records[2]["rollout/mismatch_ess"] < 0.99
    assert records[2]["rollout/mismatch_outside"] > 0
    assert all(r["rollout/mismatch_outside"] == 0 for i, r in enumerate(records) if i != 2)


def test_a_run_with_every_push_fires_none(tmp_path: Path, monkeypatch) -> None:
    records = _run(tmp_path, monkeypatch, skip=None)
    assert not any(k.startswith("health/") for r in records for k in r)
    assert all(r["rollout/mismatch_ess"] == pytest.approx(1.0, abs=1e-6) for r in records)
    # the update's ratio outside the band counts both sides, clipfrac only the clipped one
    assert all(r["ratio_outside"] >= r["clipfrac"] for r in records)
    assert any(r["ratio_outside"] > r["clipfrac"] for r in records)
