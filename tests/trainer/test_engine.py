"""The rollout engine seam: the default engine keeps the recorded numbers, a plugin engine
(the one docs/engines.md prints) trains, the boundary names a broken engine, and
``rollout.logp_old`` decides where π_old comes from."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from ppokit.catalogue import Component, NoParams
from ppokit.components.rollout_engine import Generation, Sampling
from ppokit.errors import ComponentError
from ppokit.metrics_table import metric
from ppokit.spec import SpecError, load_spec
from ppokit.trainer import train
from ppokit.trainer.metrics import read_metrics
from tests.helpers import Plugin, module_from_page
from tests.helpers.trainer import DEMO, demo_rows, learner, small_spec

ROOT = Path(__file__).resolve().parents[2]
RECORDED = json.loads((Path(__file__).parent / "data" / "round_metrics.json").read_text())
BASE = [
    # the demo's model and learning rate when the numbers were recorded
    "model.tiny={num_attention_heads: 4, num_key_value_heads: 4}",
    "train.actor_lr=0.0005",
    "train.lr_schedule=constant",
    "output.progress=false",
    "train.rounds=3",
    "output.save_every=100",
    "output.sample_every=100",
]


def _measured(record: dict[str, Any]) -> dict[str, Any]:
    """A metrics record without the host-side measurements (times, speeds, memory: the
    table's timing rows)."""
    return {k: v for k, v in record.items() if not metric(k).timing}


#: The absolute slack of a recorded value: a quantity that is exactly 0 (the KL before the
#: first update, where the actor is the reference) comes out as the rounding of differences of
#: float32 log-probabilities of magnitude up to log(vocabulary) ~ 5, which depends on the CPU's
#: kernels (AVX2 or AVX-512): a few units of 5 * 2**-23 ~ 6e-7.
ABS = 8 * 5 * 2.0**-23


def _close(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return a == pytest.approx(b, rel=1e-5, abs=ABS)
    return a == b


# ---------------------------------------------------------------------- the default engine
@pytest.mark.parametrize(
    ("case", "extra"),
    [
        ("demo", []),
        ("demo", ["rollout.engine=hf"]),
        ("demo", ["rollout.engine={name: hf}", "rollout.logp_old=rollout"]),
        ("grpo_kl_loss", []),
        ("remax_kl_reward", []),
        ("eval_shared", []),
        ("remax_kl_reward", ["rollout.max_staleness=0"]),
    ],
)
def test_the_default_engine_gives_the_recorded_metrics(tmp_path, case: str, extra: list[str]):
    """Short runs at fixed seeds give the metrics recorded before the round became a recipe
    on the engine seam (tests/trainer/data/round_metrics.json): same rewards, losses, KL,
    evaluation; ``rollout.max_staleness: 0`` is that synchronous round (recorded before
    asynchronous rollouts existed)."""
    recorded = RECORDED[case]
    spec = load_spec(DEMO, [*BASE, *recorded["overrides"], *extra, f"output.dir={tmp_path}"])
    train(spec)
    got = [_measured(r) for r in read_metrics(tmp_path)]
    want = recorded["metrics"]
    assert [r["round"] for r in got] == [r["round"] for r in want]
    for g, w in zip(got, want, strict=True):
        # metrics added since the recording: the rollout's mismatch and correction, the
        # update's share of ratios outside the clip band, the passes' model FLOPs and the
        # lengths on each side of a group's mean, only
        added = g.keys() - w.keys()
        assert w.keys() <= g.keys() and all(
            (
                k.startswith(("rollout/", "flops_", "response_length_"))
                and k != "response_length_mean"
            )
            or k == "ratio_outside"
            for k in added
        )
        bad = {k: (g[k], w[k]) for k in w if not _close(g[k], w[k])}
        assert not bad, f"round {w['round']}: {bad}"


def test_forward_logp_old_matches_the_recorded_one_for_hf(tmp_path) -> None:
    """With the hf engine μ = π_old: the recomputed log π_old equals the recorded log μ;
    with top-k or top-p μ is the truncated π_old, and ``auto`` recomputes log π_old."""
    spec = small_spec(tmp_path, "rollout.logp_old=forward", "rollout.temperature=0.7")
    lrn = learner(spec)
    assert lrn.setup.recompute_logp_old
    rows = demo_rows(4)
    data, _ = lrn.collect(rows, [r["prompt"] for r in rows])
    batch = data.batch
    assert batch.logp_old is not None and batch.logp_rollout is not None
    assert batch.logp_old is not batch.logp_rollout
    torch.testing.assert_close(batch.logp_old, batch.logp_rollout, atol=1e-5, rtol=1e-5)
    assert not learner(small_spec(tmp_path)).setup.recompute_logp_old  # auto: hf samples the actor
    for top in ("rollout.top_k=5", "rollout.top_p=0.9"):
        assert learner(small_spec(tmp_path, top)).setup.recompute_logp_old


# ---------------------------------------------------------------------- a plugin engine
def test_the_documented_engine_plugin_trains(use_registry, tmp_path, monkeypatch) -> None:
    module = module_from_page("engines.md", "ppokit_plain_engine", tmp_path)
    monkeypatch.setitem(sys.modules, "ppokit_plain_engine", module)
    use_registry(module)
    spec = small_spec(tmp_path / "run", "rollout.engine=plain", "train.rounds=3")
    lrn = learner(spec)
    assert lrn.setup.recompute_logp_old  # not samples_from_policy: π_old from a forward pass
    rows = demo_rows(4)
    data, _ = lrn.collect(rows, [r["prompt"] for r in rows])
    # the engine's log μ and the trainer's π_old: the same policy through two code paths
    batch = data.batch
    assert batch.logp_old is not None and batch.logp_rollout is not None
    torch.testing.assert_close(batch.logp_old, batch.logp_rollout, atol=1e-4, rtol=1e-4)
    summary = train(spec)
    assert summary["rounds"] == 3
    history = read_metrics(tmp_path / "run")
    assert [h["round"] for h in history] == [1, 2, 3]
    assert all(h["response_length_mean"] > 0 for h in history)
    # reproducible: the engine seeds its own generator with (seed, process, round)
    spec2 = small_spec(tmp_path / "again", "rollout.engine=plain", "train.rounds=3")
    train(spec2)
    again = read_metrics(tmp_path / "again")
    assert [h["reward_mean"] for h in again] == [h["reward_mean"] for h in history]


def test_an_unknown_engine_is_one_line_with_suggestions(tmp_path) -> None:
    with pytest.raises(SpecError) as info:
        small_spec(tmp_path, "rollout.engine=hff")
    lines = info.value.errors
    assert len(lines) == 1
    assert lines[0].startswith("rollout.engine: unknown rollout_engine 'hff'")
    assert "'hf'" in lines[0]


# ---------------------------------------------------------------------- the boundary
class _Recorder:
    """Wraps the hf engine: counts the calls, optionally breaks the result."""

    calls: ClassVar[list[str]] = []
    mode: ClassVar[str] = "ok"

    def __init__(self) -> None:
        from ppokit.components.rollout_engine import HFParams
        from ppokit.components.rollout_engine.impl import HFEngine

        self.inner = HFEngine(**HFParams().model_dump())

    def start(self, context: Any) -> None:
        type(self).calls.append("start")
        self.inner.start(context)

    def generate(self, prompt_ids: Any, prompt_mask: Any, sampling: Sampling) -> Any:
        type(self).calls.append("greedy" if sampling.greedy else "generate")
        out = self.inner.generate(prompt_ids, prompt_mask, sampling)
        if self.mode == "short":
            return Generation(out.response_ids[1:], out.response_mask[1:], out.truncated[1:], None)
        if self.mode == "no_logp" and not sampling.greedy:
            return Generation(out.response_ids, out.response_mask, out.truncated, None)
        if self.mode == "raise":
            raise RuntimeError("the engine broke")
        return out

    def sync(self) -> None:
        type(self).calls.append("sync")

    def close(self) -> None:
        type(self).calls.append("close")


def _recorder_plugin() -> Plugin:
    return Plugin().add(
        Component("rollout_engine", "recorder", _Recorder, params=NoParams, summary="test")
    )


def test_the_trainer_starts_syncs_and_closes_the_engine(use_registry, tmp_path) -> None:
    use_registry(_recorder_plugin())
    _Recorder.calls, _Recorder.mode = [], "ok"
    train(small_spec(tmp_path, "rollout.engine=recorder", "train.rounds=2"))
    assert _Recorder.calls == ["start", "generate", "sync", "generate", "sync", "close"]


def test_remax_baseline_and_evaluation_use_the_engine(use_registry, tmp_path) -> None:
    use_registry(_recorder_plugin())
    _Recorder.calls, _Recorder.mode = [], "ok"
    spec = small_spec(
        tmp_path,
        "rollout.engine=recorder",
        "critic=null",
        "rollout.n=1",
        "advantage=remax",
        "eval={prompts: 2, k: 2, every: 1, at_start: false}",
    )
    train(spec)
    # round 1: samples, the greedy baseline, the update's sync, the evaluation (greedy, k)
    assert _Recorder.calls == ["start", "generate", "greedy", "sync", "greedy", "generate", "close"]


@pytest.mark.parametrize(
    ("mode", "message"),
    [
        ("short", r"returned response_ids as an int64 tensor of shape \[7, 4\]"),
        ("no_logp", r"returned no log-probs \(logp None\) for sampled responses"),
        ("raise", r"failed in generate: RuntimeError: the engine broke"),
    ],
)
def test_a_broken_engine_is_named_in_one_line(
    use_registry, tmp_path, mode: str, message: str
) -> None:
    use_registry(_recorder_plugin())
    _Recorder.calls, _Recorder.mode = [], mode
    spec = small_spec(tmp_path, "rollout.engine=recorder")
    with pytest.raises(ComponentError, match=r"^rollout.engine \(recorder, plugin test0\) ") as e:
        learner(spec).round(demo_rows(4), [r["prompt"] for r in demo_rows(4)], round_no=1)
    assert re.search(message, str(e.value))
    assert "\n" not in str(e.value)
