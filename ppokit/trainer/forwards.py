"""The trainer's forward passes over a :class:`~ppokit.trainer.rollout.Rollout`: the actor's
log-probs, entropy and hidden states, the reference policy's log-probs and the value head's
output. The trunk and the LM head run apart (the head in chunks); on several processes each
runs as the sharded model's forward (:func:`ppokit.distributed.as_forward`).

With a token budget (``train.micro_batch_tokens``) the LM head runs on the response's tokens
only, not on its padding; with ``train.pack_sequences`` the trunk runs on the rows' tokens
packed into one row, positions restarting at each sequence and no attention mask, which
transformers turns into a block-diagonal causal mask (the KV cache off: with it, packed rows
would attend across sequences)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ppokit import distributed
from ppokit.errors import UserError
from ppokit.trainer.logprobs import (
    output_head,
    position_ids,
    response_hidden,
    token_logprobs,
    trunk_hidden,
)
from ppokit.trainer.models import Models, ValueModel, autocast, trunk_of
from ppokit.trainer.rollout import Rollout

__all__ = ["Forwards", "packed_states"]


def packed_states(trunk: nn.Module, ro: Rollout) -> Tensor:
    """``[B, T+1, H]`` as :func:`~ppokit.trainer.logprobs.response_hidden` of the padded
    rows gives it, from one forward of ``trunk`` over every row's real tokens packed into
    one row (positions restarting at each sequence, no attention mask, no KV cache). A
    position past a row's last token reads the state after it (masked everywhere)."""
    ids, attn = ro.inputs()
    keep = attn.bool()
    out = trunk(
        input_ids=ids[keep][None],
        position_ids=position_ids(attn)[keep][None],
        attention_mask=None,
        use_cache=False,
    )
    hidden = out.last_hidden_state[0]  # [N, H]
    prompt, present = ro.prompt_mask.sum(1), ro.present.sum(1)
    lengths = prompt + present
    start = lengths.cumsum(0) - lengths  # each sequence's first token in the packed row
    t = torch.arange(ro.response_ids.shape[1] + 1, device=ids.device)
    index = (start + prompt - 1)[:, None] + torch.minimum(t[None, :], present[:, None])
    return hidden[index]


class Forwards:
    """The forward passes of a run's ``models`` at sampling ``temperature``; ``tokens``:
    the LM head on the response's tokens only (micro-batches by a token budget); ``pack``:
    the trunk over the rows packed into one row."""

    def __init__(
        self, models: Models, temperature: float, tokens: bool = False, pack: bool = False
    ) -> None:
        self.models = models
        self.temperature = temperature
        self.tokens = tokens
        self.pack = pack

    def _states(self, trunk: nn.Module, ro: Rollout) -> Tensor:
        """The trunk's states ``[B, T+1, H]`` of the responses, padded or packed."""
        with autocast(self.models.runtime):
            if self.pack:
                return packed_states(trunk, ro)
            ids, attn = ro.inputs()
            return response_hidden(trunk_hidden(trunk, ids, attn), ro.prompt_len)

    def _hidden(self, model: nn.Module, ro: Rollout) -> Tensor:
        return self._states(trunk_of(model), ro)

    def hidden(self, model: nn.Module, ro: Rollout) -> Tensor:
        """The trunk's hidden states ``[B, T+1, H]`` of the responses (no LM head)."""
        return distributed.as_forward(model, lambda: self._hidden(model, ro))

    def _forward(
        self, model: nn.Module, ro: Rollout, entropy: bool
    ) -> tuple[Tensor, Tensor | None, Tensor]:
        """(log π [B,T], entropy [B,T] or None, hidden states [B,T+1,H]) of ``model``."""

        def forward() -> tuple[Tensor, Tensor | None, Tensor]:
            hidden = self._hidden(model, ro)
            states, targets = hidden[:, :-1], ro.response_ids
            if self.tokens:  # the response's tokens only, as one row
                mask = ro.response_mask
                states, targets = states[mask][None], targets[mask][None]
            with autocast(self.models.runtime):
                logp, ent = token_logprobs(
                    states, output_head(model), targets, self.temperature, entropy=entropy
                )
            if self.tokens:  # back to [B, T], 0 off the response
                logp = _placed(logp[0], mask)
                ent = None if ent is None else _placed(ent[0], mask)
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
            hidden = self._states(trunk, ro)
            with autocast(self.models.runtime):
                if distributed.sharded(critic):  # this function is the critic's forward
                    return ValueModel.forward(critic, hidden)
                return critic(hidden)

        return distributed.as_forward(critic, forward)

    def check_packing(self) -> None:
        """With ``pack``: refuse (one line) an actor whose attention does not keep packed
        sequences apart (its architecture ignores restarting positions), from a probe of two
        short sequences, packed against padded."""
        if not self.pack:
            return
        device = self.models.runtime.device
        vocab = int(getattr(self.models.actor.config, "vocab_size", 8))
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(1, max(2, min(vocab, 64)), (2, 6), generator=g).to(device)
        prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1]], device=device)
        mask = torch.tensor([[True, True, True], [True, True, False]], device=device)
        probe = Rollout(ids[:, :3], prompt_mask, ids[:, 3:], mask, ~mask[:, -1], None)
        padded = Forwards(self.models, self.temperature)
        with torch.no_grad():
            want = padded.hidden(self.models.actor, probe).float()
            got = self.hidden(self.models.actor, probe).float()
        keep = torch.cat([mask, mask[:, -1:]], 1)  # the states before each token and after
        gap = ((got - want)[keep].norm() / want[keep].norm().clamp_min(1e-30)).item()
        if not gap < 1e-2:
            raise UserError(
                "train.pack_sequences: this model's attention does not keep packed sequences "
                f"apart (packed and padded states differ by {gap:.2g}, relative); set it to "
                "false"
            )

    def eval_mode(self) -> None:
        """Actor and critic in eval mode (the reference always is)."""
        self.models.actor.eval()
        if self.models.critic is not None:
            self.models.critic.eval()

    def train_mode(self) -> None:
        self.models.actor.train()
        if self.models.critic is not None:
            self.models.critic.train()


def _placed(values: Tensor, mask: Tensor) -> Tensor:
    """``[B, T]``: ``values`` at the True positions of ``mask`` (row by row), 0 elsewhere;
    differentiable in ``values``."""
    out = values.new_zeros(mask.shape)
    return out.masked_scatter(mask, values)
