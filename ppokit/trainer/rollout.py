"""The round's rollout: prompts encoded for the actor, the engine's responses as a
:class:`Rollout`, and the engine's start (:func:`engine_context`)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from ppokit.components.rollout_engine import EngineContext, Generation, Sampling
from ppokit.errors import UserError
from ppokit.trainer.prompts import TextBounds

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from ppokit.spec import DataSpec, ModelSpec, RolloutSpec
    from ppokit.trainer.models import Models

__all__ = [
    "PromptEncoder",
    "Rollout",
    "decode_rows",
    "engine_context",
    "eos_ids",
    "fit_context",
    "sampling",
]


def eos_ids(tokenizer: PreTrainedTokenizerBase, model: nn.Module) -> list[int]:
    """The token ids that end a response (tokenizer EOS plus the model's configured ones)."""
    ids = {tokenizer.eos_token_id}
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(configured, int):
        ids.add(configured)
    elif configured is not None:
        ids.update(configured)
    return sorted(i for i in ids if i is not None)


def engine_context(
    models: Models,
    model_spec: ModelSpec,
    process: int = 0,
    processes: int = 1,
    progress: Callable[[int, int, int], None] | None = None,
    asynchronous: bool = False,
) -> EngineContext:
    """The :class:`EngineContext` a run starts its engine with (``models``: the run's
    :class:`~ppokit.trainer.models.Models`; ``progress``: the decoding steps' listener;
    ``asynchronous``: generation overlaps the update)."""
    from ppokit.trainer.models import autocast

    return EngineContext(
        model=models.actor,
        model_spec=model_spec,
        eos_ids=tuple(eos_ids(models.tokenizer, models.actor)),
        pad_id=int(models.tokenizer.pad_token_id),
        device=models.runtime.device,
        autocast=lambda: autocast(models.runtime),
        process=process,
        processes=processes,
        progress=progress,
        asynchronous=asynchronous,
    )


def sampling(rollout: RolloutSpec, n: int, seed: int | None = None, **changes: Any) -> Sampling:
    """The :class:`Sampling` of the spec's ``rollout`` section for ``n`` responses a prompt
    (``changes``: another length limit, temperature, ``greedy=True``, ...)."""
    settings: dict[str, Any] = dict(
        n=n,
        max_new_tokens=rollout.max_new_tokens,
        temperature=rollout.temperature,
        top_k=rollout.top_k,
        top_p=rollout.top_p,
        seed=seed,
    )
    settings.update(changes)
    return Sampling(**settings)


def fit_context(
    ids: Tensor,
    attn: Tensor,
    limit: int | None,
    max_new: int,
    long_prompts: str,
    room: str = "rollout.max_new_tokens",
) -> tuple[Tensor, Tensor]:
    """Left-padded prompts that leave room for ``max_new`` new tokens in a context of
    ``limit`` tokens (``config.max_position_embeddings``; None: no limit).

    A longer prompt is an error naming its length and the limit (``data.long_prompts:
    error``), or keeps its last tokens (``truncate``, with a warning). ``room`` names what
    sets ``max_new``, for the message. Reads shapes and the attention mask on the host only
    (the prompts are still on the CPU here).
    """
    space = None if limit is None else int(limit) - max_new
    if space is None or ids.shape[1] <= space:
        return ids, attn
    longest = int(attn.sum(dim=1).max())
    if space > 0 and longest <= space:  # only padding is cut
        return ids[:, -space:], attn[:, -space:]
    what = (
        f"a prompt of {longest} tokens plus {max_new} new tokens does not fit the model's "
        f"context of {limit} tokens"
    )
    if space <= 0 or long_prompts == "error":
        raise UserError(
            f"data: {what}: shorten the prompts or {room}, or set data.long_prompts: truncate"
        )
    warnings.warn(f"{what}: its first {longest - space} tokens are cut", stacklevel=2)
    return ids[:, -space:], attn[:, -space:]


class PromptEncoder:
    """Prompt texts to left-padded token ids on the device, with room for the response in
    the actor's context."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, model: nn.Module, device: torch.device
    ) -> None:
        self.tokenizer = tokenizer
        self.limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
        self.device = device
        self.bounds = TextBounds(tokenizer)

    def __call__(
        self,
        prompts: list[str],
        data: DataSpec,
        max_new: int,
        room: str = "rollout.max_new_tokens",
    ) -> tuple[Tensor, Tensor]:
        """(ids, attention mask) ``[P, L]``; ``data`` (a data section) decides the chat
        template (its special tokens are already in the text) and ``long_prompts``;
        ``room``: what sets ``max_new``, for the message. A prompt is cut by characters to
        what the context can hold first (:class:`~ppokit.trainer.prompts.TextBounds`): a
        longer one is never tokenized whole."""
        if self.limit is not None:
            space = max(0, int(self.limit) - max_new)
            prompts = [self.bounds.tail(p, space) for p in prompts]
        enc = self.tokenizer(
            prompts,
            padding=True,
            return_tensors="pt",
            add_special_tokens=not data.chat_template,
        )
        ids, attn = fit_context(
            enc["input_ids"], enc["attention_mask"], self.limit, max_new, data.long_prompts, room
        )
        return ids.to(self.device), attn.to(self.device)


@dataclass
class Rollout:
    """Prompts (each repeated for its responses) and the engine's responses, on the run's
    device. A multi-turn rollout (``rollout.environment``) also records the environment's
    tokens inside each response, the turn rewards at the ends of the model's turns, and
    each episode's number of turns and how it ended. ``version``: the updates before the
    weights that generated each row (docs/async.md)."""

    prompt_ids: Tensor  # [B, P] left-padded
    prompt_mask: Tensor  # [B, P] long
    response_ids: Tensor  # [B, T]
    response_mask: Tensor  # [B, T] bool: the model's tokens
    truncated: Tensor  # [B] bool
    logp_rollout: Tensor | None  # [B, T] float32 log μ (0 where masked); None: greedy
    env_mask: Tensor | None = None  # [B, T] bool: the environment's tokens
    turn_rewards: Tensor | None = None  # [B, T] float32: each turn's reward on its last token
    turns: Tensor | None = None  # [B] long: model turns played
    ended: Tensor | None = None  # [B] long: how the episode ended, an index of ENDS
    version: Tensor | None = None  # [B] long: the version of the weights that generated it

    @classmethod
    def of(cls, prompt_ids: Tensor, prompt_mask: Tensor, n: int, out: Generation) -> Rollout:
        """The rollout of ``out``, generated for these prompts with ``n`` responses each."""
        if n > 1:
            prompt_ids = prompt_ids.repeat_interleave(n, 0)
            prompt_mask = prompt_mask.repeat_interleave(n, 0)
        return cls(
            prompt_ids, prompt_mask, out.response_ids, out.response_mask, out.truncated, out.logp
        )

    @property
    def prompt_len(self) -> int:
        return self.prompt_ids.shape[1]

    @property
    def present(self) -> Tensor:
        """bool [B, T]: the response's tokens, the model's and the environment's."""
        if self.env_mask is None:
            return self.response_mask
        return self.response_mask | self.env_mask

    def inputs(self) -> tuple[Tensor, Tensor]:
        """(input_ids, attention_mask) of prompt + response, ``[B, P+T]``."""
        ids = torch.cat([self.prompt_ids, self.response_ids], 1)
        attn = torch.cat([self.prompt_mask, self.present.long()], 1)
        return ids, attn

    @classmethod
    def cat(cls, parts: list[Rollout], pad_id: int = 0) -> Rollout:
        """The rows of ``parts`` in order, one rollout: prompts left-padded to the longest
        prompt, responses right-padded to the longest response (``pad_id`` at the padding,
        masks False, log μ and rewards 0). Positions count real tokens only, so the padding
        changes no forward pass. An optional field is None when a part has none."""
        if len(parts) == 1:
            return parts[0]
        p = max(part.prompt_len for part in parts)
        t = max(part.response_ids.shape[1] for part in parts)

        def pad(x: Tensor, width: int, value: float, left: bool) -> Tensor:
            room = width - x.shape[1]
            if room == 0:
                return x
            fill = x.new_full((x.shape[0], room), value)
            return torch.cat([fill, x] if left else [x, fill], 1)

        def joined(name: str) -> Tensor | None:
            xs = [getattr(part, name) for part in parts]
            if any(x is None for x in xs):
                return None
            if name in ("prompt_ids", "prompt_mask"):
                return torch.cat(
                    [pad(x, p, pad_id if name == "prompt_ids" else 0, True) for x in xs]
                )
            if xs[0].dim() == 1:
                return torch.cat(xs)
            value = pad_id if name == "response_ids" else 0
            return torch.cat([pad(x, t, value, False) for x in xs])

        return cls._of({f.name: joined(f.name) for f in fields(cls)})

    def cut(self, prompt: int, response: int) -> Rollout:
        """The same rows without the padding beyond ``prompt`` prompt tokens (the last
        columns: prompts are left-padded) and ``response`` response positions (the first:
        responses are right-padded). Positions count real tokens only, so a forward pass
        sees the same sequences."""
        p = self.prompt_len - prompt
        values = {}
        for f in fields(self):
            x = getattr(self, f.name)
            if x is None or x.dim() < 2:
                values[f.name] = x
            elif f.name in ("prompt_ids", "prompt_mask"):
                values[f.name] = x[:, p:]
            else:
                values[f.name] = x[:, :response]
        return Rollout._of(values)

    def rows(self, index: Tensor) -> Rollout:
        """The rows ``index`` of every field."""
        return Rollout._of(
            {
                f.name: None if getattr(self, f.name) is None else getattr(self, f.name)[index]
                for f in fields(self)
            }
        )

    @classmethod
    def _of(cls, values: dict[str, Tensor | None]) -> Rollout:
        """The rollout of every field by name (the required ones are never None here: each
        comes from a rollout that has it)."""
        named: dict[str, Any] = values
        return cls(**named)


def decode_rows(
    tokenizer: PreTrainedTokenizerBase,
    ids: Tensor,
    shown: Tensor,
    counted: Tensor,
    flags: Tensor,
    also: Tensor | None = None,
) -> tuple[list[str], list[int], list[bool], list[str] | None]:
    """(the text of each row's ``shown`` tokens, the number of its ``counted`` positions, its
    bool ``flag``, the text of its ``also`` tokens or None) of token ids ``[B, T]``: the one
    host read of a batch of responses."""
    pad = int(tokenizer.pad_token_id or 0)
    parts = [ids.masked_fill(~shown, pad)]
    if also is not None:
        parts.append(ids.masked_fill(~also, pad))
    packed = torch.cat([*parts, counted.sum(1, keepdim=True), flags.long()[:, None]], 1).cpu()
    width = ids.shape[1]
    texts = tokenizer.batch_decode(packed[:, :width], skip_special_tokens=True)
    more = None
    if also is not None:
        more = tokenizer.batch_decode(packed[:, width : 2 * width], skip_special_tokens=True)
    return texts, packed[:, -2].tolist(), [bool(x) for x in packed[:, -1].tolist()], more
