"""log μ of the sampled tokens as an engine that samples with top-k/top-p records it, from
the trainer's own forward pass: log_softmax over the kept tokens of its logits."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ppokit.components.rollout_engine.impl import filter_logits


def truncated_logp(lrn: Any, ro: Any, **sampled: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(log μ [B, T] under the spec's temperature, top_k and top_p, or those ``sampled``
    with, the full log π [B, T]) of ``ro``'s responses, from ``lrn``'s actor as it is."""
    rollout = lrn.setup.spec.rollout.model_copy(update=sampled)
    with torch.no_grad():
        full, _, hidden = lrn.setup.forwards.actor(lrn.setup.models.actor, ro)
        scaled = lrn.setup.models.actor.get_output_embeddings()(hidden[:, :-1]).float()
    kept = filter_logits(scaled / rollout.temperature, rollout.top_k, rollout.top_p)
    mu = F.log_softmax(kept, -1).gather(-1, ro.response_ids.unsqueeze(-1)).squeeze(-1)
    return mu, full
