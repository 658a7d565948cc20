"""The ``hf`` engine's own decoding loop (``drop_ended``: rows that drew their EOS leave the
batch) against ``model.generate``, and its bfloat16 copy of the actor (``cast_copy``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ppokit.components.rollout_engine import Sampling
from ppokit.components.rollout_engine.impl import decode, generate
from ppokit.spec.models import SpecError
from ppokit.trainer.models import load_actor
from tests.helpers.sampled import truncated_logp
from tests.helpers.trainer import demo_rows, learner, small_spec

TINY = {"hidden_size": 32, "intermediate_size": 64}
PROMPTS = ["a=", "bcd=", "x", "hello there="]


@pytest.fixture(scope="module")
def actor() -> tuple[Any, torch.nn.Module]:
    tok, model = load_actor("tiny", TINY, 0)
    return tok, model.eval()


def _encode(tok: Any, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    enc = tok(prompts, padding=True, return_tensors="pt")
    return enc.input_ids, enc.attention_mask


def _batch_sizes(model: torch.nn.Module) -> tuple[list[int], Any]:
    """The rows of each forward pass ``model`` runs, and the hook's handle."""
    sizes: list[int] = []

    def hook(_: Any, __: Any, kwargs: dict[str, Any]) -> None:
        sizes.append(kwargs["input_ids"].shape[0])

    return sizes, model.register_forward_pre_hook(hook, with_kwargs=True)


@given(st.lists(st.sampled_from(PROMPTS), min_size=1, max_size=5), st.integers(0, 5))
@settings(max_examples=12, deadline=None)
def test_greedy_responses_are_model_generates(actor: Any, prompts: list[str], end: int) -> None:
    """Greedy: the same tokens, masks and truncation as ``model.generate``, with an EOS
    chosen among the tokens the rows draw, so rows end at different steps and leave."""
    tok, model = actor
    ids, mask = _encode(tok, prompts)
    greedy = Sampling(max_new_tokens=6, greedy=True)
    free = generate(model, ids, mask, greedy, [tok.vocab_size + 7], tok.pad_token_id)
    eos = [int(free.response_ids[0, end])]  # row 0 ends after step `end`
    want = generate(model, ids, mask, greedy, eos, tok.pad_token_id)
    got = generate(model, ids, mask, greedy, eos, tok.pad_token_id, drop_ended=True)
    assert torch.equal(got.response_mask, want.response_mask[:, : got.response_mask.shape[1]])
    assert not want.response_mask[:, got.response_mask.shape[1] :].any()
    assert torch.equal(got.response_ids[got.response_mask], want.response_ids[want.response_mask])
    assert torch.equal(got.truncated, want.truncated)
    assert got.logp is None


def test_ended_rows_leave_the_batch(actor: Any) -> None:
    """Hand case: row 0 ends at its first token; every later forward pass has one row fewer
    than the prompt batch, and the response keeps the rows' order."""
    tok, model = actor
    ids, mask = _encode(tok, PROMPTS)
    greedy = Sampling(max_new_tokens=4, greedy=True)
    free = generate(model, ids, mask, greedy, [tok.vocab_size + 7], tok.pad_token_id)
    first = int(free.response_ids[0, 0])
    ends = [int(i) for i, t in enumerate(free.response_ids[:, 0]) if int(t) == first]
    sizes, handle = _batch_sizes(model)
    try:
        with torch.no_grad():
            got = decode(model, ids, mask, greedy, [first], tok.pad_token_id)
    finally:
        handle.remove()
    assert sizes == [len(PROMPTS)] + [len(PROMPTS) - len(ends)] * 3
    assert got.response_mask[ends].sum(1).tolist() == [1] * len(ends)
    kept = [i for i in range(len(PROMPTS)) if i not in ends]
    assert torch.equal(got.response_ids[kept], free.response_ids[kept])


def test_every_row_ended_stops_decoding(actor: Any) -> None:
    tok, model = actor
    ids, mask = _encode(tok, PROMPTS[:2])
    greedy = Sampling(max_new_tokens=5, greedy=True)
    free = generate(model, ids, mask, greedy, [tok.vocab_size + 7], tok.pad_token_id)
    eos = sorted({int(t) for t in free.response_ids[:, 0]})
    sizes, handle = _batch_sizes(model)
    try:
        with torch.no_grad():
            got = decode(model, ids, mask, greedy, eos, tok.pad_token_id)
    finally:
        handle.remove()
    assert sizes == [2]  # the prompts' pass only
    assert got.response_ids.shape == (2, 1) and not got.truncated.any()


@pytest.mark.parametrize("top", [(0, 1.0), (5, 0.8)])
def test_sampled_draws_are_model_generates_while_no_row_ends(actor: Any, top: Any) -> None:
    """Sampling from a seeded generator with no row ending: the very draws of
    ``model.generate`` (the same filtered softmax, the same generator), and the same log μ."""
    tok, model = actor
    ids, mask = _encode(tok, PROMPTS)
    sampling = Sampling(n=2, max_new_tokens=6, temperature=0.7, top_k=top[0], top_p=top[1], seed=5)
    never = [tok.vocab_size + 7]
    want = generate(model, ids, mask, sampling, never, tok.pad_token_id, own_generator=True)
    got = generate(
        model, ids, mask, sampling, never, tok.pad_token_id, own_generator=True, drop_ended=True
    )
    assert torch.equal(got.response_ids, want.response_ids)
    assert got.logp is not None and want.logp is not None
    torch.testing.assert_close(got.logp, want.logp, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("lora", [[], ["model.lora.r=4", "model.lora.alpha=8"]])
def test_rollout_logp_is_a_fresh_forwards(tmp_path, lora: list[str]) -> None:
    """log μ recorded as each token is drawn is the log-prob a fresh forward pass over the
    whole response gives (with top-k/top-p, of the kept tokens renormalised), rows that ended
    early included; the actor with LoRA adapters too."""
    spec = small_spec(
        tmp_path,
        *lora,
        "rollout.engine={name: hf, drop_ended: true}",
        "rollout.temperature=0.7",
        "rollout.top_k=20",
        "rollout.top_p=0.9",
        "rollout.max_new_tokens=12",
    )
    lrn = learner(spec)
    torch.manual_seed(3)
    ro = lrn.sample(["a=", "bcd=", "x"], 4)
    assert ro.logp_rollout is not None
    assert ro.response_mask.sum(1).min() < ro.response_mask.shape[1]  # a row ended early
    mu, _ = truncated_logp(lrn, ro)
    mask = ro.response_mask
    torch.testing.assert_close(mu[mask], ro.logp_rollout[mask], atol=1e-5, rtol=1e-5)
    assert (ro.logp_rollout[~mask] == 0).all()


def test_a_cast_copy_samples_and_follows_the_actor(tmp_path) -> None:
    """``cast_copy``: the engine samples from a bfloat16 copy; the actor's own weights stay
    float32 (nothing shared), the trainer recomputes log π_old, and after a round's update
    the copy holds the actor's new weights."""
    spec = small_spec(
        tmp_path, "rollout.engine={name: hf, dtype: bfloat16, cast_copy: true, drop_ended: true}"
    )
    lrn = learner(spec)
    engine = lrn.setup.engine.engine
    actor = lrn.setup.models.actor
    assert engine.model is not actor and not lrn.setup.engine.samples_from_policy
    assert all(p.dtype == torch.bfloat16 for p in engine.model.parameters())
    assert all(p.dtype == torch.float32 for p in actor.parameters())
    before = {n: p.clone() for n, p in actor.named_parameters()}
    rows = demo_rows(8)
    lrn.round(rows, [r["prompt"] for r in rows])
    copied = dict(engine.model.named_parameters())
    moved = [n for n, p in actor.named_parameters() if not torch.equal(p, before[n])]
    assert moved
    for name in moved:
        assert torch.equal(copied[name], dict(actor.named_parameters())[name].to(torch.bfloat16))


def test_cast_copy_needs_a_dtype() -> None:
    with pytest.raises(SpecError, match="cast_copy needs dtype bfloat16 or float16"):
        small_spec(None, "rollout.engine={name: hf, cast_copy: true}")


def test_progress_counts_steps_of_the_whole_call(actor: Any) -> None:
    """The live display hears step 0, then each decoding step, always for the call's rows
    (a row that leaves does not start a new pass on the display)."""
    tok, model = actor
    ids, mask = _encode(tok, PROMPTS)
    greedy = Sampling(max_new_tokens=5, greedy=True)
    free = generate(model, ids, mask, greedy, [tok.vocab_size + 7], tok.pad_token_id)
    heard: list[tuple[int, int, int]] = []
    got = generate(
        model, ids, mask, greedy, [int(free.response_ids[0, 1])], tok.pad_token_id,
        lambda *step: heard.append(step), drop_ended=True,
    )  # fmt: skip
    width = got.response_ids.shape[1]
    assert heard == [(s, 5, len(PROMPTS)) for s in range(width + 1)]
