"""The loss the trainer backpropagates is the objective ``ppokit explain`` states
(docs/design.md), with prompt weights that are not 0/1.

A fixed batch of 3 prompts × 4 responses with hand-chosen rewards, pass_rate_variance as the
prompt weight of the actor and of the critic (one group solved by every response: weight
0), KL in the loss, an entropy bonus and an NLL term. The objective is computed here from
the component functions and plain torch (full logits, no chunking, whole-batch
aggregations), as explain prints it:

    mask' = mask·[ω > 0]
    L_π = agg(pl(logp, logp_old, A, mask') · ω[:, None], mask')
          + β·agg(kl(logp, logp_ref), mask') − c_H·agg(entropy, mask')
          + c_NLL·agg(−logp, mask'·[R > 0])
    L_V = vf_coef · agg_V(ℓ(V_φ(s_t), Y_t, V_old(s_t)) · ω^V[:, None], m^V)
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from ppokit.errors import ComponentError
from ppokit.explain import explain
from ppokit.registry import get_registry
from ppokit.spec import ComponentSpec, Spec
from ppokit.trainer.contract import Where
from ppokit.trainer.estimation import UpdateData, estimate, round_batch
from ppokit.trainer.metrics import Meter
from ppokit.trainer.objective import loss_metrics
from ppokit.trainer.rollout import Rollout
from tests.helpers.trainer import (
    Trainee,
    accumulate,
    demo_rows,
    encode,
    learner,
    small_spec,
    with_observations,
)

#: Outcome rewards R, 3 groups of 4: pass rates 0.25, 0.375 and 1 (weight 0).
REWARDS = [1.0, 0.0, 0.0, 0.0, 1.0, 0.5, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]
#: pass_rate_variance: p(1 − p) per group, normalised to mean 1 over the 12 responses.
RAW = [0.25 * 0.75] * 4 + [0.375 * 0.625] * 4 + [0.0] * 4
WEIGHTS = [w * 12 / sum(RAW) for w in RAW]
#: Response lengths (positions of the response mask).
LENGTHS = [5, 3, 4, 1, 2, 5, 5, 3, 4, 2, 5, 1]
T = 5

OBJECTIVE = [
    "rollout.prompts_per_round=3",
    "rollout.n=4",
    f"rollout.max_new_tokens={T}",
    "rollout.temperature=0.8",
    "policy.weight=pass_rate_variance",
    "critic.weight=pass_rate_variance",
    "critic.loss=clipped_mse",
    "kl.estimator=k3",
    "kl.coef=0.2",
    "kl.placement=loss",
    "policy.entropy_coef=0.1",
    "policy.nll_coef=0.3",
    "train.vf_coef=0.7",
]

#: Rollout corrections over an engine whose μ is off π_old (noise of this scale).
CORRECTIONS = {
    "token_tis": ["policy.correction={name: token_tis, cap: 1.05}"],
    "token_mis": ["policy.correction={name: token_mis, low: 0.95, high: 1.05}"],
    "seq_mis": ["policy.correction={name: seq_mis, low: 0.8, high: 1.25}"],
}
MISMATCH = 0.1

AGGREGATIONS = {
    "token_mean": [],
    "seq_mean_token_mean": ["critic.aggregation=seq_mean_token_mean"],
    "seq_mean_token_sum_norm": ["policy.loss.clip_high=0.28"],
}


def _create(kind: str, comp: ComponentSpec) -> Any:
    return get_registry().create(kind, comp.name, **comp.params)


def _rollout(lrn: Trainee) -> Rollout:
    """3 prompts × 4 fixed responses, log π_old recorded from the actor as sampling would."""
    rows = demo_rows(3)
    ids, attn = encode(lrn, [r["prompt"] for r in rows], 4)
    g = torch.Generator().manual_seed(7)
    response = torch.randint(3, 60, (12, T), generator=g)  # no EOS (id 2), no padding (id 0)
    mask = torch.arange(T)[None, :] < torch.tensor(LENGTHS)[:, None]
    response = response.masked_fill(~mask, 0)
    ro = Rollout(ids, attn, response, mask, mask.all(1), None)
    with torch.no_grad():
        logp, _, _ = lrn.setup.forwards.actor(lrn.setup.models.actor, ro)
    ro.logp_rollout = logp * mask
    return ro


def _perturb(lrn: Trainee) -> None:
    """Move the actor and the critic away from the rollout's (ratios and values ≠ 1 and
    V_old: clipping and KL active)."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in [*lrn.setup.models.actor.parameters(), *lrn.setup.models.critic_parameters()]:
            p.add_(0.08 * torch.randn(p.shape, generator=g))


def _forward(lrn: Trainee, ro: Rollout) -> tuple[Tensor, Tensor, Tensor]:
    """(log π, entropy, V_φ) of the responses from full logits and the critic's trunk."""
    ids, attn = ro.inputs()
    positions = (attn.cumsum(-1) - 1).clamp_min(0)
    p = ro.prompt_len
    logits = lrn.setup.models.actor(
        input_ids=ids, attention_mask=attn, position_ids=positions
    ).logits
    logsm = F.log_softmax(logits[:, p - 1 : -1].float() / lrn.setup.spec.rollout.temperature, -1)
    logp = logsm.gather(-1, ro.response_ids[..., None]).squeeze(-1)
    entropy = -(logsm.exp() * logsm).sum(-1)
    critic = lrn.setup.models.critic
    assert critic is not None
    hidden = critic.trunk(
        input_ids=ids, attention_mask=attn, position_ids=positions, use_cache=False
    ).last_hidden_state
    values = critic(hidden[:, p - 1 : -1])[..., 0]
    return logp, entropy, values


def objective(
    spec: Spec, lrn: Trainee, data: UpdateData, scores: Tensor, rows: Tensor
) -> dict[str, Tensor]:
    """L_π and L_V over the minibatch ``rows`` as explain states them (ω, A, Y and m^V are
    estimated on the whole round's batch), and two objectives explain does not state."""
    pol, crit, kl = spec.policy, spec.critic, spec.kl
    assert crit is not None and kl is not None
    agg = _create("aggregation", pol.aggregation)
    pl = _create("policy_loss", pol.loss)
    k = _create("kl_estimator", kl.estimator)
    omega = _create("prompt_weight", pol.weight)(data.batch)[rows]
    c = _create("rollout_correction", pol.correction)(data.batch)[rows]
    adv = _create("advantage", spec.advantage)(data.batch)[rows]
    y = _create("critic_target", crit.target)(data.batch)[rows]
    m_v = _create("position_mask", crit.mask)(data.batch)[rows]
    omega_v = _create("prompt_weight", crit.weight)(data.batch)[rows]
    batch, r = data.batch.rows(rows), scores[rows]
    logp, entropy, values = _forward(lrn, data.rollout.rows(rows))
    logp_old, logp_ref = batch.logp_old, batch.logp_ref

    mask = batch.response_mask
    mask_ = mask & (omega > 0)[:, None] & (c > 0)  # mask'
    positive = mask_ & (r > 0)[:, None]
    policy = agg(pl(logp, logp_old, adv, mask_) * omega[:, None] * c, mask_)
    actor = (
        policy
        + kl.coef * agg(k(logp, logp_ref), mask_)
        - pol.entropy_coef * agg(entropy, mask_)
        + pol.nll_coef * agg(-logp, positive)
    )
    ell = _create("regression_loss", crit.loss)(values, y, batch.values)
    critic_agg = _create("aggregation", crit.aggregation)
    critic = spec.train.vf_coef * critic_agg(ell * omega_v[:, None], m_v)

    # what explain printed before: ω inside the mask, KL and entropy over every response
    weighted = mask.float() * omega[:, None]
    old_explain = (
        agg(pl(logp, logp_old, adv, weighted), weighted)
        + kl.coef * agg(k(logp, logp_ref), mask)
        - pol.entropy_coef * agg(entropy, mask)
        + pol.nll_coef * agg(-logp, weighted * (r > 0)[:, None])
    )
    # regularisers weighted by ω too
    weighted_regularisers = (
        policy
        + kl.coef * agg(k(logp, logp_ref) * omega[:, None], mask_)
        - pol.entropy_coef * agg(entropy * omega[:, None], mask_)
        + pol.nll_coef * agg(-logp * omega[:, None], positive)
    )
    return {
        "omega": omega,
        "objective": actor + critic,
        "old explain": old_explain + critic,
        "weighted regularisers": weighted_regularisers + critic,
    }


def _setup(
    tmp_path: Any,
    *extra: str,
    mismatch: float = 0.0,
    observations: bool = False,
    stale: bool = False,
) -> tuple[Spec, Trainee, UpdateData, Tensor]:
    """A learner, the round's estimates on the fixed rollout, then the models moved;
    ``mismatch``: the engine's log μ off π_old by noise of that scale (π_old recomputed);
    ``observations``: a multi-turn rollout, with environment tokens inside the responses;
    ``stale``: asynchronous (``rollout.max_staleness: 1``), the rollout sampled by the
    weights one update before those the round's π_old is computed at."""
    spec = small_spec(tmp_path, *OBJECTIVE, *extra)
    lrn = learner(spec)
    ro = _rollout(lrn)
    if observations:
        ro = with_observations(ro)
    if mismatch:
        assert ro.logp_rollout is not None
        noise = torch.randn(ro.logp_rollout.shape, generator=torch.Generator().manual_seed(5))
        ro.logp_rollout = (ro.logp_rollout + mismatch * noise) * ro.response_mask
    if stale:  # the update before this round, while the engine generated it
        _perturb(lrn)
    scores = torch.tensor(REWARDS)
    batch = round_batch(
        ro,
        scores,
        None,
        n=spec.rollout.n,
        forwards=lrn.setup.forwards,
        assembly=lrn.setup.assembly,
        recompute_logp_old=bool(mismatch) or lrn.setup.recompute_logp_old,
    )
    data, _, _ = estimate(
        ro, batch, scores, spec=spec, assembly=lrn.setup.assembly, kl_coef=lrn.state.kl_coef
    )
    _perturb(lrn)
    lrn.setup.forwards.train_mode()
    return spec, lrn, data, scores


def _assert_every_partition_trains_the_objective(
    spec: Spec, lrn: Trainee, data: UpdateData, scores: Tensor
) -> None:
    """The loss of the whole batch, of a shuffled one in micro-batches of uneven sizes and of
    some of its rows in micro-batches of 2 is the stated objective of those rows."""
    b = len(REWARDS)
    perm = torch.randperm(b, generator=torch.Generator().manual_seed(1))
    expected = objective(spec, lrn, data, scores, torch.arange(b))["objective"]
    for micro in (b, 5, 1):
        total = accumulate(lrn, data, perm, micro, train_actor=True)
        torch.testing.assert_close(total, expected, rtol=1e-5, atol=1e-6)
    rows = torch.tensor([0, 5, 9, 10, 6])
    loss = accumulate(lrn, data, rows, 2, train_actor=True)
    torch.testing.assert_close(loss, objective(spec, lrn, data, scores, rows)["objective"])


@pytest.mark.parametrize("aggregation", sorted(AGGREGATIONS))
def test_the_trainer_loss_is_the_explained_objective(tmp_path, aggregation: str) -> None:
    spec, lrn, data, scores = _setup(
        tmp_path, f"policy.aggregation={aggregation}", *AGGREGATIONS[aggregation]
    )
    b = len(REWARDS)
    every = torch.arange(b)
    loss = accumulate(lrn, data, every, b, train_actor=True)
    by_hand = objective(spec, lrn, data, scores, every)

    torch.testing.assert_close(by_hand["omega"], torch.tensor(WEIGHTS))
    torch.testing.assert_close(data.policy_weights, torch.tensor(WEIGHTS))
    expected = by_hand["objective"]
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    # the batch tells the objectives apart: neither alternative is the trainer's loss
    for other in ("old explain", "weighted regularisers"):
        assert (by_hand[other] - loss).abs() > 1e-3, other

    # micro-batches of uneven sizes over a shuffled minibatch: the same total
    perm = torch.randperm(b, generator=torch.Generator().manual_seed(1))
    for micro in (5, 1):
        total = accumulate(lrn, data, perm, micro, train_actor=True)
        torch.testing.assert_close(total, expected, rtol=1e-5, atol=1e-6)


#: Each correction with one aggregation and each aggregation with one correction: the
#: correction weights the policy term and the aggregation divides by the mask it leaves, one
#: slot each, so the diagonal of the grid holds what the whole grid would.
DIAGONAL = list(zip(sorted(CORRECTIONS), sorted(AGGREGATIONS), strict=True))


@pytest.mark.parametrize(("correction", "aggregation"), DIAGONAL)
def test_a_correction_enters_the_objective_as_design_says(
    tmp_path, aggregation: str, correction: str
) -> None:
    """L_π with c: agg(pl·ω·c, mask·[ω > 0]·[c > 0]) and the regularisers over that mask;
    exact for the whole minibatch, its rows, and micro-batches of uneven sizes."""
    spec, lrn, data, scores = _setup(
        tmp_path,
        f"policy.aggregation={aggregation}",
        *AGGREGATIONS[aggregation],
        *CORRECTIONS[correction],
        mismatch=MISMATCH,
    )
    c = data.correction
    mask = data.batch.response_mask
    assert not torch.equal(c, data.batch.maskf), "the correction acts on this batch"
    if correction != "token_tis":
        assert (mask & (c == 0)).any(), "it rejects some tokens"
    _assert_every_partition_trains_the_objective(spec, lrn, data, scores)


@pytest.mark.parametrize(
    ("aggregation", "correction"),
    [
        ("token_mean", "token_tis"),
        ("seq_mean_token_mean", "none"),
        ("seq_mean_token_sum_norm", "token_tis"),
    ],
)
def test_a_stale_batch_trains_the_decoupled_objective(
    tmp_path, aggregation: str, correction: str
) -> None:
    """Staleness 1: log μ from the weights one update before, log π_old recomputed at the
    weights the update starts from (not μ), c = correction(π_old/μ): the loss is the stated
    objective with them, for the whole minibatch, its rows and micro-batches; with
    ``rollout.logp_old: rollout`` (bypass) π_old is μ itself and c is 1."""
    extra = [
        f"policy.aggregation={aggregation}",
        *AGGREGATIONS[aggregation],
        "rollout.max_staleness=1",
        *(CORRECTIONS[correction] if correction != "none" else []),
    ]
    spec, lrn, data, scores = _setup(tmp_path, *extra, stale=True)
    assert lrn.setup.recompute_logp_old
    batch = data.batch
    assert batch.logp_old is not None and batch.logp_rollout is not None
    assert (batch.logp_old - batch.logp_rollout).abs().max() > 1e-3  # π_old is not μ
    if correction != "none":
        assert not torch.equal(data.correction, batch.maskf), "the correction acts"
    _assert_every_partition_trains_the_objective(spec, lrn, data, scores)
    if aggregation != "token_mean":
        return
    _, lrn, data, _ = _setup(tmp_path, *extra, "rollout.logp_old=rollout", stale=True)
    assert not lrn.setup.recompute_logp_old
    assert data.batch.logp_old is data.batch.logp_rollout  # bypass: π_old := μ
    torch.testing.assert_close(data.correction, data.batch.maskf)


@pytest.mark.parametrize("aggregation", sorted(AGGREGATIONS))
def test_the_environment_tokens_get_no_gradient(tmp_path, monkeypatch, aggregation: str) -> None:
    """A multi-turn batch: the loss is the objective over the model's tokens (the
    environment's are in the forward passes' context only), for the whole minibatch and
    micro-batches; and the gradient reaching the actor's hidden state that predicts an
    environment token, and the critic's value of the state before one, is exactly 0."""
    from ppokit.trainer import forwards

    spec, lrn, data, scores = _setup(
        tmp_path, f"policy.aggregation={aggregation}", *AGGREGATIONS[aggregation], observations=True
    )
    env = data.batch.env_mask
    assert env is not None and env.any() and not (env & data.batch.response_mask).any()
    grads: list[tuple[str, Tensor, Tensor, Tensor]] = []
    hidden, head = forwards.Forwards._hidden, forwards.Forwards.critic_head_out

    def watch(out: Tensor, ro: Rollout, who: str) -> Tensor:
        if out.requires_grad:
            out.register_hook(lambda g: grads.append((who, g, ro.env_mask, ro.response_mask)))
        return out

    def actor_states(self: Any, model: Any, ro: Rollout) -> Tensor:
        return watch(hidden(self, model, ro), ro, "actor")

    def critic_values(self: Any, ro: Rollout, shared: Any) -> Tensor:
        return watch(head(self, ro, shared), ro, "critic")

    monkeypatch.setattr(forwards.Forwards, "_hidden", actor_states)
    monkeypatch.setattr(forwards.Forwards, "critic_head_out", critic_values)
    b = len(REWARDS)
    expected = objective(spec, lrn, data, scores, torch.arange(b))["objective"]
    perm = torch.randperm(b, generator=torch.Generator().manual_seed(1))
    for micro in (b, 5, 1):
        grads.clear()
        total = accumulate(lrn, data, perm, micro, train_actor=True)
        torch.testing.assert_close(total, expected, rtol=1e-5, atol=1e-6)
        assert len(grads) == 2 * len(range(0, b, micro))  # the actor's and the critic's
        reached = {"actor": False, "critic": False}
        for who, g, env_rows, model_rows in grads:
            before = g[:, :-1].abs().sum(-1)  # the state before each response token
            assert not before[env_rows].any()
            reached[who] |= bool(before[model_rows].gt(0).any())
        assert all(reached.values())  # (some micro-batches hold rows of weight 0 only)


def test_a_minibatch_loss_is_the_objective_of_its_rows(tmp_path) -> None:
    """A minibatch has its own mask' and denominators, also when every one of its rows has
    actor weight 0 (then only the critic's term is left, 0 too with ω^V = 0)."""
    spec, lrn, data, scores = _setup(tmp_path)
    for rows in (torch.tensor([0, 5, 9, 10, 6]), torch.tensor([8, 9, 10, 11])):
        loss = accumulate(lrn, data, rows, 2, train_actor=True)
        expected = objective(spec, lrn, data, scores, rows)["objective"]
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)


def test_explain_states_the_objective(tmp_path) -> None:
    text = explain(small_spec(tmp_path, *OBJECTIVE))
    for line in (
        "mask' = mask·[ω > 0]: rows of weight 0 leave every actor term and its denominator",
        "L_π = token_mean(ppo_clip(logp, logp_old, A, mask') · ω[:, None], mask')",
        "+ 0.2·token_mean(k3(logp, logp_ref), mask')",
        "− 0.1·token_mean(entropy, mask')",
        "+ 0.3·token_mean(−logp, mask'·[R > 0])",
        "L_V = 0.7 · token_mean(clipped_mse(V_φ(s_t), Y_t, V_old(s_t)) · ω[:, None], m^V)",
        "(rows of weight ω = 0 stay in m^V and in the denominator)",
    ):
        assert line in text, line


@pytest.mark.parametrize("loss", ["ppo_clip", "gspo", "{name: cispo, clip_high: 0.1}"])
def test_a_loss_reports_its_clipfrac_from_its_one_ratio(tmp_path, monkeypatch, loss: str) -> None:
    """Each micro-batch computes the policy loss's ratio once and clipped_mse's branches once:
    clipfrac and vf_clipfrac come from the losses' own calls, not from a second one."""
    from ppokit.components.policy_loss import impl
    from ppokit.components.regression_loss.impl import ClippedMSE

    _, lrn, data, _ = _setup(tmp_path, f"policy.loss={loss}")
    calls: list[str] = []
    log_ratio, sequence, branches = impl._log_ratio, impl.GSPO.sequence_ratio, ClippedMSE._branches

    def counted(name: str, fn: Any) -> Any:
        return lambda *args: calls.append(name) or fn(*args)

    monkeypatch.setattr(impl, "_log_ratio", counted("ratio", log_ratio))
    monkeypatch.setattr(impl.GSPO, "sequence_ratio", staticmethod(counted("ratio", sequence)))
    monkeypatch.setattr(ClippedMSE, "_branches", counted("branches", branches))
    objective, b = lrn.setup.objective, len(REWARDS)
    idx = torch.arange(b)
    denoms = objective.denominators(data, idx)
    meter = Meter()
    for j in idx.split(5):
        calls.clear()
        share = j.shape[0] / b
        objective.micro_loss(data, j, denoms, share, lrn.state.kl_coef, True, meter)
        assert sorted(calls) == ["branches", "ratio"]
    means = meter.means()
    assert 0 <= float(means["clipfrac"]) <= 1 and 0 <= float(means["vf_clipfrac"]) <= 1


def test_a_loss_metric_that_is_not_per_position_is_one_line() -> None:
    where = Where("policy.loss", "mine", "plugin x")
    mask = torch.ones(2, 3, dtype=torch.bool)
    loss_metrics(where, {"clipfrac": torch.zeros(2, 3)}, mask, Meter())
    with pytest.raises(ComponentError, match=r"policy.loss .*'clipfrac'.*\[2, 3\]"):
        loss_metrics(where, {"clipfrac": torch.zeros(())}, mask, Meter())


def test_the_rows_of_the_update_data_are_the_rows_of_every_field(tmp_path) -> None:
    """One way to take a round's rows (a micro-batch's, a process's own): every estimate
    and every batch field at those rows, the positions cut to the width ([B, K] fields
    whole), with the rollout given."""
    from dataclasses import fields

    from ppokit.batch import FIELDS, PART_FIELDS

    _, _, data, _ = _setup(tmp_path, "policy.loss.clip_high=0.28")
    j, w = torch.tensor([3, 0, 7]), 3
    mine = data.rows(j, w)
    assert mine.rollout is None and mine.round_width == data.round_width

    def expected(x: Tensor, whole: bool = False) -> Tensor:
        return x[j] if x.dim() == 1 or whole else x[j][:, :w]

    for f in fields(data):
        x = getattr(data, f.name)
        if isinstance(x, Tensor):
            assert torch.equal(getattr(mine, f.name), expected(x)), f.name
    for name in FIELDS:
        x = getattr(data.batch, name)
        if x is not None:
            assert torch.equal(getattr(mine.batch, name), expected(x, name in PART_FIELDS))
    assert mine.batch.seq_len == w and data.rows(j).batch.seq_len == data.batch.seq_len


def test_a_loss_that_declares_no_metrics_is_called_as_before(tmp_path, monkeypatch) -> None:
    """A loss whose entry declares no metrics (a plugin's written before them) is called
    with its four arguments and its ``clipped`` still gives clipfrac: the same fraction as
    the one a loss reports from its call; clipped_mse's vf_clipfrac likewise."""
    from ppokit.components.policy_loss import impl
    from ppokit.components.regression_loss.impl import ClippedMSE

    _, lrn, data, _ = _setup(tmp_path)
    objective, b = lrn.setup.objective, len(REWARDS)
    keywords: list[set[str]] = []
    policy, critic = impl.PPOClip.__call__, ClippedMSE.__call__

    def spied(real: Any) -> Any:
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            keywords.append(set(kwargs))
            return real(self, *args, **kwargs)

        return call

    monkeypatch.setattr(impl.PPOClip, "__call__", spied(policy))
    monkeypatch.setattr(ClippedMSE, "__call__", spied(critic))

    def metrics() -> dict[str, float]:
        idx, meter = torch.arange(b), Meter()
        denoms = objective.denominators(data, idx)
        for j in idx.split(5):
            share = j.shape[0] / b
            objective.micro_loss(data, j, denoms, share, lrn.state.kl_coef, True, meter)
        return {k: float(v) for k, v in meter.means().items() if "clipfrac" in k}

    reported = metrics()
    assert keywords and all(k == {"metrics"} for k in keywords)
    keywords.clear()
    monkeypatch.setitem(objective.__dict__, "reporting", frozenset())  # as if none declared
    assert metrics() == reported and reported["clipfrac"] > 0
    assert keywords and all(not k for k in keywords)
