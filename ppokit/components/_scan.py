"""The vectorised reverse discounted scan behind every return, GAE and reward-to-go.

``discounted_reverse_cumsum(x, mask, d)`` computes, for every row, y_t = x_t + d * y_next over
the masked positions only: y_next is y at the next True position of the same row (masked gaps
are skipped as if absent) and 0 after the row's last True position. Masked positions give 0.

Algorithm (no loop over time steps):

1. Compaction. Each row's True positions are moved to the left with one scatter
   (``cumsum(mask)`` is the 1-based slot of every True position). Gaps disappear and the
   problem becomes y_j = x_j + d * y_{j+1} on a dense row, zero-padded on the right (zeros
   after the row's length keep y = 0 there, so no length bookkeeping is needed).
2. Chunks. The dense row is cut into chunks of ``CHUNK`` positions. Inside a chunk the scan
   is one batched matmul with the upper-triangular matrix of discount powers d^(s-t).
3. Carry. The chunk heads y_local[chunk k, 0] form the same recurrence at the chunk level
   with discount d^CHUNK, solved by the same function recursively (a second level suffices
   up to CHUNK^2 positions, a third up to CHUNK^3). The carry into chunk k, y at the first
   position of chunk k+1, enters position t of chunk k with the factor d^(CHUNK - t).
4. Expansion. One gather puts the results back at the original positions.

Discount powers are computed in float64 from the discount itself (d^(C*j) directly, never
by dividing by a power or by raising a rounded d^C again), so long rows whose powers underflow
are exact up to float rounding. Sums accumulate in float64 (float32 on devices without it,
such as MPS); results are float32.
"""

from __future__ import annotations

from functools import lru_cache

import torch
from torch import Tensor

from ppokit.batch import RolloutBatch

__all__ = [
    "CHUNK",
    "Compaction",
    "accumulate_dtype",
    "batch_whiten",
    "broadcast_rows",
    "dense_reverse_scan",
    "discounted_reverse_cumsum",
    "gae",
    "next_values",
    "returns_to_go",
]

#: Chunk length of the matmul scan (measured fastest on a 2-core CPU among 32, 64, 128).
CHUNK = 32


def accumulate_dtype(device: torch.device) -> torch.dtype:
    """float64 (float32 sums over 32k positions miss the 1e-5 tolerance), float32 on MPS."""
    return torch.float32 if device.type == "mps" else torch.float64


Discount = float | Tensor


def _as_float64(discount: Discount, device: torch.device) -> float | Tensor:
    if isinstance(discount, Tensor):
        return discount.detach().to(device=device, dtype=torch.float64)
    return float(discount)


@lru_cache(maxsize=64)
def _scalar_matrices(d: float, size: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Lower-triangular powers W[s, t] = d^(s - t) (s >= t) and tail[t] = d^(size - t)."""
    return _power_matrices(torch.tensor(d, dtype=torch.float64, device=device), size)


def _power_matrices(d: Tensor, size: int) -> tuple[Tensor, Tensor]:
    """Powers of a float64 discount d (scalar or [B]).

    W[..., s, t] = d^(s - t) for s >= t else 0, so that (x @ W)[t] = sum_{s>=t} d^(s-t) x_s;
    tail[..., t] = d^(size - t), the factor of the carry entering position t.
    """
    k = torch.arange(size, device=d.device, dtype=torch.float64)
    diff = k[:, None] - k[None, :]
    base = d.reshape(*d.shape, 1, 1)
    weights = torch.pow(base, diff.clamp_min(0)) * (diff >= 0)
    tail = torch.pow(d.reshape(*d.shape, 1), size - k)
    return weights, tail


def dense_reverse_scan(x: Tensor, discount: Discount, chunk: int = CHUNK) -> Tensor:
    """y_t = x_t + d * y_{t+1} along the last axis of a dense [B, L] tensor, y_L = 0.

    ``discount``: a float, or a per-row [B] tensor. Chunked matmul scan (see module doc);
    ``chunk`` >= 2.
    """
    b, length = x.shape
    d = _as_float64(discount, x.device)
    if length == 0:
        return x.clone()
    size = min(chunk, length)
    n_chunks = -(-length // size)
    padded = n_chunks * size
    if padded != length:
        x = torch.nn.functional.pad(x, (0, padded - length))
    if isinstance(d, Tensor):
        weights, tail = (m.to(x.dtype) for m in _power_matrices(d, size))  # [B,C,C], [B,C]
        local = torch.bmm(x.view(b, n_chunks, size), weights)
        tail = tail[:, None, :]
    else:
        weights, tail = (m.to(x.dtype) for m in _scalar_matrices(d, size, x.device))
        local = (x.view(b * n_chunks, size) @ weights).view(b, n_chunks, size)
    if n_chunks > 1:
        heads = dense_reverse_scan(local[:, :, 0].contiguous(), d**size, chunk)
        carry = torch.nn.functional.pad(heads[:, 1:], (0, 1))
        local = torch.addcmul(local, carry[:, :, None], tail)
    return local.view(b, padded)[:, :length]


class Compaction:
    """Each row's True positions moved to the left, in order: the index built once per mask.

    ``compact(x)`` is a dense [B, W] tensor (W >= T + 1, whole chunks): slot 0 of every row is a spare slot, slots
    1..length(b) hold x at the True positions of row b in their order, then zeros.
    ``expand(y)`` puts a dense result back at the True positions. The spare slot keeps empty
    rows and masked positions free of special cases: a masked position points at the slot of
    the row's previous True position (or the spare slot) and only ever adds 0 there.
    """

    def __init__(self, mask: Tensor) -> None:
        self.mask = mask
        counts = mask.cumsum(dim=1, dtype=torch.int32)
        self.lengths = counts[:, -1].long() if mask.shape[1] else counts.sum(dim=1).long()
        #: 1-based slot of each True position among its row's True positions
        self.slots = counts.long()
        #: width of the compacted rows: T + 1 rounded up to whole chunks (no padding later)
        self.width = -(-(mask.shape[1] + 1) // CHUNK) * CHUNK

    def compact(self, x: Tensor) -> Tensor:
        """x at the True positions, left-aligned after the spare slot, [B, W].

        In the accumulation dtype; masked entries of x never matter.
        """
        dtype = accumulate_dtype(x.device)
        zero = torch.zeros((), dtype=dtype, device=x.device)
        src = torch.where(self.mask, x.to(dtype), zero)
        out = torch.zeros(self.mask.shape[0], self.width, dtype=dtype, device=x.device)
        return out.scatter_add_(1, self.slots, src)

    def expand(self, y: Tensor) -> Tensor:
        """A dense [B, W] result back at the True positions, 0 elsewhere, float32 [B, T]."""
        out = y.float().gather(1, self.slots)
        return torch.where(self.mask, out, torch.zeros((), dtype=out.dtype, device=out.device))

    def add_at_last(self, dense: Tensor, value: Tensor) -> Tensor:
        """dense plus ``value`` [B] at each row's last slot (the spare slot for an empty row)."""
        return dense.scatter_add(1, self.lengths[:, None], value.to(dense.dtype)[:, None])

    def shift(self, dense: Tensor, terminal: Tensor) -> Tensor:
        """The next entry of each compacted row, ``terminal`` [B] after the row's last one."""
        nxt = torch.nn.functional.pad(dense[:, 1:], (0, 1))
        return self.add_at_last(nxt, terminal)


def discounted_reverse_cumsum(x: Tensor, mask: Tensor, discount: Discount) -> Tensor:
    """y_t = x_t + d * y_next over the True positions of each row, float32 [B, T].

    y_next is y at the next True position of the row (0 after the last); masked positions
    give 0 and their x never matters. ``discount``: float in [0, 1] or a per-row [B] tensor.
    """
    rows = Compaction(mask)
    return rows.expand(dense_reverse_scan(rows.compact(x), discount))


def next_values(values: Tensor, mask: Tensor, terminal: Tensor) -> Tensor:
    """V(next state) for every True position, float32 [B, T] (0 at masked positions).

    The next state of a True position is the next True position of its row; after the row's
    last True position it is ``terminal`` [B].
    """
    rows = Compaction(mask)
    return rows.expand(rows.shift(rows.compact(values), terminal))


def batch_whiten(x: Tensor, maskf: Tensor, eps: float = 1e-8) -> Tensor:
    """(x - mean) / sqrt(var + eps) over all True positions of the batch, times the mask.

    ``x``: float32 [B, T], finite and 0 at masked positions (as every estimate here is);
    ``maskf``: the response mask as float32. var uses Bessel's correction (0 with fewer than
    two positions). Returns float32 [B, T].
    """
    flat_mask = maskf.reshape(-1)
    n = flat_mask.sum()
    mean = x.sum() / n.clamp_min(1)
    centred = (x - mean).mul_(maskf)
    flat = centred.reshape(-1)
    var = torch.dot(flat, flat) / (n - 1).clamp_min(1)
    return centred.mul_(torch.rsqrt(var + eps))


def gae(batch: RolloutBatch, gamma: float, lam: Discount, *, plus_values: bool = False) -> Tensor:
    """Unwhitened GAE, float32 [B, T]: A_t = delta_t + gamma * lam * A_next over True positions.

    delta_t = r_t + gamma * V(next) - V_t with V(next) the value at the next True position of
    the row (``batch.terminal_values`` after the last). ``lam``: float or per-row [B] tensor.
    ``plus_values``: return V_t + A_t (the lambda-return) instead.
    """
    if batch.values is None:
        raise ValueError("GAE needs batch.values (a critic)")
    rows = Compaction(batch.response_mask)
    values = rows.compact(batch.values)
    deltas = rows.shift(values, batch.terminal_values).mul_(gamma)
    deltas.add_(rows.compact(batch.token_rewards)).sub_(values)
    adv = dense_reverse_scan(deltas, gamma * lam)
    return rows.expand(adv.add_(values) if plus_values else adv)


def returns_to_go(batch: RolloutBatch, gamma: float, *, bootstrap: bool) -> Tensor:
    """G_t = r_t + gamma * G_next over True positions, float32 [B, T].

    After a row's last True position G is ``batch.terminal_values`` when ``bootstrap``, else 0.
    """
    rows = Compaction(batch.response_mask)
    rewards = rows.compact(batch.token_rewards)
    if bootstrap:
        rewards = rows.add_at_last(rewards, gamma * batch.terminal_values.double())
    return rows.expand(dense_reverse_scan(rewards, gamma))


def broadcast_rows(per_row: Tensor, mask: Tensor) -> Tensor:
    """A per-row value [B] on every True position of its row, 0 elsewhere, float32 [B, T]."""
    per_row = per_row.float()[:, None]
    return torch.where(mask, per_row, torch.zeros((), dtype=per_row.dtype, device=mask.device))
