"""End to end: smoke rounds of examples/specs/ppo_hlgauss.yaml through the ppokit trainer."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from safetensors import safe_open

from ppokit.registry import reset_registry
from ppokit.spec import load_spec
from ppokit.trainer import train

SPEC = Path(__file__).resolve().parents[3] / "examples" / "specs" / "ppo_hlgauss.yaml"


@pytest.fixture
def plugin_registry(monkeypatch: pytest.MonkeyPatch):
    """A registry built from the installed plugins, whatever the caller's PPOKIT_* switches."""
    monkeypatch.delenv("PPOKIT_LOAD_PLUGINS", raising=False)
    monkeypatch.delenv("PPOKIT_STRICT_PLUGINS", raising=False)
    reset_registry()
    yield
    reset_registry()


def test_smoke_rounds_build_a_categorical_critic(tmp_path: Path, plugin_registry: None) -> None:
    spec = load_spec(SPEC, overrides=["output.progress=false"])
    assert spec.critic is not None
    assert spec.critic.loss.name == "hlgauss"
    bins = spec.critic.loss.params["bins"]
    assert bins > 1  # a scalar head would have width 1

    summary = train(spec, smoke=True, smoke_out=str(tmp_path))
    assert summary["rounds"] == 2

    (critic,) = (tmp_path / "checkpoint" / "critic").glob("*.safetensors")  # one process's
    with safe_open(str(critic), "pt") as f:
        assert f.get_slice("head.weight").get_shape()[0] == bins
        assert f.get_slice("head.bias").get_shape() == [bins]

    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == [1, 2]
    for record in records:
        # the critic trained: its loss and gradient norm were reported, and are finite
        for key in ("value_loss", "grad_norm_critic", "policy_loss", "reward_mean"):
            assert record[key] is not None, key
        for key, value in record.items():
            if isinstance(value, float):
                assert math.isfinite(value), key
        # a cross-entropy to a distribution that is not one-hot is positive
        assert record["value_loss"] > 0
        assert record["vf_clipfrac"] is None  # hlgauss declares no clipping
