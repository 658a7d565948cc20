"""Policy losses: clipping, gradients, masking and hand-computed cases."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ppokit.components.aggregation.impl import SeqMeanTokenMean
from ppokit.components.policy_loss.impl import CISPO, GSPO, PPOClip, Reinforce
from ppokit.registry import RegistryError, build_registry, get_registry
from tests.helpers.components import builtin_names, make, make_any, names
from tests.helpers.strategies import token_tensors

SETTINGS = settings(max_examples=60, deadline=None)
#: Per component of a generic test: every registered component runs.
EACH = settings(max_examples=30, deadline=None)

clips = st.floats(0.01, 0.5)


def _inputs(
    case: tuple[torch.Tensor, ...], spread: float = 0.4
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logp, logp_old, adv, mask) with log-ratios of order ``spread``."""
    x, y, adv, mask = case
    logp = -x.abs()
    logp_old = logp - spread * y
    return logp, logp_old, adv, mask


def _grad(loss_fn, logp, logp_old, adv, mask) -> tuple[torch.Tensor, torch.Tensor]:
    lp = logp.clone().requires_grad_(True)
    out = loss_fn(lp, logp_old, adv, mask)
    (g,) = torch.autograd.grad(out.sum(), lp)
    return out.detach(), g


def _garbage_like(x: torch.Tensor) -> torch.Tensor:
    """NaN, inf, -inf and huge values, cycling over the positions."""
    pool = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e6, -1e6])
    return pool[torch.arange(x.numel()) % len(pool)].reshape(x.shape)


#: Every registered policy loss (installed plugins included) with its default parameters,
#: plus non-default variants: the generic contract tests run over all of them.
LOSSES: dict[str, tuple[str, dict]] = {name: (name, {}) for name in names("policy_loss")} | {
    "ppo_clip(0.1,0.3,dual=3)": ("ppo_clip", {"clip_low": 0.1, "clip_high": 0.3, "dual_clip": 3.0}),
    "gspo(0.05,0.1)": ("gspo", {"clip_low": 0.05, "clip_high": 0.1}),
}
#: The built-in ones and the variants.
BUILTIN_LOSSES = [k for k, (name, _) in LOSSES.items() if name in builtin_names("policy_loss")]


def loss_of(key: str):
    """The loss of a LOSSES key, built by the registry."""
    name, params = LOSSES[key]
    return make_any("policy_loss", name, **params)


# ---------------------------------------------------------------------------- ppo_clip
def test_ppo_clip_hand_computed():
    loss = PPOClip(clip_low=0.2, clip_high=0.2, dual_clip=1.4)
    ratio = torch.tensor([[1.5, 1.5, 1.1, 0.5, 3.0]])
    logp_old = torch.full_like(ratio, -1.0)
    logp = logp_old + ratio.log()
    adv = torch.tensor([[1.0, -1.0, 2.0, -1.0, -0.5]])
    mask = torch.ones_like(ratio, dtype=torch.bool)
    out, grad = _grad(loss, logp, logp_old, adv, mask)
    # A>0, rho=1.5: max(-1.5, -1.2) = -1.2 (clipped, grad 0)
    # A<0, rho=1.5: max(1.5, 1.2) = 1.5; dual clip min(1.5, 1.4) = 1.4 (grad 0)
    # A=2, rho=1.1: -2.2 inside the band (grad -A rho = -2.2)
    # A<0, rho=0.5: max(0.5, 0.8) = 0.8 (clipped below, grad 0)
    # A=-0.5, rho=3: max(1.5, 0.6) = 1.5, dual min(1.5, 0.7) = 0.7 (grad 0)
    torch.testing.assert_close(out, torch.tensor([[-1.2, 1.4, -2.2, 0.8, 0.7]]))
    torch.testing.assert_close(grad, torch.tensor([[0.0, 0.0, -2.2, 0.0, 0.0]]))
    assert loss.clipped(logp, logp_old, adv).tolist() == [[True, True, False, True, True]]


def test_ppo_clip_without_dual_clip_is_unbounded_for_negative_advantages():
    loss = make("policy_loss", "ppo_clip")
    logp_old = torch.zeros(1, 1)
    logp = torch.full((1, 1), math.log(5.0))
    adv = torch.full((1, 1), -1.0)
    mask = torch.ones(1, 1, dtype=torch.bool)
    out, grad = _grad(loss, logp, logp_old, adv, mask)
    torch.testing.assert_close(out, torch.tensor([[5.0]]))
    torch.testing.assert_close(grad, torch.tensor([[5.0]]))
    assert not loss.clipped(logp, logp_old, adv).any()


@SETTINGS
@given(token_tensors(n=3), clips, clips, st.one_of(st.none(), st.floats(1.1, 3.0)))
def test_ppo_clip_gradient_is_zero_exactly_where_clipped(case, low, high, dual):
    """Inside the band the gradient is the unclipped one, -A rho; where the clip is active in
    the advantage's direction (or the dual clip caps the loss) it is 0, and ``clipped`` says so."""
    logp, logp_old, adv, mask = _inputs(case)
    loss = PPOClip(clip_low=low, clip_high=high, dual_clip=dual)
    out, grad = _grad(loss, logp, logp_old, adv, mask)
    rho = (logp - logp_old).exp()
    clipped = loss.clipped(logp, logp_old, adv, mask)
    expected = torch.where(mask & ~clipped, -adv * rho, torch.zeros_like(rho))
    torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-6)
    # clipped means: past the bound in the direction the advantage pushes
    up = (adv > 0) & (rho > 1 + high)
    down = (adv < 0) & (rho < 1 - low)
    dual_cap = (adv < 0) & (rho > dual) if dual is not None else torch.zeros_like(up)
    assert torch.equal(clipped, (up | down | dual_cap) & mask)
    # the loss is never below the unclipped surrogate's pessimistic bound
    unclipped = torch.where(mask, -adv * rho, torch.zeros_like(rho))
    if dual is None:
        assert (out >= unclipped - 1e-5).all()


@SETTINGS
@given(token_tensors(n=3), st.floats(1.1, 5.0))
def test_dual_clip_caps_the_loss_at_minus_c_a(case, c):
    logp, logp_old, adv, mask = _inputs(case, spread=1.5)
    with_dual = make("policy_loss", "ppo_clip", dual_clip=c)(logp, logp_old, adv, mask)
    plain = make("policy_loss", "ppo_clip")(logp, logp_old, adv, mask)
    neg = mask & (adv < 0)
    assert (with_dual[neg] <= (-c * adv)[neg] + 1e-6).all()
    torch.testing.assert_close(with_dual, torch.where(neg, torch.minimum(plain, -c * adv), plain))
    # positive advantages are untouched
    assert torch.equal(with_dual[adv >= 0], plain[adv >= 0])


@pytest.mark.parametrize("key", BUILTIN_LOSSES)
@EACH
@given(token_tensors(n=3))
def test_on_policy_gradient_is_the_reinforce_gradient(key, case):
    """At rho = 1 every built-in surrogate has the policy gradient -A grad logp."""
    logp, _, adv, mask = _inputs(case)
    _, grad = _grad(loss_of(key), logp, logp.clone(), adv, mask)
    expected = torch.where(mask, -adv, torch.zeros_like(adv))
    torch.testing.assert_close(grad, expected)


# ---------------------------------------------------------------------------- gspo
def test_gspo_hand_computed():
    """Row 0: log-ratios (0.1, 0.3) -> s = exp(0.2); row 1: one token, ratio exp(-0.5)."""
    loss = GSPO(clip_low=0.1, clip_high=0.1)
    logp_old = torch.tensor([[-1.0, -2.0, -9.0], [-1.0, 0.0, 0.0]])
    logp = logp_old + torch.tensor([[0.1, 0.3, 7.0], [-0.5, 0.0, 0.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    adv = torch.tensor([[1.0, -1.0, 5.0], [-2.0, 0.0, 0.0]])
    out, grad = _grad(loss, logp, logp_old, adv, mask)
    s0 = math.exp(0.2)  # 1.2214 > 1.1
    s1 = math.exp(-0.5)  # 0.6065 < 0.9
    expected = torch.tensor([[max(-s0, -1.1), max(s0, 1.1), 0.0], [max(2 * s1, 2 * 0.9), 0.0, 0.0]])
    torch.testing.assert_close(out, expected)
    # token 0: A>0 and s above the band: clipped; token 1: A<0, unclipped: grad -A s = s0
    # row 1: A<0 and s below the band: clipped
    torch.testing.assert_close(grad, torch.tensor([[0.0, s0, 0.0], [0.0, 0.0, 0.0]]))
    assert loss.clipped(logp, logp_old, adv, mask).tolist() == [
        [True, False, False],
        [True, False, False],
    ]


def _sequence_ratio_reference(logp, logp_old, mask) -> list[float]:
    out = []
    for lp, lo, m in zip(logp.tolist(), logp_old.tolist(), mask.tolist(), strict=True):
        diffs = [a - b for a, b, keep in zip(lp, lo, m, strict=True) if keep]
        out.append(math.exp(sum(diffs) / len(diffs)) if diffs else 1.0)
    return out


@SETTINGS
@given(token_tensors(n=3), clips, clips)
def test_gspo_value_is_the_sequence_ratio_surrogate(case, low, high):
    logp, logp_old, adv, mask = _inputs(case, spread=0.2)
    loss = GSPO(clip_low=low, clip_high=high)
    out = loss(logp, logp_old, adv, mask)
    s = torch.tensor(_sequence_ratio_reference(logp, logp_old, mask))
    torch.testing.assert_close(GSPO.sequence_ratio(logp, logp_old, mask), s)
    s_t = s[:, None].expand_as(adv)
    expected = torch.maximum(-adv * s_t, -adv * s_t.clamp(1 - low, 1 + high))
    torch.testing.assert_close(out, torch.where(mask, expected, torch.zeros_like(expected)))


@SETTINGS
@given(token_tensors(n=3), clips, clips)
def test_gspo_gradient_flows_per_token(case, low, high):
    """d l_{i,t} / d logp_t = -A_{i,t} s_i where unclipped (not divided by the length, no
    cross-token terms), 0 where clipped."""
    logp, logp_old, adv, mask = _inputs(case, spread=0.2)
    loss = GSPO(clip_low=low, clip_high=high)
    lp = logp.clone().requires_grad_(True)
    out = loss(lp, logp_old, adv, mask)
    # per-token: the gradient of one token's loss touches only that token
    jac = torch.autograd.functional.jacobian(lambda x: loss(x, logp_old, adv, mask), logp)
    b, t = logp.shape
    off_diag = jac.reshape(b * t, b * t) * (1 - torch.eye(b * t))
    assert (off_diag == 0).all()
    (grad,) = torch.autograd.grad(out.sum(), lp)
    s = GSPO.sequence_ratio(logp, logp_old, mask)[:, None]
    clipped = loss.clipped(logp, logp_old, adv, mask)
    expected = torch.where(mask & ~clipped, -adv * s, torch.zeros_like(adv))
    torch.testing.assert_close(grad, expected)


@SETTINGS
@given(token_tensors(n=3))
def test_gspo_token_form_gives_the_sequence_objective_gradient(case):
    """With one advantage per row, the sequence-mean of the token losses has the gradient of
    the sequence-level surrogate max(-A s_i(theta), -A clip(s_i(theta)))."""
    logp, logp_old, adv, mask = _inputs(case, spread=0.2)
    adv = adv[:, :1].expand_as(logp)
    loss = GSPO(clip_low=0.05, clip_high=0.08)
    agg = SeqMeanTokenMean(rows="nonempty")
    lp = logp.clone().requires_grad_(True)
    (g_token,) = torch.autograd.grad(agg.numerator(loss(lp, logp_old, adv, mask), mask), lp)
    lp2 = logp.clone().requires_grad_(True)
    diff = torch.where(mask, lp2 - logp_old, torch.zeros_like(lp2))
    s = (diff.sum(1) / mask.sum(1).clamp_min(1)).exp()
    a = adv[:, 0]
    seq = torch.maximum(-a * s, -a * s.clamp(0.95, 1.08))
    seq = torch.where(mask.any(1), seq, torch.zeros_like(seq))
    (g_seq,) = torch.autograd.grad(seq.sum(), lp2)
    torch.testing.assert_close(g_token, g_seq, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------- cispo
def test_cispo_hand_computed():
    loss = CISPO(clip_high=0.2)
    logp_old = torch.tensor([[-1.0, -2.0]])
    logp = logp_old + torch.tensor([[math.log(2.0), math.log(0.5)]])
    adv = torch.tensor([[1.0, -3.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    out, grad = _grad(loss, logp, logp_old, adv, mask)
    # weight min(2, 1.2) = 1.2 and min(0.5, 1.2) = 0.5
    lp = logp[0].tolist()
    torch.testing.assert_close(out, torch.tensor([[-1.2 * lp[0], 1.5 * lp[1]]]))
    torch.testing.assert_close(grad, torch.tensor([[-1.2, 1.5]]))
    assert loss.clipped(logp, logp_old, adv).tolist() == [[True, False]]


@SETTINGS
@given(token_tensors(n=3), st.floats(0.01, 2.0))
def test_cispo_gradient_is_the_truncated_is_weight(case, eps):
    """d l / d logp = -min(rho, 1 + eps) A at every unmasked token: clipping truncates the
    weight but never removes a token's gradient."""
    logp, logp_old, adv, mask = _inputs(case, spread=1.0)
    loss = CISPO(clip_high=eps)
    out, grad = _grad(loss, logp, logp_old, adv, mask)
    rho = (logp - logp_old).exp()
    weight = rho.clamp_max(1 + eps)
    zero = torch.zeros_like(rho)
    torch.testing.assert_close(grad, torch.where(mask, -weight * adv, zero))
    torch.testing.assert_close(out, torch.where(mask, -weight * adv * logp, zero))
    assert torch.equal(loss.clipped(logp, logp_old, adv, mask), (rho > 1 + eps) & mask)


# ---------------------------------------------------------------------------- reinforce
def test_reinforce_hand_computed():
    logp = torch.tensor([[-0.5, -2.0, -1.0]])
    adv = torch.tensor([[2.0, -1.0, 3.0]])
    mask = torch.tensor([[True, True, False]])
    out, grad = _grad(Reinforce(), logp, None, adv, mask)
    torch.testing.assert_close(out, torch.tensor([[1.0, -2.0, 0.0]]))
    torch.testing.assert_close(grad, torch.tensor([[-2.0, 1.0, 0.0]]))
    assert not hasattr(Reinforce(), "clipped")


# ---------------------------------------------------------------------------- all losses
@pytest.mark.parametrize("key", LOSSES)
@EACH
@given(token_tensors(n=3))
def test_masked_positions_give_zero_and_never_matter(key, case):
    loss = loss_of(key)
    logp, logp_old, adv, mask = _inputs(case)
    out, grad = _grad(loss, logp, logp_old, adv, mask)
    assert out.dtype == torch.float32
    assert (out[~mask] == 0).all()
    assert (grad[~mask] == 0).all()
    dirty = [torch.where(mask, x, _garbage_like(x)) for x in (logp, logp_old, adv)]
    out2, grad2 = _grad(loss, *dirty, mask)
    assert torch.equal(out, out2)
    assert torch.equal(grad, grad2)
    # a float mask works like the bool one
    out3, _ = _grad(loss, logp, logp_old, adv, mask.float())
    assert torch.equal(out, out3)
    # the optional clipfrac: bool, never at a masked position, blind to what they hold
    if hasattr(loss, "clipped"):
        clipped = loss.clipped(logp, logp_old, adv, mask)
        assert clipped.dtype == torch.bool and clipped.shape == mask.shape
        assert not clipped[~mask].any()
        assert torch.equal(loss.clipped(*dirty, mask), clipped)
    # what a loss reports from its call is what clipped gives, for the same loss value
    if get_registry().info("policy_loss", LOSSES[key][0]).entry.metrics:
        reported: dict[str, torch.Tensor] = {}
        assert torch.equal(loss(logp, logp_old, adv, mask, metrics=reported), out.detach())
        assert torch.equal(reported["clipfrac"], loss.clipped(logp, logp_old, adv, mask))


@pytest.mark.parametrize("key", LOSSES)
def test_bfloat16_inputs_give_float32(key):
    loss = loss_of(key)
    g = torch.Generator().manual_seed(list(LOSSES).index(key))
    logp = -torch.rand(3, 5, generator=g)
    logp_old = logp + 0.1 * torch.randn(3, 5, generator=g)
    adv = torch.randn(3, 5, generator=g)
    mask = torch.rand(3, 5, generator=g) < 0.8
    low = loss(*(x.to(torch.bfloat16) for x in (logp, logp_old, adv)), mask)
    assert low.dtype == torch.float32
    ref = loss(*(x.to(torch.bfloat16).float() for x in (logp, logp_old, adv)), mask)
    torch.testing.assert_close(low, ref)


@pytest.mark.parametrize("key", LOSSES)
@EACH
@given(token_tensors(n=3))
def test_extreme_log_ratios_stay_finite(key, case):
    logp, _, adv, mask = _inputs(case)
    logp_old = logp - 100.0 * torch.sign(adv)
    out, grad = _grad(loss_of(key), logp, logp_old, adv, mask)
    assert torch.isfinite(out).all()
    assert torch.isfinite(grad).all()


def test_registry_builds_and_validates_policy_losses():
    registry = build_registry()
    ppo = registry.create("policy_loss", "ppo_clip", clip_high=0.28)
    assert isinstance(ppo, PPOClip)
    assert (ppo.clip_low, ppo.clip_high, ppo.dual_clip) == (0.2, 0.28, None)
    gspo = registry.create("policy_loss", "gspo")
    assert (gspo.clip_low, gspo.clip_high) == (3e-4, 4e-4)
    with pytest.raises(RegistryError, match="clip_high"):
        registry.create("policy_loss", "cispo")
    with pytest.raises(RegistryError, match="dual_clip"):
        registry.create("policy_loss", "ppo_clip", dual_clip=1.0)
    with pytest.raises(RegistryError, match="clip_high"):
        registry.create("policy_loss", "cispo", clip_high=0.0)
    assert registry.info("policy_loss", "ppo_clip").requires == ("logp_old",)
    assert "1707.06347" in registry.info("policy_loss", "ppo_clip").source
    assert "2507.18071" in registry.info("policy_loss", "gspo").source
    assert "2506.13585" in registry.info("policy_loss", "cispo").source
    assert registry.info("policy_loss", "reinforce").requires == ()
