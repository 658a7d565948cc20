"""The trainer's forward passes over a :class:`~ppokit.trainer.rollout.Rollout`: the actor's
log-probs, entropy and hidden states, the reference policy's log-probs and the value head's
output. The trunk and the LM head run apart (the head in chunks); on several processes each
runs as the sharded model's forward (:func:`ppokit.distributed.as_forward`)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ppokit import distributed
from ppokit.trainer.logprobs import output_head, response_hidden, token_logprobs, trunk_hidden
from ppokit.trainer.models import Models, ValueModel, autocast, trunk_of
from ppokit.trainer.rollout import Rollout

__all__ = ["Forwards"]


class Forwards:
    """The forward passes of a run's ``models`` at sampling ``temperature``."""

    def __init__(self, models: Models, temperature: float) -> None:
        self.models = models
        self.temperature = temperature

    def _hidden(self, model: nn.Module, ro: Rollout) -> Tensor:
        ids, attn = ro.inputs()
        with autocast(self.models.runtime):
            return response_hidden(trunk_hidden(trunk_of(model), ids, attn), ro.prompt_len)

    def hidden(self, model: nn.Module, ro: Rollout) -> Tensor:
        """The trunk's hidden states ``[B, T+1, H]`` of the responses (no LM head)."""
        return distributed.as_forward(model, lambda: self._hidden(model, ro))

    def _forward(
        self, model: nn.Module, ro: Rollout, entropy: bool
    ) -> tuple[Tensor, Tensor | None, Tensor]:
        """(log π [B,T], entropy [B,T] or None, hidden states [B,T+1,H]) of ``model``."""

        def forward() -> tuple[Tensor, Tensor | None, Tensor]:
            hidden = self._hidden(model, ro)
            with autocast(self.models.runtime):
                logp, ent = token_logprobs(
                    hidden[:, :-1],
                    output_head(model),
                    ro.response_ids,
                    self.temperature,
                    entropy=entropy,
                )
            return logp, ent, hidden

        return distributed.as_forward(model, forward)

    def actor(self, model: nn.Module, ro: Rollout) -> tuple[Tensor, Tensor, Tensor]:
        """(log π [B,T], entropy [B,T], hidden states [B,T+1,H]) of the responses."""
        logp, ent, hidden = self._forward(model, ro, entropy=True)
        assert ent is not None
        return logp, ent, hidden

    def policy_logprobs(self, ro: Rollout) -> Tensor:
        """log π_old [B,T] of the responses: the actor as it is, without gradients."""
        with torch.no_grad():
            return self._forward(self.models.actor, ro, entropy=False)[0]

    def reference_logprobs(self, ro: Rollout) -> Tensor:
        """log π_ref [B,T] of the responses (no entropy pass), from ``Models.reference()``:
        the frozen copy, or with LoRA the actor with its adapters disabled."""
        with torch.no_grad(), self.models.reference() as ref:
            return self._forward(ref, ro, entropy=False)[0]

    def critic_head_out(self, ro: Rollout, shared_hidden: Tensor | None) -> Tensor:
        """The value head's output ``[B, T+1, head_size]`` (state before each token, then the
        state after the last position); ``shared_hidden``: the actor trunk's states, for a
        shared critic."""
        critic = self.models.critic
        assert critic is not None
        if shared_hidden is not None:
            with autocast(self.models.runtime):
                return critic(shared_hidden)

        trunk = critic.trunk
        assert trunk is not None  # a separate critic has its own trunk

        def forward() -> Tensor:
            ids, attn = ro.inputs()
            with autocast(self.models.runtime):
                hidden = response_hidden(trunk_hidden(trunk, ids, attn), ro.prompt_len)
                if distributed.sharded(critic):  # this function is the critic's forward
                    return ValueModel.forward(critic, hidden)
                return critic(hidden)

        return distributed.as_forward(critic, forward)

    def eval_mode(self) -> None:
        """Actor and critic in eval mode (the reference always is)."""
        self.models.actor.eval()
        if self.models.critic is not None:
            self.models.critic.eval()

    def train_mode(self) -> None:
        self.models.actor.train()
        if self.models.critic is not None:
            self.models.critic.train()
