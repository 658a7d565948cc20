"""Token log-probabilities and entropies without a full ``[B, T, vocab]`` float32 tensor.

The trunk's hidden states go through the LM head one chunk of positions at a time; each
chunk's logits are scaled by 1/temperature and log-softmaxed in float32, and only the
sampled token's log-prob and the entropy are kept. With gradients enabled each chunk runs
under ``torch.utils.checkpoint``, so backward recomputes the chunk's logits instead of
keeping them alive; a call whose logits fit in one chunk (``CHECKPOINT_MIN_ELEMENTS``)
keeps them instead, which gives the same values without recomputing the LM head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

__all__ = ["output_head", "position_ids", "response_hidden", "token_logprobs", "trunk_hidden"]

#: Elements of float32 logits one chunk may hold (64 MiB).
CHUNK_ELEMENTS = 1 << 24
#: Logit elements of a whole call up to which it is not checkpointed: a call that fits in one
#: chunk keeps its log-softmax and its exp (two float32 tensors of at most a chunk's size)
#: for backward instead of recomputing the LM head.
CHECKPOINT_MIN_ELEMENTS = CHUNK_ELEMENTS


def position_ids(attention_mask: Tensor) -> Tensor:
    """Positions counted over real tokens only (left padding gets position 0)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp_min(0)


def output_head(model: nn.Module) -> nn.Module:
    """A causal LM's output projection (transformers' ``get_output_embeddings()``)."""
    head = getattr(model, "get_output_embeddings")()  # noqa: B009 (nn.Module types no such member)
    assert isinstance(head, nn.Module), "a causal LM without an output projection"
    return head


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
    head: nn.Module, hidden: Tensor, targets: Tensor, temperature: float, entropy: bool
) -> tuple[Tensor, Tensor | None]:
    logsm = F.log_softmax(head(hidden).float() / temperature, dim=-1)
    logp = logsm.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return logp, (-(logsm.exp() * logsm).sum(-1) if entropy else None)


def token_logprobs(
    hidden: Tensor,
    head: nn.Module,
    targets: Tensor,
    temperature: float = 1.0,
    chunk_elements: int = CHUNK_ELEMENTS,
    checkpoint_min_elements: int = CHECKPOINT_MIN_ELEMENTS,
    *,
    entropy: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """log π(targets | state) and the entropy of π at each position, float32 ``[B, T]``.

    π = softmax(head(hidden) / temperature), the distribution the rollout samples from.
    ``entropy=False`` skips the entropy's full-vocabulary pass (a reference policy needs the
    log-probs only; they are the same values) and returns ``(logp, None)``.

    The positions go through the head in chunks whose float32 logits hold at most
    ``chunk_elements`` elements; with a gradient needed and more than
    ``checkpoint_min_elements`` logit elements in the call, each chunk is checkpointed.
    """
    b, t = targets.shape
    weight = getattr(head, "weight", None)
    vocab = weight.shape[0] if isinstance(weight, Tensor) else 1
    step = max(1, chunk_elements // max(1, b * vocab))
    grad = torch.is_grad_enabled() and (
        hidden.requires_grad or any(p.requires_grad for p in head.parameters())
    )
    recompute = grad and b * t * vocab > checkpoint_min_elements
    chunks = []
    for start in range(0, t, step):  # chunks of positions (memory), not time steps
        args = (head, hidden[:, start : start + step], targets[:, start : start + step])
        if recompute:  # deterministic: no RNG state to preserve
            chunks.append(
                checkpoint(
                    _chunk_stats,
                    *args,
                    temperature,
                    entropy,
                    use_reentrant=False,
                    preserve_rng_state=False,
                )
            )
        else:
            chunks.append(_chunk_stats(*args, temperature, entropy))
    if len(chunks) == 1:
        return chunks[0]
    logp = torch.cat([c[0] for c in chunks], 1)
    return logp, (torch.cat([c[1] for c in chunks], 1) if entropy else None)
