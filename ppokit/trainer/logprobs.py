"""Token log-probabilities and entropies without a full ``[B, T, vocab]`` float32 tensor.

A linear LM head (``nn.Linear``, as transformers' causal LMs have) runs in tiles of
positions × vocabulary (:class:`VocabChunked`): a streaming log-sum-exp forward and a
backward that recomputes each tile's logits, float32 statistics. A tile holds
``TILE_ELEMENTS`` float32 logits (1 MiB), which a core's cache holds, so the passes of the
log-softmax over it run from the cache: on a CPU they, not the head's matrix products, were
most of the update's time with tiles the size of memory. Memory holds one tile's logits
whatever the rows and the vocabulary.

Any other head (a LoRA-wrapped one) goes by chunks of positions: each chunk's logits are
scaled by 1/temperature and log-softmaxed in float32, and only the sampled token's log-prob
and the entropy are kept. With gradients enabled each chunk runs under
``torch.utils.checkpoint``, so backward recomputes the chunk's logits instead of keeping
them alive; a call whose logits fit in one chunk (``CHECKPOINT_MIN_ELEMENTS``) keeps them
instead, which gives the same values without recomputing the LM head.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

__all__ = [
    "VocabChunked",
    "output_head",
    "position_ids",
    "response_hidden",
    "token_logprobs",
    "trunk_hidden",
]

#: Elements of float32 logits one chunk may hold (64 MiB).
CHUNK_ELEMENTS = 1 << 24
#: Elements of float32 logits of one tile of a linear head (:class:`VocabChunked`): 1 MiB,
#: which a core's cache holds, so the log-softmax's passes over it run from the cache, not
#: from memory; at most ``TILE_ROWS`` rows a tile (the rest of it vocabulary).
TILE_ELEMENTS = 1 << 18
TILE_ROWS = 256
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

    A linear head goes by tiles of at most ``min(chunk_elements, TILE_ELEMENTS)`` logits;
    any other through chunks of positions whose float32 logits hold at most
    ``chunk_elements`` elements; with a gradient needed and more than
    ``checkpoint_min_elements`` logit elements in the call, each chunk is checkpointed.
    """
    b, t = targets.shape
    weight = getattr(head, "weight", None)
    vocab = weight.shape[0] if isinstance(weight, Tensor) else 1
    if isinstance(head, nn.Linear):  # tiles of positions × vocabulary
        flat = hidden.reshape(b * t, hidden.shape[-1])
        tile = min(chunk_elements, TILE_ELEMENTS)
        logp, ent = VocabChunked.apply(
            flat, head.weight, head.bias, targets.reshape(-1), temperature, tile, entropy
        )
        return logp.view(b, t), (ent.view(b, t) if entropy else None)
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


def _tile_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None, temperature: float) -> Tensor:
    z = F.linear(hidden, weight, bias).float()
    return z if temperature == 1.0 else z.div_(temperature)


def _tiles(m_rows: int, vocab: int, tile: int) -> tuple[int, int]:
    """(rows, vocabulary columns) of a tile of at most ``tile`` logits, at most
    ``TILE_ROWS`` rows."""
    rows = max(1, min(m_rows, TILE_ROWS, tile))
    return rows, max(1, min(vocab, tile // rows))


def _compute(x: Tensor | None, dtype: torch.dtype | None) -> Tensor | None:
    """``x`` in the autocast ``dtype`` the tiles' products run in (cast once per call, not
    once per tile: the same values autocast would give each product)."""
    return x if x is None or dtype is None or not x.is_floating_point() else x.to(dtype)


class VocabChunked(torch.autograd.Function):
    """log π(target) and the entropy of π = softmax(head(hidden) / temperature) per row of
    ``hidden`` ``[M, H]`` (a linear head ``weight`` ``[V, H]``, ``bias``), computed over
    tiles of at most ``tile`` logits (rows × vocabulary, at most ``TILE_ROWS`` rows): in
    forward a streaming log-sum-exp (running max m, s = Σ e^(z−m), u = Σ e^(z−m)·z;
    lse = m + log s, H = lse − u/s); in backward each tile's logits recomputed, with
    ∂log π(t)/∂z_k = [k = t] − p_k and ∂H/∂z_k = −p_k·(z_k − lse + H). Float32 statistics;
    the matrix products run under the caller's autocast, in forward and backward alike.
    ``entropy`` False: the entropy is not computed (its output is zeros, without
    gradient)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        targets: Tensor,
        temperature: float,
        tile: int,
        entropy: bool = True,
    ) -> tuple[Tensor, Tensor]:
        m_rows, vocab = hidden.shape[0], weight.shape[0]
        rows, cols = _tiles(m_rows, vocab, tile)
        device = hidden.device.type  # backward runs under the same autocast
        amp = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        w, b = _compute(weight, amp), _compute(bias, amp)
        assert w is not None
        logp = hidden.new_empty(m_rows, dtype=torch.float32)
        ent = hidden.new_zeros(m_rows, dtype=torch.float32)
        lse_all = hidden.new_empty(m_rows, dtype=torch.float32)
        for r in range(0, m_rows, rows):  # tiles for memory, not a loop over time steps
            h, tgt = hidden[r : r + rows], targets[r : r + rows]
            run_max = h.new_full((h.shape[0],), -math.inf, dtype=torch.float32)
            s = torch.zeros_like(run_max)
            u = torch.zeros_like(run_max)
            picked = torch.zeros_like(run_max)
            for c in range(0, vocab, cols):
                b_c = None if b is None else b[c : c + cols]
                z = _tile_logits(h, w[c : c + cols], b_c, temperature)
                new_max = torch.maximum(run_max, z.amax(-1))
                scale = torch.exp(run_max - new_max)
                e = (z - new_max[:, None]).exp_()
                s = s * scale + e.sum(-1)
                if entropy:
                    u = u * scale + torch.linalg.vecdot(e, z)
                run_max = new_max
                inside = (tgt >= c) & (tgt < c + z.shape[1])
                local = (tgt - c).clamp(0, z.shape[1] - 1)
                picked = torch.where(inside, z.gather(1, local[:, None])[:, 0], picked)
            lse = run_max + torch.log(s)
            lse_all[r : r + rows] = lse
            logp[r : r + rows] = picked - lse
            if entropy:
                ent[r : r + rows] = lse - u / s
        ctx.save_for_backward(hidden, weight, bias, targets, lse_all, ent)
        ctx.temperature, ctx.tiles, ctx.entropy = temperature, (rows, cols), entropy
        ctx.autocast = (device, amp)
        return logp, ent

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_logp: Tensor, grad_ent: Tensor
    ) -> tuple[Tensor | None, ...]:
        device, dtype = ctx.autocast
        with torch.autocast(device, dtype=dtype, enabled=dtype is not None):
            return VocabChunked._backward(ctx, grad_logp, grad_ent)

    @staticmethod
    def _backward(ctx: Any, grad_logp: Tensor, grad_ent: Tensor) -> tuple[Tensor | None, ...]:
        hidden, weight, bias, targets, lse_all, ent_all = ctx.saved_tensors
        temperature, (rows, cols) = ctx.temperature, ctx.tiles
        amp = ctx.autocast[1]
        vocab = weight.shape[0]
        w, b = _compute(weight, amp), _compute(bias, amp)
        assert w is not None
        grad_h = torch.zeros_like(hidden, dtype=torch.float32)
        grad_w = torch.zeros_like(weight, dtype=torch.float32)
        grad_b = None if bias is None else torch.zeros_like(bias, dtype=torch.float32)
        for r in range(0, hidden.shape[0], rows):
            h, tgt = hidden[r : r + rows], targets[r : r + rows]
            hc = h.to(w.dtype)
            g_lp = grad_logp[r : r + rows].float()[:, None]
            lse = lse_all[r : r + rows][:, None]
            if ctx.entropy:
                g_h = grad_ent[r : r + rows].float()[:, None]
                ent = ent_all[r : r + rows][:, None]
            for c in range(0, vocab, cols):
                b_c = None if b is None else b[c : c + cols]
                z = _tile_logits(h, w[c : c + cols], b_c, temperature)
                p = (z - lse).exp_()
                if ctx.entropy:  # -p·(g_lp + g_h·(z − lse + H)), in z's buffer
                    dz = z.sub_(lse).add_(ent).mul_(g_h).add_(g_lp).mul_(p).neg_()
                else:
                    dz = p.mul_(-g_lp)
                inside = (tgt >= c) & (tgt < c + z.shape[1])
                local = (tgt - c).clamp(0, z.shape[1] - 1)
                dz.scatter_add_(1, local[:, None], torch.where(inside, g_lp[:, 0], 0.0)[:, None])
                if temperature != 1.0:
                    dz.div_(temperature)
                dzc = dz.to(w.dtype)
                grad_h[r : r + rows] += (dzc @ w[c : c + cols]).float()
                grad_w[c : c + cols] += (dzc.t() @ hc).float()
                if grad_b is not None:
                    grad_b[c : c + cols] += dz.sum(0)
        out_b = None if grad_b is None else grad_b.to(bias.dtype)
        return grad_h.to(hidden.dtype), grad_w.to(weight.dtype), out_b, None, None, None, None
