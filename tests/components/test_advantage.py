"""Advantage estimators: loop references, identities, masking, groups, hand-computed cases."""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from ppokit.batch import FIELDS, RolloutBatch
from ppokit.registry import get_registry
from tests.helpers import reference
from tests.helpers.components import builtin_names, make_any, names
from tests.helpers.strategies import batches

#: Every registered advantage (installed plugins included): the generic contract tests.
NAMES = names("advantage")
#: The built-in ones.
BUILTINS = builtin_names("advantage")
FAST = settings(max_examples=60, deadline=None)
#: Per component of a generic test: every registered component runs.
EACH = settings(max_examples=25, deadline=None)


def make(name: str, **params):
    return make_any("advantage", name, **params)


def close(a: torch.Tensor, ref: torch.Tensor, tol: float = 1e-5) -> bool:
    """Elementwise, relative to the scale of the reference."""
    scale = 1.0 + ref.abs().max().item() if ref.numel() else 1.0
    return bool(((a.double() - ref).abs() <= tol * scale).all())


def group_sums(batch: RolloutBatch, per_row: torch.Tensor) -> torch.Tensor:
    return torch.zeros(batch.batch_size, dtype=torch.float64).index_add_(
        0, batch.group_index, per_row.double()
    )


def row_values(batch: RolloutBatch, adv: torch.Tensor) -> torch.Tensor:
    """The per-row constant of a broadcast advantage (0 for an empty row)."""
    return adv.sum(dim=1) / batch.lengths.clamp_min(1)


# ---------------------------------------------------------------- registry and params
def test_all_registered_with_sources():
    reg = get_registry()
    assert {"gae", "grpo", "rloo", "opo"} <= set(BUILTINS)
    for name in BUILTINS:
        info = reg.info("advantage", name)
        assert "arXiv:" in info.source
        assert info.formula


@pytest.mark.parametrize(
    ("name", "params"),
    [
        ("gae", {"lam": 1.5}),
        ("gae", {"gamma": -0.1}),
        ("length_adaptive_gae", {"alpha": 0}),
        ("grpo", {"eps": -1.0}),
        ("rloo", {"eps": 1.0}),
    ],
)
def test_invalid_params_rejected(name, params):
    with pytest.raises(LookupError):
        make(name, **params)


# ---------------------------------------------------------------- generic contract
@pytest.mark.parametrize("name", NAMES)
@EACH
@given(batches())
def test_contract_masked_zero_float32_detached(name, batch):
    adv = make(name)(batch)
    assert adv.dtype == torch.float32 and adv.shape == batch.response_mask.shape
    assert not adv.requires_grad
    assert bool((adv[~batch.response_mask] == 0).all())
    assert torch.isfinite(adv).all()


@pytest.mark.parametrize("name", NAMES)
@EACH
@given(batches(dtype=torch.float32))
def test_masked_garbage_and_padding_never_matter(name, batch):
    est = make(name)
    adv = est(batch)
    mask = batch.response_mask
    noise = torch.randn(mask.shape) * 100
    changed = batch.replace(
        token_rewards=torch.where(mask, batch.token_rewards, noise),
        values=torch.where(mask, batch.values, -noise),
    )
    assert torch.equal(est(changed), adv)
    extra = 3
    b = batch.batch_size

    def pad(x, fill):
        return torch.cat([x, torch.full((b, extra), fill, dtype=x.dtype)], dim=1)

    padded = batch.replace(
        response_mask=pad(mask, False),
        token_rewards=pad(batch.token_rewards, 7.0),
        values=pad(batch.values, -3.0),
        logp_old=pad(batch.logp_old, 0.0),
        logp_rollout=pad(batch.logp_rollout, 0.0),
        logp_ref=pad(batch.logp_ref, 0.0),
    )
    assert torch.allclose(est(padded)[:, : mask.shape[1]], adv, atol=1e-6)


@pytest.mark.parametrize("name", NAMES)
@EACH
@given(batches(dtype=torch.float32), st.randoms(use_true_random=False))
def test_row_order_does_not_matter(name, batch, rnd):
    perm = list(range(batch.batch_size))
    rnd.shuffle(perm)
    index = torch.tensor(perm)
    est = make(name)
    assert torch.allclose(est(batch.rows(index)), est(batch)[index], atol=1e-5)


@pytest.mark.parametrize("name", NAMES)
@EACH
@given(batches(dtype=torch.float32))
def test_bfloat16_inputs_close_to_float32(name, batch):
    est = make(name)
    fields = {
        f: getattr(batch, f)
        for f in (
            "token_rewards",
            "values",
            "bootstrap_values",
            "baseline_rewards",
            "logp_old",
            "logp_rollout",
            "logp_ref",
        )
    }
    low = batch.replace(**{k: v.bfloat16() for k, v in fields.items()})
    rounded = batch.replace(**{k: v.bfloat16().float() for k, v in fields.items()})
    out = est(low)
    assert out.dtype == torch.float32
    assert torch.allclose(out, est(rounded), rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- GAE family
@FAST
@given(batches(), st.floats(0, 1), st.floats(0, 1))
def test_gae_equals_loop(batch, gamma, lam):
    adv = make("gae", gamma=gamma, lam=lam, whiten=False)(batch)
    assert close(adv, reference.gae(batch, gamma, lam))


@FAST
@given(batches(), st.floats(0, 1), st.floats(0, 1))
def test_gae_recursion(batch, gamma, lam):
    """A_t = delta_t + gamma lam A_next with next = next unmasked position of the row."""
    adv = make("gae", gamma=gamma, lam=lam, whiten=False)(batch)
    mask = batch.response_mask
    r = torch.where(mask, batch.token_rewards.double(), 0.0)
    v = torch.where(mask, batch.values.double(), 0.0)
    v_next = reference.next_values(batch.values, mask, batch.terminal_values)
    a_next = reference.next_values(adv, mask, torch.zeros(batch.batch_size))
    delta = torch.where(mask, r + gamma * v_next - v, 0.0)
    assert close(adv, delta + gamma * lam * a_next)


@FAST
@given(batches(), st.floats(0, 1))
def test_gae_lam_zero_is_td_error(batch, gamma):
    adv = make("gae", gamma=gamma, lam=0.0, whiten=False)(batch)
    mask = batch.response_mask
    v_next = reference.next_values(batch.values, mask, batch.terminal_values)
    delta = torch.where(
        mask, batch.token_rewards.double() + gamma * v_next - batch.values.double(), 0.0
    )
    assert close(adv, delta)


@FAST
@given(batches(outcome_only=True, truncation=False))
def test_gae_telescopes_to_outcome_minus_value(batch):
    """Terminal-only reward, gamma = lam = 1, terminal value 0: A_t = R - V_t."""
    adv = make("gae", gamma=1.0, lam=1.0, whiten=False)(batch)
    expected = reference.broadcast(batch, batch.scores.tolist()) - torch.where(
        batch.response_mask, batch.values.double(), 0.0
    )
    assert close(adv, expected)


@FAST
@given(batches())
def test_gae_whitened_is_batch_whitened_loop(batch):
    adv = make("gae")(batch)
    ref = reference.whiten(reference.gae(batch, 1.0, 0.95), batch.response_mask)
    assert close(adv, ref, 1e-4)


@FAST
@given(batches(), st.floats(0, 1))
def test_mc_equals_loop(batch, gamma):
    adv = make("mc", gamma=gamma)(batch)
    ref = reference.returns(batch, gamma, bootstrap=True) - torch.where(
        batch.response_mask, batch.values.double(), 0.0
    )
    assert close(adv, ref)


@FAST
@given(batches(), st.floats(0.001, 10))
def test_length_adaptive_gae_per_row_lam(batch, alpha):
    adv = make("length_adaptive_gae", alpha=alpha, whiten=False)(batch)
    lam = (1 - 1 / (alpha * batch.lengths.double())).clamp(0, 1)
    assert close(adv, reference.gae(batch, 1.0, lam))


@FAST
@given(batches(gaps=False, dtype=torch.float32), st.integers(1, 12), st.floats(0.01, 1))
def test_length_adaptive_gae_equals_gae_at_its_lam(batch, length, alpha):
    t = batch.seq_len
    mask = torch.arange(t)[None, :] < min(length, t)
    batch = batch.replace(response_mask=mask.expand(batch.batch_size, t).contiguous())
    n = float(mask.sum())
    lam = min(max(1 - 1 / (alpha * n), 0.0), 1.0)
    adaptive = make("length_adaptive_gae", alpha=alpha)(batch)
    assert torch.allclose(adaptive, make("gae", lam=lam)(batch), atol=1e-5)


@FAST
@given(batches(), st.floats(0, 1))
def test_reinforce_pp_whitened_reward_to_go(batch, gamma):
    adv = make("reinforce_pp", gamma=gamma)(batch)
    ref = reference.whiten(reference.returns(batch, gamma, bootstrap=False), batch.response_mask)
    assert close(adv, ref, 1e-4)


@FAST
@given(batches())
def test_remax_reward_to_go_minus_baseline(batch):
    adv = make("remax")(batch)
    ref = reference.returns(batch, 1.0, bootstrap=False) - reference.broadcast(
        batch, batch.baseline_rewards.float().tolist()
    )
    assert close(adv, ref)


# ---------------------------------------------------------------- group estimators
def _group_reference(batch: RolloutBatch, name: str) -> torch.Tensor:
    """Group statistics over the non-empty rows of each group (empty rows give 0)."""
    scores = batch.scores.double().tolist()
    lengths = batch.lengths.double().tolist()
    per_row = [0.0] * batch.batch_size
    for group in reference.group_rows(batch):
        rows = [i for i in group if lengths[i] > 0]
        n = len(rows)
        s = [scores[i] for i in rows]
        mean = sum(s) / n if n > 1 else 0.0
        std = (sum((x - mean) ** 2 for x in s) / (n - 1)) ** 0.5 if n > 1 else 1.0
        total_len = sum(lengths[i] for i in rows)
        weighted = sum(lengths[i] * scores[i] for i in rows) / total_len if total_len else 0.0
        for i in rows:
            per_row[i] = {
                "grpo": (scores[i] - mean) / (std + 1e-6),
                "dr_grpo": scores[i] - mean,
                "rloo": scores[i] - (sum(s) - scores[i]) / (n - 1) if n > 1 else scores[i],
                "reinforce_pp_baseline": scores[i] - mean,
                "opo": scores[i] - (weighted if n > 1 else 0.0),
            }[name]
    out = reference.broadcast(batch, per_row)
    if name == "reinforce_pp_baseline":
        out = reference.whiten(out, batch.response_mask)
    return out


GROUPED = ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline", "opo")


@FAST
@given(batches(), st.sampled_from(GROUPED))
def test_group_estimators_equal_reference(batch, name):
    assert close(make(name)(batch), _group_reference(batch, name), 1e-4)


def _nonempty_count(batch: RolloutBatch) -> torch.Tensor:
    """Number of non-empty rows in each row's group, float64 [B]."""
    return group_sums(batch, (batch.lengths > 0).double())[batch.group_index]


@FAST
@given(batches(min_group=2), st.sampled_from(("grpo", "dr_grpo", "rloo")))
def test_group_advantages_sum_to_zero(batch, name):
    """Over the non-empty rows of every group with at least two of them."""
    per_row = row_values(batch, make(name)(batch))
    several = (_nonempty_count(batch) > 1).double()
    sums = group_sums(batch, per_row * several)
    assert torch.allclose(sums, torch.zeros(batch.batch_size, dtype=torch.float64), atol=1e-4)


@pytest.mark.parametrize("name", NAMES)
@EACH
@given(batches(), st.integers(0, 11), st.integers(1, 4))
def test_empty_rows_do_not_count_in_their_group(name, batch, which, extra):
    """Appending all-masked rows to a group leaves every other row's advantage unchanged:
    an empty row is no response, for every estimator (group statistics, whitening)."""
    est = make(name)
    adv = est(batch)
    b, t = batch.response_mask.shape
    row = torch.full((extra,), which % b)
    added = batch.rows(row)
    added = added.replace(
        response_mask=torch.zeros(extra, t, dtype=torch.bool),
        token_rewards=torch.randn(extra, t).to(batch.token_rewards.dtype) * 10,
    )
    fields = {
        f: torch.cat([getattr(batch, f), getattr(added, f)])
        for f in FIELDS
        if getattr(batch, f) is not None
    }
    grown = est(RolloutBatch(**fields))
    assert torch.allclose(grown[:b], adv, atol=1e-5, rtol=1e-5)
    assert bool((grown[b:] == 0).all())


@FAST
@given(batches(min_group=2))
def test_opo_length_weighted_sum_is_zero(batch):
    per_row = row_values(batch, make("opo")(batch))
    several = (_nonempty_count(batch) > 1).double()  # one non-empty row: baseline 0
    weighted = group_sums(batch, per_row * batch.lengths * several)
    assert torch.allclose(weighted, torch.zeros_like(weighted), atol=1e-3)


@FAST
@given(batches())
def test_rloo_is_scaled_dr_grpo(batch):
    n = _nonempty_count(batch).float()[:, None]
    scale = torch.where(n > 1, n / (n - 1).clamp_min(1), 1.0)
    assert torch.allclose(make("rloo")(batch), scale * make("dr_grpo")(batch), atol=1e-5)


@FAST
@given(batches(outcome_only=True, min_group=2), st.sampled_from(GROUPED), st.floats(-3, 3))
def test_equal_rewards_give_zero(batch, name, reward):
    mask = batch.response_mask
    rewards = torch.zeros(mask.shape, dtype=batch.token_rewards.dtype)
    rewards[batch.last_mask] = reward
    rewards = torch.where(mask.any(dim=1, keepdim=True), rewards, 0.0)
    # rows must all carry the reward: drop empty rows' groups by giving every row a token
    mask = mask.clone()
    mask[:, 0] = True
    last = batch.replace(response_mask=mask).last_mask
    rewards = torch.where(last, torch.tensor(reward, dtype=rewards.dtype), 0.0)
    adv = make(name)(batch.replace(response_mask=mask, token_rewards=rewards))
    assert torch.allclose(adv, torch.zeros_like(adv), atol=1e-4)


# ---------------------------------------------------------------- bootstrap
@FAST
@given(batches(truncation=True), st.floats(0, 1), st.floats(0, 1))
def test_bootstrap_changes_gae_by_discounted_terminal(batch, gamma, lam):
    """Adding V_T on a truncated row adds (gamma lam)^k gamma V_T, k = positions to the end."""
    est = make("gae", gamma=gamma, lam=lam, whiten=False)
    mask = batch.response_mask
    without = est(batch.replace(truncated=torch.zeros_like(batch.truncated)))
    with_boot = est(batch)
    remaining = mask.flip(1).cumsum(1).flip(1) - 1  # True positions after t, gaps excluded
    term = batch.terminal_values.double()[:, None]
    expected = (gamma * lam) ** remaining.double() * gamma * term
    expected = torch.where(mask, expected, 0.0)
    assert close(with_boot - without, expected)


# ---------------------------------------------------------------- hand-computed
def _hand_batch() -> RolloutBatch:
    """Two rows, T = 4. Row 0: tokens at 0, 1, 3 (gap at 2), row 1: tokens at 0, 1."""
    return RolloutBatch(
        response_mask=torch.tensor([[1, 1, 0, 1], [1, 1, 0, 0]], dtype=torch.bool),
        token_rewards=torch.tensor([[0.0, 0.5, 9.0, 1.0], [0.0, 2.0, 9.0, 9.0]]),
        values=torch.tensor([[0.5, 0.25, 9.0, 0.5], [1.0, 0.5, 9.0, 9.0]]),
        group_ids=torch.tensor([4, 4]),
        truncated=torch.tensor([False, True]),
        bootstrap_values=torch.tensor([5.0, 2.0]),
        baseline_rewards=torch.tensor([1.0, 0.5]),
    )


def test_gae_hand_computed():
    # gamma = 1, lam = 0.5. Row 0 (terminal 0): deltas at 3, 1, 0:
    #   d3 = 1 - 0.5 = 0.5; d1 = 0.5 + 0.5 - 0.25 = 0.75; d0 = 0 + 0.25 - 0.5 = -0.25
    #   A3 = 0.5, A1 = 0.75 + 0.25 = 1.0, A0 = -0.25 + 0.5 = 0.25
    # Row 1 (truncated, terminal 2): d1 = 2 + 2 - 0.5 = 3.5, d0 = 0 + 0.5 - 1 = -0.5
    #   A1 = 3.5, A0 = -0.5 + 1.75 = 1.25
    adv = make("gae", gamma=1.0, lam=0.5, whiten=False)(_hand_batch())
    assert torch.allclose(adv, torch.tensor([[0.25, 1.0, 0.0, 0.5], [1.25, 3.5, 0.0, 0.0]]))


def test_gae_whitened_hand_computed():
    # values 0.25, 1.0, 0.5, 1.25, 3.5: mean 1.3, unbiased var = 6.675 / 4 = 1.66875
    adv = make("gae", gamma=1.0, lam=0.5)(_hand_batch())
    raw = torch.tensor([[0.25, 1.0, 0.0, 0.5], [1.25, 3.5, 0.0, 0.0]])
    mask = _hand_batch().maskf
    expected = (raw - 1.3) / (1.66875 + 1e-8) ** 0.5 * mask
    assert torch.allclose(adv, expected, atol=1e-6)


def test_mc_hand_computed():
    # gamma = 0.5. Row 0: G3 = 1, G1 = 0.5 + 0.5 = 1, G0 = 0 + 0.5 = 0.5; minus V
    # Row 1: G1 = 2 + 0.5 * 2 = 3, G0 = 1.5; minus V
    adv = make("mc", gamma=0.5)(_hand_batch())
    assert torch.allclose(adv, torch.tensor([[0.0, 0.75, 0.0, 0.5], [0.5, 2.5, 0.0, 0.0]]))


def test_length_adaptive_gae_hand_computed():
    # alpha = 1: lam0 = 1 - 1/3 = 2/3 (length 3), lam1 = 1 - 1/2 = 1/2 (length 2)
    # Row 0: A3 = 0.5, A1 = 0.75 + 0.5 * 2/3 = 13/12, A0 = -0.25 + 13/12 * 2/3 = 17/36
    # Row 1: as GAE with lam 0.5: 1.25, 3.5
    adv = make("length_adaptive_gae", alpha=1.0, whiten=False)(_hand_batch())
    expected = torch.tensor([[17 / 36, 13 / 12, 0.0, 0.5], [1.25, 3.5, 0.0, 0.0]])
    assert torch.allclose(adv, expected)


def _scores_batch() -> RolloutBatch:
    """Scores 1, 0, 2 (group a, lengths 1, 2, 1) and 5 (group b alone, length 1)."""
    mask = torch.tensor([[1, 0], [1, 1], [1, 0], [1, 0]], dtype=torch.bool)
    rewards = torch.tensor([[1.0, 0.0], [0.0, 0.0], [2.0, 0.0], [5.0, 0.0]])
    return RolloutBatch(
        response_mask=mask, token_rewards=rewards, group_ids=torch.tensor([0, 0, 0, 1])
    )


@pytest.mark.parametrize(
    ("name", "per_row"),
    [
        # mean 1, std 1 in group a; alone: R / (1 + eps)
        ("grpo", [0.0, -1 / (1 + 1e-6), 1 / (1 + 1e-6), 5 / (1 + 1e-6)]),
        ("dr_grpo", [0.0, -1.0, 1.0, 5.0]),
        # leave-one-out means 1, 1.5, 0.5
        ("rloo", [0.0, -1.5, 1.5, 5.0]),
        # length-weighted mean (1 + 0 + 2) / 4 = 0.75
        ("opo", [0.25, -0.75, 1.25, 5.0]),
    ],
)
def test_group_hand_computed(name, per_row):
    batch = _scores_batch()
    expected = torch.tensor(per_row)[:, None] * batch.maskf
    assert torch.allclose(make(name)(batch), expected)


@pytest.mark.parametrize(
    ("name", "per_row"),
    [
        ("grpo", [0.0, -1 / (1 + 1e-6), 1 / (1 + 1e-6), 5 / (1 + 1e-6), 0.0, 3 / (1 + 1e-6), 0.0]),
        ("dr_grpo", [0.0, -1.0, 1.0, 5.0, 0.0, 3.0, 0.0]),
        ("rloo", [0.0, -1.5, 1.5, 5.0, 0.0, 3.0, 0.0]),
        ("opo", [0.25, -0.75, 1.25, 5.0, 0.0, 3.0, 0.0]),
    ],
)
def test_group_hand_computed_with_empty_rows(name, per_row):
    """_scores_batch plus an empty row in group a (reward 9 at a masked position, it does not
    count: n = 3 there), and group c of one scored row (3) and one empty row (alone)."""
    base = _scores_batch()
    batch = RolloutBatch(
        response_mask=torch.cat(
            [base.response_mask, torch.tensor([[0, 0], [1, 0], [0, 0]], dtype=torch.bool)]
        ),
        token_rewards=torch.cat(
            [base.token_rewards, torch.tensor([[9.0, 0.0], [3.0, 0.0], [0.0, 0.0]])]
        ),
        group_ids=torch.tensor([0, 0, 0, 1, 0, 2, 2]),
    )
    expected = torch.tensor(per_row)[:, None] * batch.maskf
    assert torch.allclose(make(name)(batch), expected)


def test_reinforce_pp_baseline_hand_computed():
    # per-token values 0, -1, -1, 1, 5: mean 0.8, unbiased var = (0.64+3.24*2+0.04+17.64)/4 = 6.2
    batch = _scores_batch()
    raw = torch.tensor([[0.0, 0.0], [-1.0, -1.0], [1.0, 0.0], [5.0, 0.0]])
    expected = (raw - 0.8) / (6.2 + 1e-8) ** 0.5 * batch.maskf
    assert torch.allclose(make("reinforce_pp_baseline")(batch), expected, atol=1e-6)


def test_reinforce_pp_hand_computed():
    # gamma = 0.5, rewards-to-go: row 0: [1, 1, -, 1] -> G0 = 0 + 0.5*1 = 0.5 ... computed:
    # row 0: G3 = 1, G1 = 0.5 + 0.5 = 1, G0 = 0.5; row 1: G1 = 2, G0 = 1 (no bootstrap)
    # values 0.5, 1, 1, 1, 2: mean 1.1, unbiased var = (0.36+0.01*3+0.81)/4 = 0.3
    adv = make("reinforce_pp", gamma=0.5)(_hand_batch())
    raw = torch.tensor([[0.5, 1.0, 0.0, 1.0], [1.0, 2.0, 0.0, 0.0]])
    expected = (raw - 1.1) / (0.3 + 1e-8) ** 0.5 * _hand_batch().maskf
    assert torch.allclose(adv, expected, atol=1e-6)


def test_remax_hand_computed():
    # reward-to-go row 0: [1.5, 1.5, -, 1] - 1; row 1: [2, 2] - 0.5
    adv = make("remax")(_hand_batch())
    assert torch.allclose(adv, torch.tensor([[0.5, 0.5, 0.0, 0.0], [1.5, 1.5, 0.0, 0.0]]))


# ---------------------------------------------------------------- gdpo (several rewards)
def _with_parts(batch: RolloutBatch, parts: torch.Tensor, weights: list[float]) -> RolloutBatch:
    w = torch.tensor(weights).expand(batch.batch_size, len(weights)).contiguous()
    return batch.replace(reward_parts=parts.float(), reward_weights=w)


def test_gdpo_hand_computed() -> None:
    """Two groups of two, rewards (correct, format) weighted (1, 0.5): GRPO on R = c + f/2
    gives the group (1,0),(0,1) the advantages ±1/√2·√2 = ±0.707 of R's spread while GDPO
    gives each reward its own ±1/√2 (std of two values 0 and 1 is 1/√2), summed with the
    weights, then whitened over the four responses."""
    mask = torch.ones(4, 2, dtype=torch.bool)
    base = RolloutBatch(
        response_mask=mask, token_rewards=torch.zeros(4, 2), group_ids=torch.tensor([0, 0, 1, 1])
    )
    parts = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [1.0, 0.0]])
    batch = _with_parts(base, parts, [1.0, 0.5])
    s = 2**0.5  # 1 / (std of {0, 1}) = 1 / (1/√2)
    # group 0: c (+1/2·√2, -1/2·√2)·... written out: A_c = ±(1/2)·s, A_f = ∓(1/2)·s
    summed = torch.tensor(
        [0.5 * s - 0.5 * 0.5 * s, -0.5 * s + 0.5 * 0.5 * s, 0.5 * 0.5 * s, -0.5 * 0.5 * s]
    )
    mean = summed.mean()
    std = ((summed - mean) ** 2).sum().div(3).add(1e-8).sqrt()
    expected = ((summed - mean) / std)[:, None].expand(4, 2)
    got = make("gdpo", eps=1e-12)(batch)
    assert torch.allclose(got, expected, atol=1e-5)
    # group 1's correctness is equal (1, 1): it adds exactly nothing there
    assert torch.allclose(make("gdpo").parts(batch)[2:, 0], torch.zeros(2))


@FAST
@given(batches(min_group=2))
def test_gdpo_each_reward_has_zero_mean_in_every_group(batch):
    """Each reward's group-normalised advantage sums to 0 over the non-empty rows of every
    group of two or more; so does the batch-normalised sum when every group has two."""
    several = (_nonempty_count(batch) > 1).double()
    per_reward = make("gdpo").parts(batch)
    for k in range(per_reward.shape[1]):
        sums = group_sums(batch, per_reward[:, k] * several)
        assert torch.allclose(sums, torch.zeros_like(sums), atol=1e-4)
    if bool((several > 0).all()):
        sums = group_sums(batch, row_values(batch, make("gdpo")(batch)))
        assert torch.allclose(sums, torch.zeros_like(sums), atol=1e-3)


@FAST
@given(batches(min_group=2), st.data())
def test_gdpo_is_invariant_to_each_rewards_affine_rescaling(batch, data):
    """r_k → a_k r_k + b_k (a_k > 0, each reward its own) changes no advantage: GDPO's
    point, where GRPO on the weighted sum changes with every a_k. (A group of one response
    has baseline 0 by the group estimators' convention: the identity holds where every
    response has a group.)"""
    assume(bool((_nonempty_count(batch)[batch.nonempty] > 1).all()))
    parts = batch.reward_parts.float()
    k = parts.shape[1]
    scales, shifts = st.sampled_from([0.25, 0.5, 2.0, 8.0]), st.sampled_from([-3.0, 0.0, 10.0])
    scale = torch.tensor(data.draw(st.lists(scales, min_size=k, max_size=k)))
    shift = torch.tensor(data.draw(st.lists(shifts, min_size=k, max_size=k)))
    # spreads well above ε, so that ε's share is the same at every scale
    spread = parts.round()
    before = batch.replace(reward_parts=spread)
    after = batch.replace(reward_parts=spread * scale + shift)
    est = make("gdpo", eps=1e-9)
    assert close(est(after), est(before).double(), 1e-4)


@FAST
@given(batches(min_group=2))
def test_gdpo_with_one_reward_is_grpo_whitened(batch):
    """With a single reward of weight w > 0, GDPO is GRPO of that reward, whitened over the
    batch's non-empty responses (the scale of w cancels)."""
    r = batch.reward_parts.float()[:, :1]
    one = _with_parts(batch, r, [3.0])
    with_r = one.replace(token_rewards=torch.where(one.last_mask, r, 0.0))
    grpo = row_values(with_r, make("grpo")(with_r))
    live = with_r.nonempty
    mean = grpo[live].mean() if live.any() else 0.0
    n = int(live.sum())
    var = ((grpo - mean) ** 2 * live).sum() / max(n - 1, 1)
    expected = torch.where(live, (grpo - mean) / (var + 1e-8).sqrt(), 0.0)
    assert close(row_values(one, make("gdpo")(one)), expected.double(), 1e-4)


@FAST
@given(batches())
def test_grpo_batch_std_is_dr_grpo_over_one_std(batch):
    """``std: batch`` divides Dr. GRPO's centred reward by one number for the whole batch:
    the unbiased std of the non-empty rows' scores."""
    live = batch.nonempty
    scores = batch.scores[live].double()
    std = scores.std() if scores.numel() > 1 else torch.zeros((), dtype=torch.float64)
    expected = make("dr_grpo")(batch).double() / (std + 1e-6)
    assert close(make("grpo", std="batch")(batch), expected, tol=1e-4)


def test_grpo_batch_std_by_hand():
    """Two groups of two, scores (1, 0) and (1, 1): the batch mean 0.75, unbiased std
    sqrt(0.75 / 3) = 0.5; group-centred (0.5, -0.5) and (0, 0) over 0.5 + ε."""
    mask = torch.ones(4, 2, dtype=torch.bool)
    rewards = torch.zeros(4, 2)
    rewards[:, 1] = torch.tensor([1.0, 0.0, 1.0, 1.0])
    batch = RolloutBatch(
        response_mask=mask, token_rewards=rewards, group_ids=torch.tensor([0, 0, 1, 1])
    )
    adv = make("grpo", std="batch", eps=1e-6)(batch)
    expected = torch.tensor([1.0, -1.0, 0.0, 0.0])[:, None].expand(4, 2) * 0.5 / (0.5 + 1e-6)
    assert torch.allclose(adv, expected, atol=1e-5)
