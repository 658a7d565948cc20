"""The model FLOPs of :mod:`ppokit.trainer.flops` against torch's own FLOP counter over a
real forward and backward pass, its identities, a hand-computed case, and the cached peak."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.flop_counter import FlopCounterMode

from ppokit.trainer import flops
from ppokit.trainer.flops import Shape, peak_flops


def tiny(layers: int, heads: int, kv: int, tied: bool) -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(
        vocab_size=48, hidden_size=8 * heads, intermediate_size=24, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, tie_word_embeddings=tied,
        attn_implementation="eager",
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


@settings(max_examples=12, deadline=None)
@given(
    layers=st.integers(1, 3),
    heads=st.sampled_from([2, 4]),
    tied=st.booleans(),
    length=st.integers(1, 12),
)
def test_the_count_is_torchs_over_a_dense_forward_and_backward(layers, heads, tied, length):
    """torch's FlopCounterMode over an eager (dense) forward counts 2·P·T + 4·L·d·T²; the
    backward adds twice the forward."""
    model = tiny(layers, heads, heads // 2, tied)
    ids = torch.randint(0, 48, (1, length))
    shape = Shape.of(model)
    expected = shape.forward(torch.tensor([length]), causal=False).item()
    with FlopCounterMode(display=False) as counter:
        model(ids)
    assert counter.get_total_flops() == expected
    with FlopCounterMode(display=False) as counter:
        model(ids).logits.sum().backward()
    assert counter.get_total_flops() == 3 * expected


def test_a_hand_computed_case():
    """P = 20480 (2 layers of q, k, v, o, gate, up, down at 32 wide, 2 kv heads, and the
    tied 64 x 32 head), L = 2, d = 32, T = 7: 2·P·7 + 2·2·32·7·8 causal, + 4·2·32·49 dense."""
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
    )  # fmt: skip
    shape = Shape.of(transformers.LlamaForCausalLM(config))
    assert shape == Shape(matmul=20480, layers=2, width=32)
    assert shape.forward(torch.tensor([7])).item() == 286720 + 7168
    assert shape.forward(torch.tensor([7]), causal=False).item() == 286720 + 12544


lengths = st.lists(st.integers(0, 40), min_size=1, max_size=6)


@settings(max_examples=50, deadline=None)
@given(p=lengths, r=lengths)
def test_generation_is_the_forward_of_all_but_the_last_token(p, r):
    """With a KV cache each position runs once, and the last sampled token never runs:
    generation(p, r) = forward(p + r - 1) row by row; a forward is a sum over its rows;
    causal attention costs at most the dense kernel."""
    k = min(len(p), len(r))
    prompts, responses = torch.tensor(p[:k]) + 1, torch.tensor(r[:k])
    shape = Shape(matmul=1000, layers=3, width=16)
    total = shape.generation(prompts, responses)
    expected = sum(
        shape.forward(torch.tensor([a + b - 1])) if b > 0 else 0.0
        for a, b in zip(prompts, responses, strict=True)
    )
    assert total.item() == pytest.approx(float(expected))
    t = prompts + responses
    assert shape.forward(t).item() == pytest.approx(sum(shape.forward(x[None]).item() for x in t))
    assert shape.forward(t).item() <= shape.forward(t, causal=False).item()


def test_the_peak_is_measured_once_and_kept(tmp_path, monkeypatch):
    """The first call measures and writes the cache; the next reads it; a cache that is not
    a mapping of numbers is measured again."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls: list[int] = []

    def measure(device, dtype, repeats=3):
        calls.append(1)
        return 1.5e9

    monkeypatch.setattr(flops, "_measure", measure)
    cpu = torch.device("cpu")
    assert peak_flops(cpu, torch.float32) == 1.5e9
    assert peak_flops(cpu, torch.float32) == 1.5e9
    assert len(calls) == 1
    cache = Path(tmp_path) / "ppokit" / "peak_flops.json"
    assert list(json.loads(cache.read_text()).values()) == [1.5e9]
    assert peak_flops(cpu, torch.bfloat16) == 1.5e9  # another dtype: its own entry
    assert len(calls) == 2
    cache.write_text("[not, a mapping")
    assert peak_flops(cpu, torch.float32) == 1.5e9
    assert len(calls) == 3


def test_a_measured_peak_is_a_plausible_throughput(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(flops, "PEAK_SIZE", 256)
    peak = peak_flops(torch.device("cpu"), torch.float32)
    assert 1e7 < peak < 1e15


@pytest.mark.parametrize(
    ("overrides", "runs"),
    [
        (["model.critic=separate", "train.ppo_epochs=2"], 0),
        (["model.critic=shared", "kl.coef=0.1", "rollout.logp_old=forward"], 3),
        (["critic=null", "advantage=grpo", "rollout.n=2"], 0),
    ],
    ids=["separate", "shared_kl_forward", "no_critic"],
)
def test_a_rounds_flops_are_its_passes_over_its_rows(tmp_path, overrides, runs):
    """The round's FLOPs are the passes it ran over its rows' own lengths: generation at
    every position but the last sampled token's, the no-grad forwards (log π_old when
    recomputed, the reference, the critic's values: a shared critic runs the actor's trunk
    again), and ppo_epochs forward and backward passes of the actor and a separate critic."""
    from ppokit.trainer.metrics import read_once
    from tests.helpers.trainer import demo_rows, learner, small_spec

    lrn = learner(small_spec(tmp_path, *overrides))
    rows = demo_rows(4)
    result = lrn.round(rows, [r["prompt"] for r in rows])
    values = read_once(result.metrics)
    setup, spec = lrn.setup, lrn.setup.spec
    ro = result.data.rollout
    prompts, responses = ro.prompt_mask.sum(1), ro.present.sum(1)
    actor = Shape.of(setup.models.actor)
    critic = setup.models.critic
    separate = None
    if critic is not None and not setup.models.shared_critic:
        separate = Shape.of(critic.trunk).forward(prompts + responses).item()
    whole = actor.forward(prompts + responses).item()
    assert values["flops_generate"] == pytest.approx(actor.generation(prompts, responses).item())
    assert values["flops_logprob"] == pytest.approx(runs * whole + (separate or 0.0), rel=1e-6)
    update = 3 * whole + 3 * (separate or 0.0)
    assert values["flops_update"] == pytest.approx(spec.train.ppo_epochs * update, rel=1e-6)


def test_a_run_logs_each_phases_utilisation(tmp_path, monkeypatch):
    """metrics.jsonl carries flops_* and mfu_* of each phase; mfu is FLOPs over seconds
    over the (here stubbed) peak."""
    from ppokit.runfolder import read_metrics
    from ppokit.trainer.loop import train
    from tests.helpers.trainer import small_spec

    monkeypatch.setattr(flops, "_measure", lambda device, dtype, repeats=3: 1e9)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    train(small_spec(tmp_path / "run", "train.rounds=2"))
    for record in read_metrics(tmp_path / "run"):
        for phase in ("generate", "logprob", "update"):
            seconds = record[f"time_{phase}"]
            expected = record[f"flops_{phase}"] / seconds / 1e9
            assert record[f"mfu_{phase}"] == pytest.approx(expected)
