"""AdamW on one process is torch's fused implementation (one kernel over every parameter),
which steps the weights as the per-parameter loop does, to float32 rounding."""

from __future__ import annotations

import copy

import torch

from ppokit.trainer.models import build_models
from ppokit.trainer.optim import Optimizers
from tests.helpers.trainer import small_spec


def test_a_run_s_adamw_is_fused_and_steps_as_the_loop_does() -> None:
    spec = small_spec(None, "train.weight_decay=0.1", "critic={}")
    models = build_models(spec, 1)
    opts = Optimizers.create(spec, models)
    assert opts.critic is not None
    for opt in (opts.actor, opts.critic):
        assert opt.defaults["fused"] is True
    actor = copy.deepcopy(models.actor)
    loop = torch.optim.AdamW(actor.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    for group in opts.actor.param_groups:
        group["lr"] = 1e-2
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        for p, q in zip(models.actor.parameters(), actor.parameters(), strict=True):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        opts.actor.step()
        loop.step()
    moved = 0.0
    for p, q in zip(models.actor.parameters(), actor.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)
    for p, q in zip(
        models.actor.parameters(), build_models(spec, 1).actor.parameters(), strict=True
    ):
        moved = max(moved, float((p - q).detach().abs().max()))
    assert moved > 1e-3  # the steps moved the weights
