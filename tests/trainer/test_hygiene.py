"""Hot-path hygiene of a round on the tiny model: host reads, eval mode and no autograd graph
while sampling and scoring, and the sampling-time log-probs used as recorded."""

from __future__ import annotations

import math
import resource
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import ppokit
from ppokit.trainer.logprobs import token_logprobs
from ppokit.trainer.metrics import Meter, read_once
from ppokit.trainer.models import trunk_of
from tests.helpers.trainer import Trainee, demo_rows, learner, small_spec

PACKAGE = str(Path(ppokit.__file__).resolve().parent)

#: Tensor methods that read a tensor back to the host (or force a value on it).
HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")

#: The reads a round may make from ppokit's code: the check of the engine's output values
#: (one ``.tolist()`` of its flags a generation, which synchronises anyway), the decode of the
#: responses for the rewards (one ``.cpu()`` of the packed ids, lengths and truncation flags,
#: then two ``.tolist()`` of that host copy) and the single metrics read (one ``.cpu()`` of
#: the stacked metrics and one ``.tolist()`` of that host copy).
ALLOWED = Counter(
    {
        ("tolist", "_check_values"): 1,
        ("cpu", "decode_rows"): 1,
        ("tolist", "decode_rows"): 2,
        ("cpu", "read_once"): 1,
        ("tolist", "read_once"): 1,
    }
)


def allowed(optimizer_steps: int) -> Counter[tuple[str, str]]:
    """:data:`ALLOWED` plus the non-finite guard's reads (``NonFinite.read_problem``): one
    ``.tolist()`` of the NaN/inf counts of the rewards and estimates per round, and one per
    optimizer step of the counts of the loss terms, losses and gradient norms. The per-step
    read cannot wait for the round's end: whether a step's gradient norm is finite must be
    known on the host before ``opt.step()`` may apply it (on_nonfinite: a NaN never reaches
    the parameters)."""
    return ALLOWED + Counter({("tolist", "read_problem"): 1 + optimizer_steps})


@contextmanager
def host_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter[tuple[str, str]]]:
    """Counts (method, calling function) of every host read called from ppokit's code."""
    calls: Counter[tuple[str, str]] = Counter()

    def wrap(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def counted(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1).f_code
            if caller.co_filename.startswith(PACKAGE):
                calls[(name, caller.co_name)] += 1
            return original(self, *args, **kwargs)

        return counted

    with monkeypatch.context() as patch:
        for name in HOST_READS:
            patch.setattr(torch.Tensor, name, wrap(name, getattr(torch.Tensor, name)))
        yield calls


@contextmanager
def forward_log(modules: dict[str, nn.Module]) -> Iterator[list[tuple[str, bool, bool]]]:
    """(module name, training, grad enabled) at each forward of the given modules."""
    log: list[tuple[str, bool, bool]] = []
    handles = [
        module.register_forward_pre_hook(
            lambda mod, _args, name=name: log.append((name, mod.training, torch.is_grad_enabled()))
        )
        for name, module in modules.items()
    ]
    try:
        yield log
    finally:
        for h in handles:
            h.remove()


@contextmanager
def outside_generate(lrn: Trainee, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Counts the actor trunk's forwards that do not come from ``generate``."""
    actor = lrn.setup.models.actor
    state = {"inside": False}
    count = [0]
    original = actor.generate

    def generate(*args: Any, **kwargs: Any) -> Any:
        state["inside"] = True
        try:
            return original(*args, **kwargs)
        finally:
            state["inside"] = False

    def hook(_mod: nn.Module, _args: Any) -> None:
        if not state["inside"]:
            count[0] += 1

    handle = trunk_of(actor).register_forward_pre_hook(hook)
    monkeypatch.setattr(actor, "generate", generate)
    try:
        yield count
    finally:
        handle.remove()


def _round(lrn: Trainee, seed: int) -> tuple[Any, Any]:
    rows = demo_rows(4, seed)
    result = lrn.round(rows, [r["prompt"] for r in rows])
    return result.data, result


def test_a_round_reads_the_host_only_for_the_rewards_and_the_metrics(tmp_path, monkeypatch) -> None:
    lrn = learner(small_spec(tmp_path))
    _round(lrn, seed=1)  # warm-up: lazy initialisation outside the counted round
    with host_reads(monkeypatch) as calls:
        _, result = _round(lrn, seed=2)
        values = read_once(result.metrics)
    assert values["reward_mean"] is not None
    t = lrn.setup.spec.train
    assert t.minibatch_size is None  # the whole round is one minibatch: one step per epoch
    assert calls == allowed(optimizer_steps=t.ppo_epochs)


def test_the_peak_memory_is_the_process_peak_in_gib(tmp_path) -> None:
    """On a CPU the round reports the process's peak resident size (``ru_maxrss``, KiB on
    Linux) in GiB: between the peaks read before and after the round."""
    lrn = learner(small_spec(tmp_path))
    scale = 2**30 if sys.platform == "darwin" else 2**20  # ru_maxrss: bytes on macOS
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / scale
    _, result = _round(lrn, seed=1)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / scale
    assert before <= result.timings["peak_memory_gb"] <= after


def test_the_counter_sees_a_host_read_in_ppokit_code(monkeypatch) -> None:
    x = torch.ones(3)
    with host_reads(monkeypatch) as calls:
        read_once({"a": x.sum()})
        _ = x.sum().item()  # from this test file: not ppokit's code, not counted
    assert calls == Counter({("cpu", "read_once"): 1, ("tolist", "read_once"): 1})


def test_the_meter_averages_sums_over_counts_without_host_reads(monkeypatch) -> None:
    with host_reads(monkeypatch) as calls:
        meter = Meter()
        meter.add("loss", torch.tensor(3.0), 0.5)  # a micro-batch's share
        meter.add("loss", torch.tensor(1.0), 0.5)
        meter.add("kl", torch.tensor(6.0), torch.tensor(4.0))  # a sum over 4 tokens
        meter.add("kl", torch.tensor(0.0), torch.tensor(0.0))
        meter.add("never", torch.tensor(0.0), torch.tensor(0.0))
        meter.mean("norm", torch.tensor(2.0))
        meter.mean("norm", torch.tensor(4.0))
        means = meter.means()
    assert not calls
    values = {k: float(v) for k, v in means.items()}
    assert math.isnan(values.pop("never"))  # nothing counted: missing (None), never 0
    assert values == {"loss": 4.0, "kl": 1.5, "norm": 3.0}


@pytest.mark.parametrize("extra", [[], ["model.critic=shared"], ["kl.coef=0.1"]])
def test_sampling_and_scoring_run_in_eval_mode_without_a_graph(tmp_path, extra) -> None:
    lrn = learner(small_spec(tmp_path, *extra))
    _round(lrn, seed=1)  # the update leaves the models in train mode
    models = {"actor": trunk_of(lrn.setup.models.actor)}
    if lrn.setup.models.critic is not None:
        models["critic"] = lrn.setup.models.critic
    if lrn.setup.models.ref is not None:
        models["ref"] = trunk_of(lrn.setup.models.ref)
    with forward_log(models) as log:
        data, _ = _round(lrn, seed=2)
    first = next(i for i, (_, training, _) in enumerate(log) if training)  # the update's
    collect, update = log[:first], log[first:]
    assert {name for name, _, _ in collect} == set(models)
    assert all(not training and not grad for _, training, grad in collect), collect
    batch = data.batch
    for tensor in (batch.logp_old, batch.values, batch.logp_ref, data.advantages, data.targets):
        assert tensor is None or not tensor.requires_grad
    assert any(name == "actor" and training and grad for name, training, grad in update)


@pytest.mark.parametrize(
    ("extra", "actor_passes"),
    [([], 0), (["critic=null", "advantage=grpo"], 0), (["model.critic=shared"], 1)],
)
def test_collect_uses_the_recorded_logprobs(
    tmp_path, monkeypatch, extra: list[str], actor_passes: int
) -> None:
    lrn = learner(small_spec(tmp_path, *extra))
    rows = demo_rows(4)
    with outside_generate(lrn, monkeypatch) as count:
        data, _ = lrn.collect(rows, [r["prompt"] for r in rows])
    # no KL and no shared critic: the actor runs only inside generate; a shared critic's
    # values need exactly one pass of the actor's trunk
    assert count[0] == actor_passes
    assert data.batch.logp_old is data.rollout.logp_rollout
    assert data.batch.logp_rollout is data.rollout.logp_rollout
    assert data.rollout.logp_rollout is not None
    assert data.rollout.logp_rollout.dtype == torch.float32


@given(st.integers(1, 3), st.integers(1, 6), st.floats(0.3, 2.0), st.integers(1, 100))
@settings(max_examples=50, deadline=None)
def test_reference_pass_gives_the_full_pass_logprobs(
    b: int, t: int, temp: float, chunk: int
) -> None:
    g = torch.Generator().manual_seed(b * 100 + t)
    head = nn.Linear(5, 9, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(9, 5, generator=g))
    hidden = torch.randn(b, t, 5, generator=g)
    targets = torch.randint(0, 9, (b, t), generator=g)
    with torch.no_grad():
        full, _ = token_logprobs(hidden, head, targets, temp, chunk_elements=chunk)
        only, none = token_logprobs(hidden, head, targets, temp, chunk, entropy=False)
    assert none is None
    assert torch.equal(only, full)  # the same arithmetic: bit-identical
    assert only.dtype == torch.float32 and bool((only <= 0).all())


def test_reference_pass_hand_case() -> None:
    head = nn.Linear(1, 2, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.tensor([[1.0], [0.0]]))
    hidden = torch.tensor([[[2.0], [-2.0]]])  # logits / 2: [1, 0] then [-1, 0]
    lp, _ = token_logprobs(hidden, head, torch.tensor([[0, 1]]), temperature=2.0, entropy=False)
    e = torch.tensor(1.0).exp()
    expected = torch.stack([1 - (e + 1).log(), -(1 / e + 1).log()]).reshape(1, 2)
    torch.testing.assert_close(lp, expected)


@given(st.integers(1, 3), st.integers(1, 6), st.integers(1, 100), st.integers(0, 1000))
@settings(max_examples=50, deadline=None)
def test_checkpointing_changes_no_value_or_gradient(b: int, t: int, chunk: int, seed: int) -> None:
    """A head other than ``nn.Linear`` goes by chunks of positions: small calls keep their
    logits (one head pass per chunk), large ones recompute them in backward (two): the log-probs, entropies and gradients are the same. (Chunks of
    positions: a chunk holds one position's logits of every row at least; below that the
    chunks are tiles of the vocabulary, tests/trainer/test_logprobs.py.)"""
    chunk = max(chunk, b * 9)
    g = torch.Generator().manual_seed(seed)

    class Head(nn.Module):  # a head other than nn.Linear (a LoRA-wrapped one): by chunks
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(9, 5, generator=g))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.linear(x, self.weight)

    head = Head()
    calls = [0]
    head.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    hidden = torch.randn(b, t, 5, generator=g)
    targets = torch.randint(0, 9, (b, t), generator=g)
    w = torch.rand(2, b, t, generator=g)
    results, passes = [], []
    for minimum in (b * t * 9, 0):  # kept, then checkpointed
        h = hidden.clone().requires_grad_(True)
        head.zero_grad(set_to_none=True)
        calls[0] = 0
        lp, ent = token_logprobs(h, head, targets, 1.3, chunk, checkpoint_min_elements=minimum)
        ((lp * w[0]).sum() + (ent * w[1]).sum()).backward()
        assert h.grad is not None and head.weight.grad is not None
        results.append((lp.detach(), ent.detach(), h.grad, head.weight.grad))
        passes.append(calls[0])
    chunks = -(-t // max(1, chunk // (b * 9)))
    assert passes == [chunks, 2 * chunks]
    for kept, recomputed in zip(*results, strict=True):
        assert torch.equal(kept, recomputed)
