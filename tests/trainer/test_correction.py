"""Rollout corrections in a run: with the float32 hf engine μ = π_old (mismatch metrics 0,
token_tis trains exactly like none); sampling in bfloat16 makes μ differ, the metrics show
it and the corrections act."""

from __future__ import annotations

from typing import Any

import pytest

from ppokit.metrics_table import metric
from ppokit.trainer import train
from ppokit.trainer.metrics import read_metrics
from tests.helpers.trainer import small_spec

RUN = ["train.rounds=2", "rollout.prompts_per_round=8", "rollout.n=4"]
MISMATCH = ("rollout/mismatch_k1", "rollout/mismatch_k3", "rollout/mismatch_max")


def _run(tmp_path: Any, name: str, *extra: str) -> list[dict[str, Any]]:
    train(small_spec(tmp_path / name, *RUN, *extra))
    return read_metrics(tmp_path / name)


def _measured(record: dict[str, Any]) -> dict[str, Any]:
    """A record without the host-side measurements (the table's timing rows) and the
    correction's own metrics."""
    return {
        k: v
        for k, v in record.items()
        if not (metric(k).timing or k.startswith("rollout/correction"))
    }


def test_on_policy_the_mismatch_is_zero_and_token_tis_trains_like_none(tmp_path) -> None:
    none = _run(tmp_path, "none")
    tis = _run(tmp_path, "tis", "policy.correction=token_tis")
    for h in none:
        assert all(h[k] == 0.0 for k in MISMATCH)  # auto: log π_old is the engine's log μ
        assert h["rollout/correction_weight_mean"] == 1.0
        assert h["rollout/correction_masked_frac"] == 0.0
    assert [_measured(h) for h in tis] == [_measured(h) for h in none]
    # π_old from the trainer's forward: the same policy through two code paths
    forward = _run(tmp_path, "forward", "rollout.logp_old=forward")
    for h in forward:
        assert abs(h["rollout/mismatch_k1"]) < 1e-5 and h["rollout/mismatch_max"] < 1e-4


def test_bfloat16_sampling_makes_a_mismatch_the_corrections_act_on(tmp_path) -> None:
    bf16 = "rollout.engine={name: hf, dtype: bfloat16}"
    plain = _run(tmp_path, "plain", bf16)
    for h in plain:
        assert h["rollout/mismatch_max"] > 1e-4  # 10x the float32 paths' bound above
        assert h["rollout/mismatch_k3"] > 0
    tis = _run(tmp_path, "tis", bf16, "policy.correction={name: token_tis, cap: 1.001}")
    # the truncated weights min(r_t, cap) differ from 1, and the loss from the plain run's
    assert all(h["rollout/correction_weight_mean"] != 1.0 for h in tis)
    assert [h["policy_loss"] for h in tis] != [h["policy_loss"] for h in plain]
    geo = _run(
        tmp_path, "geo", bf16, "policy.correction={name: geo_mask, low: 0.9999, high: 1.0001}"
    )
    assert all(h["rollout/correction_masked_rows"] > 0 for h in geo)
    assert all(h["rollout/correction_masked_frac"] > 0 for h in geo)
    assert [h["policy_loss"] for h in geo] != [h["policy_loss"] for h in plain]


@pytest.mark.parametrize("setting", ["rollout.logp_old=rollout"])
def test_taking_the_engines_log_probs_as_pi_old_hides_the_mismatch(tmp_path, setting: str) -> None:
    """``rollout.logp_old: rollout`` with a bf16 engine: log π_old is log μ, Δ = 0."""
    runs = _run(tmp_path, "r", "rollout.engine={name: hf, dtype: bfloat16}", setting)
    assert all(h["rollout/mismatch_max"] == 0.0 for h in runs)
