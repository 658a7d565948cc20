"""Chunked log-probs and entropies against a direct computation; rollout log-probs against
a fresh forward."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from ppokit.components.rollout_engine import Sampling, response_mask
from ppokit.components.rollout_engine.impl import filter_logits, generate
from ppokit.trainer.logprobs import token_logprobs
from ppokit.trainer.models import load_actor
from tests.helpers.sampled import truncated_logp
from tests.helpers.trainer import learner, small_spec


@given(
    st.integers(1, 4),
    st.integers(1, 7),
    st.floats(0.3, 2.0),
    st.integers(1, 200),
    st.integers(0, 1000),
    st.booleans(),
)
@settings(max_examples=50, deadline=None)
def test_chunked_logprobs_match_direct(
    b: int, t: int, temp: float, chunk: int, seed: int, bias: bool
) -> None:
    """Chunks of positions, and below b·vocab elements tiles of positions × vocabulary
    (:class:`VocabChunked`): the values and the gradients of the hidden states and of the
    head (its bias too) of the direct full-logits computation."""
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(8, 11, bias=bias)
    with torch.no_grad():
        head.weight.copy_(torch.randn(11, 8, generator=g))
        if bias:
            head.bias.copy_(torch.randn(11, generator=g))
    hidden = torch.randn(b, t, 8, generator=g, requires_grad=True)
    targets = torch.randint(0, 11, (b, t), generator=g)
    w, u = torch.randn(b, t, generator=g), torch.randn(b, t, generator=g)
    lp, ent = token_logprobs(hidden, head, targets, temp, chunk_elements=chunk)
    logsm = F.log_softmax(head(hidden) / temp, -1)
    ref_lp = logsm.gather(-1, targets[..., None]).squeeze(-1)
    ref_ent = -(logsm.exp() * logsm).sum(-1)
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=1e-5)
    params = [hidden, *head.parameters()]
    got = torch.autograd.grad((lp * w).sum() + (ent * u).sum(), params)
    want = torch.autograd.grad((ref_lp * w).sum() + (ref_ent * u).sum(), params)
    for a, e in zip(got, want, strict=True):  # float32 sums in another order: 1e-4
        torch.testing.assert_close(a, e, atol=1e-4, rtol=1e-4)


def test_vocabulary_tiles_hold_one_tile_of_logits() -> None:
    """A call whose one position's logits over its rows pass the chunk goes by tiles of
    positions × vocabulary: no tensor of a whole row's logits is ever made."""
    from ppokit.trainer import logprobs

    shapes: list[tuple[int, ...]] = []
    real = logprobs._tile_logits

    def watched(*args: Any) -> torch.Tensor:
        out = real(*args)
        shapes.append(tuple(out.shape))
        return out

    head = torch.nn.Linear(4, 97, bias=False)
    hidden = torch.randn(6, 5, 4, requires_grad=True)
    targets = torch.randint(0, 97, (6, 5))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(logprobs, "_tile_logits", watched)
        lp, ent = token_logprobs(hidden, head, targets, chunk_elements=64)
        assert ent is not None
        (lp.sum() + ent.sum()).backward()
    assert shapes and all(rows * cols <= 64 for rows, cols in shapes)
    assert hidden.grad is not None and hidden.grad.abs().sum() > 0


def test_logprob_hand_case() -> None:
    head = torch.nn.Linear(1, 2, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.tensor([[1.0], [0.0]]))
    hidden = torch.tensor([[[2.0]]])  # logits [2, 0], temperature 2 -> [1, 0]
    lp, ent = token_logprobs(hidden, head, torch.tensor([[0]]), temperature=2.0)
    p = torch.tensor(1.0).exp() / (torch.tensor(1.0).exp() + 1)
    torch.testing.assert_close(lp, p.log().reshape(1, 1))
    torch.testing.assert_close(ent, (-(p * p.log() + (1 - p) * (1 - p).log())).reshape(1, 1))


def test_response_mask_hand_case() -> None:
    eos = torch.tensor([2])
    ids = torch.tensor([[5, 2, 0, 0], [5, 6, 7, 8], [2, 0, 0, 0]])
    mask, truncated = response_mask(ids, eos)
    assert mask.tolist() == [
        [True, True, False, False],
        [True, True, True, True],
        [True, False, False, False],
    ]
    assert truncated.tolist() == [False, True, False]


def test_filter_logits_hand_case() -> None:
    x = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = filter_logits(x, top_k=0, top_p=0.7).isfinite()
    assert kept.tolist() == [[True, True, False, False]]
    assert filter_logits(x, top_k=3, top_p=1.0).isfinite().tolist() == [[True, True, True, False]]


def test_rollout_logp_old_equals_fresh_forward(tmp_path) -> None:
    spec = small_spec(tmp_path, "rollout.temperature=0.7")
    lrn = learner(spec)
    assert not lrn.setup.recompute_logp_old  # μ = π_old: the actor itself samples, untruncated
    torch.manual_seed(3)
    ro = lrn.sample(["a=", "bcd=", "x"], 3)
    assert ro.logp_rollout is not None
    with torch.no_grad():
        logp, _, _ = lrn.setup.forwards.actor(lrn.setup.models.actor, ro)
    torch.testing.assert_close(logp * ro.response_mask, ro.logp_rollout, atol=1e-5, rtol=1e-5)
    assert (ro.logp_rollout[~ro.response_mask] == 0).all()


@pytest.mark.parametrize("drop_ended", [False, True])
def test_top_k_top_p_record_mu_of_the_truncated_distribution(tmp_path, drop_ended) -> None:
    """Under top-k/top-p the engine samples from the kept tokens renormalised: log μ of each
    sampled token is log_softmax over them, not the full distribution's log-prob (whose
    exp sums over the kept tokens to less than 1); π_old then comes from a forward pass,
    so π_old/μ is the kept mass, which the mismatch metrics show."""
    spec = small_spec(
        tmp_path,
        "rollout.temperature=0.7",
        "rollout.top_k=5",
        "rollout.top_p=0.9",
        f"rollout.engine={{name: hf, drop_ended: {str(drop_ended).lower()}}}",
    )
    lrn = learner(spec)
    assert lrn.setup.recompute_logp_old  # π_old is not μ
    torch.manual_seed(3)
    ro = lrn.sample(["a=", "bcd=", "x"], 3)
    assert ro.logp_rollout is not None
    mu, full = truncated_logp(lrn, ro)
    mask = ro.response_mask
    torch.testing.assert_close(mu[mask], ro.logp_rollout[mask], atol=1e-4, rtol=1e-4)
    kept_mass = (full - mu).exp()[mask]  # π_old/μ
    assert (kept_mass <= 1 + 1e-4).all() and (kept_mass < 0.99).any()


def test_greedy_generation_is_deterministic() -> None:
    tok, model = load_actor("tiny", {"hidden_size": 32, "intermediate_size": 64}, 0)
    enc = tok(["a=", "b="], padding=True, return_tensors="pt")
    greedy = Sampling(max_new_tokens=5, greedy=True)
    eos = [tok.eos_token_id]
    one = generate(model, enc.input_ids, enc.attention_mask, greedy, eos, tok.pad_token_id)
    two = generate(model, enc.input_ids, enc.attention_mask, greedy, eos, tok.pad_token_id)
    assert torch.equal(one.response_ids, two.response_ids)
    assert one.logp is None
