"""The public toolkit of component authors: the operations the built-ins are made of.

Plugins and built-ins share these, so a plugin written from the docs follows the built-ins'
conventions (docs/design.md):

- reverse discounted scans: :func:`discounted_reverse_cumsum`, :func:`returns_to_go`,
  :func:`gae` (``plus_values=True``: the λ-return), :func:`next_values`;
- whitening: :func:`batch_whiten` (over every True position), :func:`whiten_rows` (a per-row
  value broadcast over the row, computed per row);
- :func:`broadcast_rows` (a per-row value on every True position of its row);
- group statistics: :class:`GroupStats` (empty rows count in no group statistic; a group
  with one non-empty row has baseline 0);
- masking helpers: :func:`bool_mask`, :func:`masked`, and :data:`LOG_RATIO_BOUND`, the bound
  on log-ratios before they are exponentiated.

Every function is vectorised over B and T (no Python loop over time steps or rows) and reads
nothing back to the host. Imports torch and :mod:`ppokit.batch` only.

The scans
---------
One path on every device: the chunked PyTorch scan below, checked against a float64 per-step
reference in the tests.
``discounted_reverse_cumsum(x, mask, d)`` computes, for every row, y_t = x_t + d * y_next over
the masked positions only: y_next is y at the next True position of the same row (masked gaps
are skipped as if absent) and 0 after the row's last True position. Masked positions give 0.

Algorithm (no loop over time steps):

1. Compaction. Each row's True positions are moved to the left with one scatter
   (``cumsum(mask)`` is the 1-based slot of every True position; masked positions go to the
   spare slot 0, which is cleared afterwards). Gaps disappear and the problem becomes
   y_j = x_j + d * y_{j+1} on a dense row, zero-padded on the right (zeros after the row's
   length keep y = 0 there, so no length bookkeeping is needed). The slot index is built
   once per component call and shared by every tensor of that call.
2. Carry. The dense row is cut into chunks of ``CHUNK`` positions. The chunk sums
   S_k = sum_s d^s x_{kC+s} are computed in the accumulation dtype (float64: float32 sums
   would add their rounding errors along the whole row) and form the same recurrence at the
   chunk level, Y_k = S_k + d^C Y_{k+1}, solved by the same function recursively. Y_{k+1}
   (y at the head of chunk k + 1) enters chunk k as d * Y_{k+1} added to its last x.
3. Chunks. Inside a chunk the scan is then one matmul with the upper-triangular matrix of
   discount powers d^(s-t), in the input dtype. In float32 its partial sums must stay small
   for the 1e-6 absolute tolerance: C = 16 keeps it (C = 32 does not, measured).
4. Expansion. One gather puts the results back at the original positions; masked positions
   read the spare slot, which holds 0.

Discount powers are computed in float64 from the discount itself (d^(C*j) directly, never
by dividing by a power or by raising a rounded d^C again), so long rows whose powers underflow
are exact up to float rounding; powers below the smallest normal float32 are flushed to 0
(denormal arithmetic is slow and they change nothing at float32 precision). The carry uses
float64 (float32 on devices without it, such as MPS); results are float32.
"""

from __future__ import annotations

from functools import lru_cache

import torch
from torch import Tensor

from ppokit.batch import RolloutBatch

__all__ = [
    "CHUNK",
    "LOG_RATIO_BOUND",
    "Compaction",
    "GroupStats",
    "accumulate_dtype",
    "batch_whiten",
    "bool_mask",
    "broadcast_rows",
    "dense_reverse_scan",
    "discounted_reverse_cumsum",
    "gae",
    "masked",
    "next_values",
    "returns_to_go",
    "whiten_rows",
]

#: Chunk length of the matmul scan: the largest that keeps float32 within tolerance.
CHUNK = 16
#: Powers below this (the smallest normal float32) are flushed to 0.
_TINY = torch.finfo(torch.float32).tiny
#: GAE forms its TD errors in the carry dtype when gamma * lam is above this (or per row):
#: below it, float32 roundings decay fast enough to stay within float32 precision (tested at
#: T = 32768 in tests/components/test_scan_long.py).
WIDE_TD_ERRORS_ABOVE = 0.95
#: Bound on log-ratios before exponentiation (exp(20) ~ 5e8 stays finite in float32).
LOG_RATIO_BOUND = 20.0


def bool_mask(mask: Tensor) -> Tensor:
    """A bool or 0/1 float mask as bool."""
    return mask if mask.dtype == torch.bool else mask != 0


def masked(x: Tensor, mask: Tensor) -> Tensor:
    """x where mask, else exactly 0 (also blocks NaN/inf and gradients at masked positions)."""
    return torch.where(bool_mask(mask), x, torch.zeros_like(x))


def accumulate_dtype(device: torch.device) -> torch.dtype:
    """float64 for the cross-chunk carry, float32 on MPS (which has no float64)."""
    return torch.float32 if device.type == "mps" else torch.float64


Discount = float | Tensor


def _as_carry(discount: Discount, device: torch.device) -> float | Tensor:
    if isinstance(discount, Tensor):
        return discount.detach().to(device=device, dtype=accumulate_dtype(device))
    return float(discount)


@lru_cache(maxsize=64)
def _scalar_matrices(
    d: float, size: int, device: torch.device, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """The power matrix of a float discount in ``dtype``, and its first column d^s (carry)."""
    weights = _power_matrices(torch.tensor(d, dtype=accumulate_dtype(device), device=device), size)
    return weights.to(dtype), weights[:, 0].contiguous()


def _power_matrices(d: Tensor, size: int) -> Tensor:
    """W[..., s, t] = d^(s - t) for s >= t else 0, of a discount d (scalar or [B]).

    In d's dtype; (x @ W)[t] = sum_{s>=t} d^(s-t) x_s. Powers below the smallest normal
    float32 are 0.
    """
    k = torch.arange(size, device=d.device, dtype=d.dtype)
    diff = k[:, None] - k[None, :]
    weights = torch.pow(d.reshape(*d.shape, 1, 1), diff.clamp_min(0)) * (diff >= 0)
    zero = torch.zeros((), dtype=d.dtype, device=d.device)
    return torch.where(weights >= _TINY, weights, zero)


def dense_reverse_scan(
    x: Tensor,
    discount: Discount,
    chunk: int = CHUNK,
    *,
    overwrite: bool = False,
    wide: Tensor | None = None,
) -> Tensor:
    """y_t = x_t + d * y_{t+1} along the last axis of a dense [B, L] tensor, y_L = 0.

    ``x``: float32 or float64 (the result has x's dtype). ``discount``: a float, or a per-row
    [B] tensor. Chunked matmul scan (see module doc); ``chunk`` >= 2. ``overwrite``: x may be
    used as scratch space (saves a copy when L is a whole number of chunks). ``wide``: the
    same values in the carry dtype, when the caller has them more exactly than ``x`` holds
    them (the carry's chunk sums are then taken from them).
    """
    b, length = x.shape
    d = _as_carry(discount, x.device)
    if length == 0:
        return x.clone()
    size = min(chunk, length)
    n_chunks = -(-length // size)
    padded = n_chunks * size
    if padded != length:
        x = torch.nn.functional.pad(x, (0, padded - length))
    else:
        x = x.contiguous() if overwrite else x.clone(memory_format=torch.contiguous_format)
    x = x.view(b, n_chunks, size)
    if isinstance(d, Tensor):
        weights = _power_matrices(d, size)  # [B, C, C] in the carry dtype
        matrix, first, step = weights.to(x.dtype), weights[:, :, :1], d[:, None]
    else:
        matrix, first = _scalar_matrices(d, size, x.device, x.dtype)
        first, step = first[:, None], d
    if n_chunks > 1:
        # y at the head of chunk k + 1 enters chunk k as d * y_head added to its last x.
        # The chunk sums are recomputed in the carry dtype: float32 sums would add their
        # rounding errors along the whole row.
        carry_dtype = torch.promote_types(x.dtype, accumulate_dtype(x.device))
        if wide is None:
            wide = x.to(carry_dtype)  # contiguous: a strided conversion is several times slower
        else:
            if padded != length:
                wide = torch.nn.functional.pad(wide, (0, padded - length))
            wide = wide.reshape(b, n_chunks, size)
        first = first.to(carry_dtype)
        if first.dim() == 2:
            sums = torch.mv(wide.view(-1, size), first[:, 0]).view(b, n_chunks)
        else:
            sums = torch.bmm(wide, first).view(b, n_chunks)
        heads = dense_reverse_scan(sums[:, 1:], d**size, chunk, overwrite=True)
        x[:, :-1, -1] += (step * heads).to(x.dtype)
    if isinstance(d, Tensor):
        local = torch.bmm(x, matrix)
    else:
        local = (x.view(b * n_chunks, size) @ matrix).view(b, n_chunks, size)
    return local.view(b, padded)[:, :length]


class Compaction:
    """Each row's True positions moved to the left, in order: the index built once per mask.

    ``compact(x)`` is a dense [B, W] tensor (W >= T + 1, whole chunks): slot 0 of every row is
    a spare slot holding 0, slots 1..length(b) hold x at the True positions of row b in their
    order, then zeros. ``expand(y)`` puts a dense result back at the True positions. Masked
    positions point at the spare slot: they write there (cleared afterwards) and read 0 there.
    """

    def __init__(self, mask: Tensor) -> None:
        self.mask = mask
        t = mask.shape[1]
        counts = mask.cumsum(dim=1)
        #: True positions per row, long [B]
        self.lengths = counts[:, -1].clone() if t else counts.sum(dim=1)
        #: slot of each position: 1-based rank among its row's True positions, 0 when masked
        self.slots = torch.where(mask, counts, 0)
        #: width of the compacted rows: T + 1 rounded up to whole chunks (no padding later)
        self.width = -(-(t + 1) // CHUNK) * CHUNK

    def compact(self, x: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
        """x at the True positions, left-aligned after the spare slot, [B, W] in ``dtype``.

        Masked entries of x never matter (they land in the spare slot, which is cleared).
        """
        out = torch.zeros(self.mask.shape[0], self.width, dtype=dtype, device=x.device)
        out.scatter_(1, self.slots, x.to(dtype))
        out[:, 0] = 0
        return out

    def expand(self, y: Tensor) -> Tensor:
        """A dense [B, W] result back at the True positions, 0 elsewhere, float32 [B, T].

        Clears y's spare slot in place (the masked positions read it).
        """
        y[:, 0] = 0
        return y.gather(1, self.slots).float()

    def add_at_last(self, dense: Tensor, value: Tensor) -> Tensor:
        """dense plus ``value`` [B] at each row's last slot (the spare slot for an empty row)."""
        return dense.scatter_add_(1, self.lengths[:, None], value.to(dense.dtype)[:, None])

    def shift(self, dense: Tensor, terminal: Tensor) -> Tensor:
        """The next entry of each compacted row, ``terminal`` [B] after the row's last one."""
        nxt = torch.nn.functional.pad(dense[:, 1:], (0, 1))
        return self.add_at_last(nxt, terminal)

    def whiten(self, dense: Tensor, eps: float = 1e-8) -> Tensor:
        """``batch_whiten`` in compacted space: over slots 1..length of each row.

        ``dense`` must be 0 beyond each row's length (as every scan result is). Returns a new
        [B, W] float32 tensor, ready for ``expand``.
        """
        dense[:, 0] = 0
        return _whiten_flat(dense, self.lengths.sum(), eps)


def _whiten_flat(x: Tensor, n: Tensor, eps: float) -> Tensor:
    """(x - mean) / sqrt(var + eps) with mean and unbiased var of n values summing as x does.

    The sum and the sum of squares accumulate in the carry dtype (float64 but on MPS): in
    float32, sum x^2 - n mean^2 loses every digit of a variance that is small against the
    squared mean. Then one pass to centre and one to scale (in place). Entries outside the n
    values become -mean / sqrt(var + eps): the caller masks or never reads them.
    """
    carry = accumulate_dtype(x.device)
    flat = x.reshape(-1).to(carry)
    total = flat.sum()
    squares = torch.dot(flat, flat)
    n = n.to(carry)
    mean = total / n.clamp_min(1)
    var = ((squares - total * mean) / (n - 1).clamp_min(1)).clamp_min(0)
    centred = x - mean.to(x.dtype)
    return centred.mul_(torch.rsqrt(var + eps).to(x.dtype))


def discounted_reverse_cumsum(x: Tensor, mask: Tensor, discount: Discount) -> Tensor:
    """y_t = x_t + d * y_next over the True positions of each row, float32 [B, T].

    y_next is y at the next True position of the row (0 after the last); masked positions
    give 0 and their x never matters. ``discount``: float in [0, 1] or a per-row [B] tensor.
    """
    rows = Compaction(mask)
    return rows.expand(dense_reverse_scan(rows.compact(x), discount, overwrite=True))


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
    return _whiten_flat(x, maskf.sum(), eps).mul_(maskf)


def whiten_rows(per_row: Tensor, lengths: Tensor, eps: float = 1e-8) -> Tensor:
    """``batch_whiten`` of a per-row constant broadcast over the row, computed per row.

    Row i counts ``lengths[i]`` times. Returns the whitened per-row value, float32 [B].
    """
    carry = accumulate_dtype(per_row.device)
    w = lengths.to(carry)
    n = w.sum()
    # [B]-sized: accumulate in the carry dtype, so equal values give exactly 0
    mean = (w * per_row.to(carry)).sum() / n.clamp_min(1)
    centred = per_row.to(carry) - mean
    var = (w * centred * centred).sum() / (n - 1).clamp_min(1)
    return (centred * torch.rsqrt(var + eps)).float()


def gae(
    batch: RolloutBatch,
    gamma: float,
    lam: Discount,
    *,
    plus_values: bool = False,
    whiten: bool = False,
) -> Tensor:
    """GAE, float32 [B, T]: A_t = delta_t + gamma * lam * A_next over True positions.

    delta_t = r_t + gamma * V(next) - V_t with V(next) the value at the next True position of
    the row (``batch.terminal_values`` after the last). ``lam``: float or per-row [B] tensor.
    ``plus_values``: return V_t + A_t (the lambda-return) instead; ``whiten``: batch-whiten A.
    """
    if batch.values is None:
        raise ValueError("GAE needs batch.values (a critic)")
    rows = Compaction(batch.response_mask)
    discount = gamma * lam
    # Where gamma * lam is near 1 little decays, and float32 roundings of r - V + gamma V'
    # would add up along the whole row: the TD errors are then formed in the carry dtype
    # (compacted in float32, widened exactly); the carry's chunk sums read them.
    wide = isinstance(discount, Tensor) or discount > WIDE_TD_ERRORS_ABOVE
    dtype = accumulate_dtype(batch.device) if wide else torch.float32
    values = rows.compact(batch.values).to(dtype)
    deltas = rows.compact(batch.token_rewards).to(dtype).sub_(values)
    deltas[:, :-1].add_(values[:, 1:], alpha=gamma)
    rows.add_at_last(deltas, gamma * batch.terminal_values)
    x = deltas.float() if wide else deltas
    adv = dense_reverse_scan(x, discount, overwrite=True, wide=deltas if wide else None)
    if plus_values:
        adv.add_(values.float())
    return rows.expand(rows.whiten(adv) if whiten else adv)


def returns_to_go(
    batch: RolloutBatch,
    gamma: float,
    *,
    bootstrap: bool,
    minus_values: bool = False,
    baseline: Tensor | None = None,
    whiten: bool = False,
) -> Tensor:
    """G_t = r_t + gamma * G_next over True positions, float32 [B, T].

    After a row's last True position G is ``batch.terminal_values`` when ``bootstrap``, else 0.
    ``minus_values``: return G_t - V_t; ``baseline`` [B]: subtract a per-row constant;
    ``whiten``: batch-whiten the result. All in the compacted layout, expanded once.
    """
    values = batch.values if minus_values else None
    if minus_values and values is None:
        raise ValueError("G - V needs batch.values (a critic)")
    rows = Compaction(batch.response_mask)
    rewards = rows.compact(batch.token_rewards)
    if bootstrap:
        rows.add_at_last(rewards, gamma * batch.terminal_values)
    returns = dense_reverse_scan(rewards, gamma, overwrite=True)
    if values is not None:
        returns.sub_(rows.compact(values))
    if baseline is not None:
        returns.sub_(baseline.to(returns.dtype)[:, None])
    return rows.expand(rows.whiten(returns) if whiten else returns)


def broadcast_rows(per_row: Tensor, mask: Tensor) -> Tensor:
    """A per-row value [B] on every True position of its row, 0 elsewhere, float32 [B, T]."""
    per_row = per_row.float()[:, None]
    return torch.where(mask, per_row, torch.zeros((), dtype=per_row.dtype, device=mask.device))


class GroupStats:
    """Statistics of a per-row value over each row's group, counting non-empty rows only.

    ``values`` [B] defaults to the scores R = ``batch.scores``. ``weights`` [B] (default: 1 per
    non-empty row) weight the mean; rows without tokens always weigh 0. Groups come from
    ``batch.group_ids`` (each row its own group without them). All results are per row,
    float32 [B]; nothing is read back to the host.
    """

    def __init__(
        self, batch: RolloutBatch, values: Tensor | None = None, weights: Tensor | None = None
    ) -> None:
        self.batch = batch
        self.nonempty = batch.nonempty
        live = self.nonempty.float()
        #: number of non-empty rows in the row's group
        self.count = batch.group_sizes
        self.weights = live if weights is None else weights.float() * live
        self.values = batch.scores if values is None else values.float()

    def centred(self) -> Tensor:
        """x_i - (weighted) mean_g x; x_i itself when the group has one non-empty row.

        The mean is taken of x - max_g x and shifted back, so that a group of equal values
        gives exactly 0 (a rounded mean would leave a residue that a 1/std turns into noise).
        0 on empty rows.
        """
        batch, values = self.batch, self.values
        shift = batch.group_max(torch.where(self.nonempty, values, -torch.inf))
        shift = torch.where(self.count > 0, shift, torch.zeros_like(shift))
        shifted = torch.where(self.nonempty, values - shift, torch.zeros_like(values))
        centred = shifted - batch.group_mean(shifted, weights=self.weights)
        centred = torch.where(self.count > 1, centred, values)
        return torch.where(self.nonempty, centred, torch.zeros_like(centred))

    def std(self) -> Tensor:
        """Unbiased std of x over the group's non-empty rows; 1 with fewer than two."""
        centred = self.centred()
        n = self.count
        var = self.batch.group_sum(centred * centred) / (n - 1).clamp_min(1)
        return torch.where(n > 1, var.sqrt(), torch.ones_like(var))
