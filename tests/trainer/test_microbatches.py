"""Micro-batches by a token budget (``train.micro_batch_tokens``, ``train.pack_sequences``)
change no loss and no gradient: whatever the grouping of a minibatch's rows, padded to each
micro-batch's own longest row or packed into one row, the minibatch loss and every
parameter's gradient are those of the whole minibatch in one padded pass, to float32
rounding, for every aggregation, with a critic (separate and shared), with multi-turn rows
(the environment's tokens inside the responses) and with KL, entropy and NLL terms. The
no-grad passes (log π_old, V_old, log π_ref) by micro-batches give the padded pass's values.
Two processes: tests/trainer/test_distributed.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from ppokit.errors import UserError
from ppokit.spec import SpecError
from ppokit.trainer.estimation import UpdateData, estimate, round_batch
from ppokit.trainer.metrics import Meter
from ppokit.trainer.microbatches import Micro, MicroBatches, plan
from ppokit.trainer.rollout import Rollout
from tests.helpers.tolerance import gamma
from tests.helpers.trainer import Trainee, encode, learner, small_spec, with_observations

PROMPTS = ["a", "bcdefgh", "ij", "klmnopqrstu"]
N, T = 3, 7
#: Response lengths of the 12 rows (prompt i's responses are rows 3i..3i+2).
LENGTHS = [7, 2, 5, 1, 6, 3, 7, 4, 2, 5, 1, 6]
SCORES = [1.0, 0.0, 0.5, 1.0, 1.0, 1.0, 0.0, 0.25, 0.0, 1.0, 0.0, 0.5]

COMMON = [
    f"rollout.prompts_per_round={len(PROMPTS)}",
    f"rollout.n={N}",
    f"rollout.max_new_tokens={T}",
    "rollout.logp_old=forward",
    "policy.entropy_coef=0.05",
    "policy.nll_coef=0.2",
    "policy.correction={name: token_tis, cap: 1.02}",
]
#: Every aggregation, each with a critic of another kind (or none), KL in another place, and
#: two of them on multi-turn rows (the environment's tokens inside the responses).
CONFIGS: dict[str, list[str]] = {
    "token_mean, separate critic, multi-turn": ["policy.aggregation=token_mean"],
    "seq_mean_token_mean, shared critic, kl in the loss": [
        "policy.aggregation=seq_mean_token_mean",
        "model.critic=shared",
        "critic.aggregation=seq_mean_token_mean",
        "kl={estimator: k3, coef: 0.1, placement: loss}",
    ],
    "seq_mean_token_sum, no critic, kl in the reward, multi-turn": [
        "policy.aggregation=seq_mean_token_sum",
        "advantage=grpo",
        "critic=null",
        "kl={estimator: k1, coef: 0.1, placement: reward}",
    ],
    "seq_mean_token_sum_norm, separate critic, clipped value loss": [
        "policy.aggregation=seq_mean_token_sum_norm",
        "critic.loss=clipped_mse",
    ],
}

_CACHE: dict[str, tuple[Trainee, UpdateData, dict[str, Tensor]]] = {}


def _rollout(lrn: Trainee, multiturn: bool) -> Rollout:
    """Prompts of 1-11 tokens, 3 random responses each of LENGTHS, log μ off the actor's."""
    ids, attn = encode(lrn, PROMPTS, N)
    g = torch.Generator().manual_seed(11)
    vocab = lrn.setup.models.actor.config.vocab_size
    response = torch.randint(3, vocab, (len(LENGTHS), T), generator=g)
    mask = torch.arange(T)[None, :] < torch.tensor(LENGTHS)[:, None]
    ro = Rollout(ids, attn, response.masked_fill(~mask, 0), mask, mask.all(1), None)
    with torch.no_grad():
        logp, _, _ = lrn.setup.forwards.actor(lrn.setup.models.actor, ro)
    ro.logp_rollout = (logp + 0.02 * torch.randn(logp.shape, generator=g)) * mask
    return with_observations(ro) if multiturn else ro


def _case(name: str) -> tuple[Trainee, UpdateData, dict[str, Tensor]]:
    """The round's estimates of a config (padded no-grad passes), the models then moved."""
    key = name
    if key not in _CACHE:
        spec = small_spec(None, *COMMON, *CONFIGS[name])
        lrn = learner(spec)
        ro = _rollout(lrn, multiturn="multi-turn" in name)
        scores = torch.tensor(SCORES)
        batch = round_batch(
            ro, scores, None, n=N, forwards=lrn.setup.forwards, assembly=lrn.setup.assembly,
            recompute_logp_old=True,
        )  # fmt: skip
        data, _, _ = estimate(
            ro, batch, scores, spec=spec, assembly=lrn.setup.assembly, kl_coef=lrn.state.kl_coef
        )
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():  # ratios off 1, values off V_old: clipping active
            for p in [*lrn.setup.models.actor.parameters(), *lrn.setup.models.critic_parameters()]:
                p.add_(0.05 * torch.randn(p.shape, generator=g))
        lrn.setup.forwards.train_mode()
        fields = {"logp_old": batch.logp_old, "values": batch.values, "logp_ref": batch.logp_ref}
        _CACHE[key] = lrn, data, {k: v for k, v in fields.items() if v is not None}
    return _CACHE[key]


def _micro_batches(lrn: Trainee, data: UpdateData, budget: int, pack: bool) -> MicroBatches:
    train = lrn.setup.spec.train.model_copy(
        update={"micro_batch_tokens": budget, "pack_sequences": pack, "micro_batch_size": None}
    )
    return MicroBatches.of(train, data.rollout)


def _loss_and_grads(
    lrn: Trainee, data: UpdateData, idx: Tensor, micros: list[Micro], tokens: bool, pack: bool
) -> tuple[Tensor, dict[str, Tensor]]:
    """The minibatch ``idx``'s loss, the sum of its micro-batches' (run_round's step 5
    without the step), and the gradient of every trainable parameter."""
    forwards, objective = lrn.setup.forwards, lrn.setup.objective
    forwards.tokens, forwards.pack = tokens, pack
    try:
        lrn.state.optimizers.zero_grad()
        denoms = objective.denominators(data, idx)
        total = torch.zeros(())
        for m in micros:
            share = m.index.shape[0] / idx.shape[0]
            loss = objective.micro_loss(
                data, m.index, denoms, share, lrn.state.kl_coef, True, Meter(),
                m.rollout(data.rollout),
            )  # fmt: skip
            loss.backward()
            total = total + loss.detach()
    finally:
        forwards.tokens = forwards.pack = False
    models = lrn.setup.models
    named = [("actor", models.actor), ("critic", models.critic)]
    grads = {
        f"{who}.{n}": p.grad.clone()
        for who, module in named
        if module is not None
        for n, p in module.named_parameters()
        if p.grad is not None
    }
    return total, grads


def _bound(data: UpdateData, lrn: Trainee) -> float:
    """Relative float32 gap allowed between two groupings' gradients (or losses): the
    padded and the cut passes round each of their sums in another order, the longest a sum
    over every position and hidden unit of the minibatch (γ(n), Higham's bound, twice)."""
    ids, _ = data.rollout.inputs()
    hidden = lrn.setup.models.actor.config.hidden_size
    return 2 * gamma(ids.numel() * hidden)


@pytest.mark.parametrize("name", list(CONFIGS))
@given(
    budget=st.integers(8, 120),
    pack=st.booleans(),
    rows=st.integers(2, len(LENGTHS)),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=6, deadline=None)
def test_the_grouping_changes_no_loss_and_no_gradient(
    name: str, budget: int, pack: bool, rows: int, seed: int
) -> None:
    lrn, data, _ = _case(name)
    perm = torch.randperm(len(LENGTHS), generator=torch.Generator().manual_seed(seed))
    idx = perm[:rows]  # a minibatch of the round, its rows in shuffled order
    whole = [Micro(idx)]
    expected, want = _loss_and_grads(lrn, data, idx, whole, tokens=False, pack=False)
    micros = _micro_batches(lrn, data, budget, pack).minibatches(idx, rows, torch.device("cpu"))
    [(got_idx, groups)] = micros
    assert torch.equal(got_idx, idx)
    covered = torch.cat([m.index for m in groups]).sort().values
    assert torch.equal(covered, idx.sort().values)  # every row once
    loss, got = _loss_and_grads(lrn, data, idx, groups, tokens=True, pack=pack)
    bound = _bound(data, lrn)
    scale = max(abs(float(expected)), 1e-6)
    assert abs(float(loss - expected)) <= bound * scale, (float(loss), float(expected))
    assert set(got) == set(want)
    assert any(g.abs().sum() > 0 for g in want.values())
    for key, g in want.items():
        gap = float((got[key] - g).norm() / g.norm().clamp_min(1e-30))
        assert gap <= bound or float(g.norm()) < 1e-9, (key, gap)


@pytest.mark.parametrize("name", list(CONFIGS)[:2])
@pytest.mark.parametrize("pack", [False, True], ids=["padded", "packed"])
def test_no_grad_passes_by_micro_batches_give_the_padded_values(name: str, pack: bool) -> None:
    """log π_old, V_old and log π_ref from micro-batches of 20 tokens (padded to their own
    longest rows, or packed) are the padded pass's, 0 off the response."""
    lrn, data, padded = _case(name)
    ro, scores = data.rollout, torch.tensor(SCORES)
    micro = _micro_batches(lrn, data, 20, pack)
    forwards = lrn.setup.forwards
    forwards.tokens, forwards.pack = True, pack
    lrn.setup.forwards.eval_mode()
    try:
        # the models moved since the padded pass: compare against a padded pass of now
        forwards.tokens = forwards.pack = False
        now = round_batch(
            ro,
            scores,
            None,
            n=N,
            forwards=forwards,
            assembly=lrn.setup.assembly,
            recompute_logp_old=True,
        )
        forwards.tokens, forwards.pack = True, pack
        cut = round_batch(
            ro, scores, None, n=N, forwards=forwards, assembly=lrn.setup.assembly,
            recompute_logp_old=True, micro=micro,
        )  # fmt: skip
    finally:
        forwards.tokens = forwards.pack = False
        lrn.setup.forwards.train_mode()
    assert len(micro.whole(len(LENGTHS), torch.device("cpu"))) > 1
    for field in padded:
        a, b = getattr(now, field), getattr(cut, field)
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
        assert (b[~ro.response_mask] == 0).all()
    if now.bootstrap_values is not None:
        torch.testing.assert_close(cut.bootstrap_values, now.bootstrap_values, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------- the plan
@given(
    st.lists(st.integers(1, 60), min_size=1, max_size=30),
    st.integers(1, 200),
    st.booleans(),
    st.integers(0, 40),
)
@settings(max_examples=200, deadline=None)
def test_plan_keeps_every_row_once_within_the_budget(
    lengths: list[int], budget: int, pack: bool, count: int
) -> None:
    groups = plan(lengths, budget, pack, count)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert all(g for g in groups)
    for g in groups:
        cost = sum(lengths[i] for i in g) if pack else len(g) * max(lengths[i] for i in g)
        assert cost <= budget or len(g) == 1
        if not pack:  # longest first: the group's first row is its longest
            assert lengths[g[0]] == max(lengths[i] for i in g)
    assert len(groups) >= min(count, len(lengths))  # as many as asked when rows allow
    if count <= len(plan(lengths, budget, pack)):
        assert groups == plan(lengths, budget, pack)  # a count met already changes nothing


def test_plan_hand_cases() -> None:
    # padded: rows x the longest row <= 12; longest first, ties in order
    assert plan([4, 2, 4, 3, 13], 12) == [[4], [0, 2, 3], [1]]
    # packed: first fit, longest first
    assert plan([4, 2, 4, 3, 13], 12, pack=True) == [[4], [0, 2, 3], [1]]
    assert plan([5, 5, 5, 3], 10, pack=True) == [[0, 1], [2, 3]]
    # four groups asked for: the costliest group split in two
    assert plan([4, 2, 4, 3, 13], 12, count=4) == [[4], [0], [2, 3], [1]]


def test_cut_drops_only_padding() -> None:
    ids = torch.tensor([[0, 0, 5, 6], [0, 7, 8, 9]])
    pmask = (ids != 0).long()
    resp = torch.tensor([[1, 2, 0], [3, 0, 0]])
    mask = resp != 0
    ro = Rollout(ids, pmask, resp, mask, torch.tensor([False, True]), mask.float())
    cut = ro.cut(3, 2)
    assert cut.prompt_ids.tolist() == [[0, 5, 6], [7, 8, 9]]
    assert cut.response_ids.tolist() == [[1, 2], [3, 0]]
    assert cut.logp_rollout is not None and cut.logp_rollout.shape == (2, 2)
    assert torch.equal(cut.truncated, ro.truncated)


# ------------------------------------------------------------------- the spec and the model
def test_the_spec_names_conflicting_settings() -> None:
    with pytest.raises(SpecError, match=r"set it or train\.micro_batch_size, not both"):
        small_spec(None, "train.micro_batch_tokens=64", "train.micro_batch_size=2")
    with pytest.raises(SpecError, match=r"train\.pack_sequences: .*set that budget too"):
        small_spec(None, "train.pack_sequences=true")


def test_packing_is_refused_where_attention_ignores_it(monkeypatch: Any) -> None:
    """An attention that does not keep packed sequences apart (here transformers' detection
    of restarting positions switched off) fails the probe at the start: one line."""
    from transformers import masking_utils

    spec = small_spec(None, "train.micro_batch_tokens=64", "train.pack_sequences=true")
    lrn = learner(spec)  # the probe passes on the tiny Llama
    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", lambda _positions: None)
    with pytest.raises(UserError, match="does not keep packed sequences apart") as info:
        lrn.setup.forwards.check_packing()
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("pack", [False, True], ids=["padded", "packed"])
def test_a_round_by_a_token_budget_updates_as_by_rows(pack: bool) -> None:
    """run_round's whole update (the no-grad passes, then two epochs of two minibatches)
    with micro-batches of 24 tokens: every metric of the round (losses, gradient norms
    before clipping, KL, clip fractions) is the one of micro-batches of 3 rows."""
    from ppokit.trainer.metrics import TIMING, read_once

    config = [*COMMON, *CONFIGS["token_mean, separate critic, multi-turn"], "train.ppo_epochs=2"]
    config += ["train.minibatch_size=6", "kl={estimator: k3, coef: 0.1, placement: loss}"]
    metrics = []
    budget = ["train.micro_batch_tokens=24", f"train.pack_sequences={pack}"]
    for micro in (["train.micro_batch_size=3"], budget):
        spec = small_spec(None, *config, *micro)
        lrn = learner(spec)
        ro = _rollout(lrn, multiturn=True)
        rows = [{"prompt": p} for p in PROMPTS]
        torch.manual_seed(7)  # the minibatches' order
        result = lrn.round(rows, PROMPTS, 1, rollout=ro, scores=torch.tensor(SCORES))
        metrics.append({k: v for k, v in read_once(result.metrics).items() if k not in TIMING})
    rows_, tokens = metrics
    assert set(rows_) == set(tokens)
    for key, value in rows_.items():
        if value is None:
            assert tokens[key] is None, key
        else:
            assert tokens[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
