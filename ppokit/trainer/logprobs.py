"""Token log-probabilities and entropies without a full ``[B, T, vocab]`` float32 tensor.

The trunk's hidden states go through the LM head one chunk of positions at a time; each
chunk's logits are scaled by 1/temperature and log-softmaxed in float32, and only the
sampled token's log-prob and the entropy are kept. With gradients enabled each chunk runs
under ``torch.utils.checkpoint``, so backward recomputes the chunk's logits instead of
keeping them alive; a call whose logits fit in one chunk (``CHECKPOINT_MIN_ELEMENTS``)
keeps them instead, which gives the same values without recomputing the LM head.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

__all__ = [
    "position_ids",
    "response_hidden",
    "sampled_logprobs",
    "token_logprobs",
    "trunk_hidden",
]

#: Elements of float32 logits one chunk may hold (64 MiB).
CHUNK_ELEMENTS = 1 << 24
#: Logit elements of a whole call up to which it is not checkpointed: a call that fits in one
#: chunk keeps its log-softmax and its exp (two float32 tensors of at most a chunk's size)
#: for backward instead of recomputing the LM head.
CHECKPOINT_MIN_ELEMENTS = CHUNK_ELEMENTS


def position_ids(attention_mask: Tensor) -> Tensor:
    """Positions counted over real tokens only (left padding gets position 0)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp_min(0)


def trunk_hidden(trunk: nn.Module, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """Last hidden states ``[B, L, H]`` of a decoder trunk over left-padded sequences."""
    out = trunk(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids(attention_mask),
        use_cache=False,
    )
    return out.last_hidden_state


def response_hidden(hidden: Tensor, prompt_len: int) -> Tensor:
    """``[B, T+1, H]``: the state before each response token t (index P-1+t), then the state
    after the last position (index P+T-1 shifted by one)."""
    return hidden[:, prompt_len - 1 :]


def _chunk_stats(
    head: nn.Module, hidden: Tensor, targets: Tensor, temperature: float
) -> tuple[Tensor, Tensor]:
    logits = head(hidden).float() / temperature
    logsm = F.log_softmax(logits, dim=-1)
    logp = logsm.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logsm.exp() * logsm).sum(-1)
    return logp, entropy


def _chunk_logp(head: nn.Module, hidden: Tensor, targets: Tensor, temperature: float) -> Tensor:
    logsm = F.log_softmax(head(hidden).float() / temperature, dim=-1)
    return logsm.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def _chunked(
    fn: Callable[..., Any],
    hidden: Tensor,
    head: nn.Module,
    targets: Tensor,
    temperature: float,
    chunk_elements: int,
    checkpoint_min_elements: int,
) -> list[Any]:
    """``fn(head, hidden_chunk, targets_chunk, temperature)`` over chunks of positions,
    checkpointed when a gradient is needed and the logits of the call hold more than
    ``checkpoint_min_elements`` elements."""
    b, t = targets.shape
    vocab = head.weight.shape[0] if hasattr(head, "weight") else 1
    step = max(1, chunk_elements // max(1, b * vocab))
    grad = torch.is_grad_enabled() and (
        hidden.requires_grad or any(p.requires_grad for p in head.parameters())
    )
    recompute = grad and b * t * vocab > checkpoint_min_elements
    out = []
    for start in range(0, t, step):  # chunks of positions (memory), not time steps
        h = hidden[:, start : start + step]
        y = targets[:, start : start + step]
        if recompute:  # deterministic: no RNG state to preserve
            out.append(
                checkpoint(
                    fn, head, h, y, temperature, use_reentrant=False, preserve_rng_state=False
                )
            )
        else:
            out.append(fn(head, h, y, temperature))
    return out


def token_logprobs(
    hidden: Tensor,
    head: nn.Module,
    targets: Tensor,
    temperature: float = 1.0,
    chunk_elements: int = CHUNK_ELEMENTS,
    checkpoint_min_elements: int = CHECKPOINT_MIN_ELEMENTS,
) -> tuple[Tensor, Tensor]:
    """log π(targets | state) and the entropy of π at each position, float32 ``[B, T]``.

    π = softmax(head(hidden) / temperature), the distribution the rollout samples from.
    """
    parts = _chunked(
        _chunk_stats, hidden, head, targets, temperature, chunk_elements, checkpoint_min_elements
    )
    if len(parts) == 1:
        return parts[0]
    return torch.cat([p[0] for p in parts], 1), torch.cat([p[1] for p in parts], 1)


def sampled_logprobs(
    hidden: Tensor,
    head: nn.Module,
    targets: Tensor,
    temperature: float = 1.0,
    chunk_elements: int = CHUNK_ELEMENTS,
    checkpoint_min_elements: int = CHECKPOINT_MIN_ELEMENTS,
) -> Tensor:
    """log π(targets | state) alone, float32 ``[B, T]`` (the same values as
    :func:`token_logprobs`), without the entropy's full-vocabulary pass: a reference policy
    needs only this."""
    parts = _chunked(
        _chunk_logp, hidden, head, targets, temperature, chunk_elements, checkpoint_min_elements
    )
    return parts[0] if len(parts) == 1 else torch.cat(parts, 1)
