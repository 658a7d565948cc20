"""Chunked log-probs and entropies against a direct computation; rollout log-probs against
a fresh forward."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from ppokit.components.rollout_engine import Sampling, response_mask
from ppokit.components.rollout_engine.impl import filter_logits, generate
from ppokit.trainer.logprobs import token_logprobs
from ppokit.trainer.models import load_actor
from tests.helpers.trainer import learner, small_spec


@given(
    st.integers(1, 4),
    st.integers(1, 7),
    st.floats(0.3, 2.0),
    st.integers(1, 200),
    st.integers(0, 1000),
)
@settings(max_examples=50, deadline=None)
def test_chunked_logprobs_match_direct(b: int, t: int, temp: float, chunk: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(8, 11, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(11, 8, generator=g))
    hidden = torch.randn(b, t, 8, generator=g, requires_grad=True)
    targets = torch.randint(0, 11, (b, t), generator=g)
    lp, ent = token_logprobs(hidden, head, targets, temp, chunk_elements=chunk)
    logsm = F.log_softmax(head(hidden) / temp, -1)
    ref_lp = logsm.gather(-1, targets[..., None]).squeeze(-1)
    ref_ent = -(logsm.exp() * logsm).sum(-1)
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=1e-5)
    (g1,) = torch.autograd.grad((lp.sum() + ent.sum()), hidden)
    (g2,) = torch.autograd.grad((ref_lp.sum() + ref_ent.sum()), hidden)
    torch.testing.assert_close(g1, g2, atol=1e-5, rtol=1e-5)


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
    spec = small_spec(tmp_path, "rollout.temperature=0.7", "rollout.top_k=20", "rollout.top_p=0.9")
    lrn = learner(spec)
    torch.manual_seed(3)
    ro = lrn.sample(["a=", "bcd=", "x"], 3)
    assert ro.logp_rollout is not None
    with torch.no_grad():
        logp, _, _ = lrn.forwards.actor(lrn.models.actor, ro)
    torch.testing.assert_close(logp * ro.response_mask, ro.logp_rollout, atol=1e-5, rtol=1e-5)
    assert (ro.logp_rollout[~ro.response_mask] == 0).all()


def test_greedy_generation_is_deterministic() -> None:
    tok, model = load_actor("tiny", {"hidden_size": 32, "intermediate_size": 64}, 0)
    enc = tok(["a=", "b="], padding=True, return_tensors="pt")
    greedy = Sampling(max_new_tokens=5, greedy=True)
    eos = [tok.eos_token_id]
    one = generate(model, enc.input_ids, enc.attention_mask, greedy, eos, tok.pad_token_id)
    two = generate(model, enc.input_ids, enc.attention_mask, greedy, eos, tok.pad_token_id)
    assert torch.equal(one.response_ids, two.response_ids)
    assert one.logp is None
