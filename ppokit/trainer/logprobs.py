"""Token log-probabilities and entropies without a full ``[B, T, vocab]`` float32 tensor.

The trunk's hidden states go through the LM head one chunk of positions at a time; each
chunk's logits are scaled by 1/temperature and log-softmaxed in float32, and only the
sampled token's log-prob and the entropy are kept. With gradients enabled each chunk runs
under ``torch.utils.checkpoint``, so backward recomputes the chunk's logits instead of
keeping them alive.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

__all__ = ["position_ids", "response_hidden", "token_logprobs", "trunk_hidden"]

#: Elements of float32 logits one chunk may hold (64 MiB).
CHUNK_ELEMENTS = 1 << 24


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


def token_logprobs(
    hidden: Tensor,
    head: nn.Module,
    targets: Tensor,
    temperature: float = 1.0,
    chunk_elements: int = CHUNK_ELEMENTS,
) -> tuple[Tensor, Tensor]:
    """log π(targets | state) and the entropy of π at each position, float32 ``[B, T]``.

    π = softmax(head(hidden) / temperature), the distribution the rollout samples from.
    """
    b, t = targets.shape
    vocab = head.weight.shape[0] if hasattr(head, "weight") else 1
    step = max(1, chunk_elements // max(1, b * vocab))
    logps, ents = [], []
    grad = torch.is_grad_enabled() and hidden.requires_grad
    for start in range(0, t, step):  # chunks of positions (memory), not time steps
        h = hidden[:, start : start + step]
        y = targets[:, start : start + step]
        if grad:
            lp, en = checkpoint(_chunk_stats, head, h, y, temperature, use_reentrant=False)
        else:
            lp, en = _chunk_stats(head, h, y, temperature)
        logps.append(lp)
        ents.append(en)
    if len(logps) == 1:
        return logps[0], ents[0]
    return torch.cat(logps, 1), torch.cat(ents, 1)
