"""The score-function identity behind every baseline, checked by exact enumeration.

1. sum_a pi(a|s) grad log pi(a|s) = 0 for a softmax policy (autograd, every action).
2. On a small tree-structured problem (depth-D sequences over a K-token vocabulary, one
   softmax per prefix, a reward on each leaf), the exact policy gradient grad E[R] equals
   E[sum_t grad log pi(a_t|s_t) (R - b(s_t))] for any state-dependent baseline b, computed
   through the ``reinforce`` policy loss; an action-dependent "baseline" breaks it.
"""

from __future__ import annotations

import itertools

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ppokit.components.policy_loss.impl import Reinforce
from tests.helpers.components import make

SETTINGS = settings(max_examples=50, deadline=None)


@SETTINGS
@given(st.integers(0, 2**31 - 1), st.integers(2, 12), st.floats(0.1, 4.0))
def test_score_function_has_zero_mean(seed, k, scale):
    g = torch.Generator().manual_seed(seed)
    theta = (scale * torch.randn(k, generator=g, dtype=torch.float64)).requires_grad_(True)
    logp = torch.log_softmax(theta, 0)
    pi = logp.exp().detach()
    scores = torch.stack(
        [torch.autograd.grad(logp[a], theta, retain_graph=True)[0] for a in range(k)]
    )
    # grad_theta log pi(a) = e_a - pi
    torch.testing.assert_close(scores, torch.eye(k, dtype=torch.float64) - pi)
    torch.testing.assert_close(pi @ scores, torch.zeros(k, dtype=torch.float64))
    # weighting by anything but pi does not cancel in general
    uniform = torch.full((k,), 1.0 / k, dtype=torch.float64)
    if (pi - uniform).abs().max() > 1e-3:
        assert (uniform @ scores).abs().max() > 1e-6


class Tree:
    """All K^D sequences of a depth-D, K-ary tree; node ids of every prefix."""

    def __init__(self, k: int, depth: int) -> None:
        self.k = k
        self.depth = depth
        paths = list(itertools.product(range(k), repeat=depth))
        self.actions = torch.tensor(paths)  # [N, D]
        offsets = [sum(k**j for j in range(d)) for d in range(depth)]
        nodes = []
        for path in paths:
            row, index = [], 0
            for d in range(depth):
                row.append(offsets[d] + index)
                index = index * k + path[d]
            nodes.append(row)
        self.nodes = torch.tensor(nodes)  # [N, D]: the state before each token
        self.num_nodes = sum(k**d for d in range(depth))

    def logp(self, logits: torch.Tensor) -> torch.Tensor:
        """log pi(a_t | s_t) for every sequence and step, [N, D]."""
        table = torch.log_softmax(logits, dim=-1)
        return table[self.nodes, self.actions]


def _problem(seed: int, k: int, depth: int):
    g = torch.Generator().manual_seed(seed)
    tree = Tree(k, depth)
    logits = torch.randn(tree.num_nodes, k, generator=g)
    rewards = torch.randn(len(tree.actions), generator=g)
    baseline = 3.0 * torch.randn(tree.num_nodes, generator=g)
    return tree, logits, rewards, baseline


def _exact_gradient(tree: Tree, logits: torch.Tensor, rewards: torch.Tensor) -> torch.Tensor:
    theta = logits.clone().requires_grad_(True)
    prob = tree.logp(theta).sum(1).exp()
    (grad,) = torch.autograd.grad((prob * rewards).sum(), theta)
    return grad


def _surrogate_gradient(
    tree: Tree, logits: torch.Tensor, adv: torch.Tensor, loss=None
) -> torch.Tensor:
    """-grad of E_tau[sum_t l(tau, t)] with the policy loss l, by exact enumeration."""
    loss = Reinforce() if loss is None else loss
    theta = logits.clone().requires_grad_(True)
    logp = tree.logp(theta)
    prob = logp.sum(1).exp().detach()
    mask = torch.ones_like(logp, dtype=torch.bool)
    elementwise = loss(logp, logp.detach(), adv, mask)
    (grad,) = torch.autograd.grad((prob[:, None] * elementwise).sum(), theta)
    return -grad


@SETTINGS
@given(st.integers(0, 2**31 - 1), st.integers(2, 3), st.integers(1, 3))
def test_state_baseline_leaves_the_policy_gradient_unchanged(seed, k, depth):
    tree, logits, rewards, baseline = _problem(seed, k, depth)
    exact = _exact_gradient(tree, logits, rewards)
    plain = rewards[:, None].expand(-1, depth)
    with_baseline = rewards[:, None] - baseline[tree.nodes]
    tol = {"rtol": 1e-4, "atol": 1e-5}
    torch.testing.assert_close(_surrogate_gradient(tree, logits, plain), exact, **tol)
    torch.testing.assert_close(_surrogate_gradient(tree, logits, with_baseline), exact, **tol)
    # on-policy, the clipped surrogate has the same gradient
    ppo = make("policy_loss", "ppo_clip")
    torch.testing.assert_close(_surrogate_gradient(tree, logits, with_baseline, ppo), exact, **tol)


@SETTINGS
@given(st.integers(0, 2**31 - 1), st.integers(2, 3), st.integers(1, 3))
def test_action_dependent_baseline_biases_the_gradient(seed, k, depth):
    """The identity needs b to depend on the state only: subtracting b(s, a) shifts the
    gradient of state s's logits by -P(reach s) pi_s * (b(s, .) - E_{pi_s}[b(s, .)])."""
    tree, logits, rewards, _ = _problem(seed, k, depth)
    g = torch.Generator().manual_seed(seed + 1)
    per_action = 3.0 * torch.randn(tree.num_nodes, k, generator=g)
    adv = rewards[:, None] - per_action[tree.nodes, tree.actions]
    exact = _exact_gradient(tree, logits, rewards)
    biased = _surrogate_gradient(tree, logits, adv)
    pi = torch.softmax(logits, -1)
    prob = tree.logp(logits).sum(1).exp()
    reach = torch.zeros(tree.num_nodes).index_add_(
        0, tree.nodes.flatten(), prob[:, None].expand(-1, depth).flatten()
    )
    centred = per_action - (pi * per_action).sum(-1, keepdim=True)
    bias = -reach[:, None] * pi * centred
    torch.testing.assert_close(biased - exact, bias, rtol=1e-4, atol=1e-5)
    assert bias.abs().max() > 1e-6


def test_hand_computed_bandit():
    """One step, two actions, pi = (1/2, 1/2), R = (1, 0): grad E[R] wrt the logits is
    pi_0 (1 - pi_0) (1, -1) = (1/4, -1/4), with or without the baseline b = 1/2."""
    tree = Tree(2, 1)
    logits = torch.zeros(1, 2)
    rewards = torch.tensor([1.0, 0.0])
    expected = torch.tensor([[0.25, -0.25]])
    torch.testing.assert_close(_exact_gradient(tree, logits, rewards), expected)
    adv = (rewards - 0.5)[:, None]
    torch.testing.assert_close(_surrogate_gradient(tree, logits, adv), expected)
