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
   once per component call and shared by every tensor of that call, with integer arithmetic
   only (on a CPU several times faster than a ``where`` on the bool mask).
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

Two cases of :func:`gae` need no TD errors: with λ = 1 they telescope, A_t = G_t - V_t with G
the bootstrapped return (:func:`returns_to_go`, which also gives the λ-return G itself), and
the λ-return with γλ = 0 is the one-step target r_t + γ V(next), formed directly (no scan).

Memory. On a CPU, memory a process has not touched yet costs a page fault per 4 KiB page on
first touch, and the allocator gives large freed blocks back to the system: at (256, 4096) a
call's temporaries took 4,000-12,000 page faults, more time than all of its arithmetic (GAE
on one thread: 26 ms with them, 12 ms without). A call therefore carves its temporaries (the
slot index, compacted rows, float64 copies, chunk results) from a per-thread buffer that the
next call reuses, grown to the largest call's need up to ``SCRATCH_BYTES_MAX`` (beyond it they
are allocated normally). Results are always allocated normally; off the CPU (where the
caching allocator reuses memory), under autograd and while compiling, temporaries are plain
allocations.
"""

from __future__ import annotations

import math
import threading
from functools import lru_cache

import torch
from torch import Tensor

from ppokit.batch import RolloutBatch
from ppokit.catalogue import LOG_RATIO_BOUND

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
#: Scratch bytes a thread keeps between calls at most (a (256, 4096) GAE call needs ~45 MiB).
SCRATCH_BYTES_MAX = 256 * 2**20
#: Alignment of the scratch tensors carved from one buffer, in bytes.
_ALIGN = 64


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


# ----------------------------------------------------------------------------- scratch memory
class _Arena(threading.local):
    """Each thread's CPU scratch buffer, kept between calls (see :class:`_Scratch`)."""

    def __init__(self) -> None:
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self.busy = False


_ARENA = _Arena()


class _Scratch:
    """The temporaries of one call of a scan, carved from the thread's buffer on a CPU.

    See "Memory" in the module doc. ``empty`` hands out consecutive pieces of the buffer;
    where it is too small they are allocated normally, and on leaving the call the buffer
    grows to what the call used (up to ``SCRATCH_BYTES_MAX``). Nothing carved outlives the
    call: every result a function returns is allocated normally.

    Inactive (plain allocations) off the CPU, under autograd (a temporary may be saved for
    the backward pass), while compiling, in a nested call, and when built with
    ``enabled=False``.
    """

    def __init__(self, device: torch.device, *inputs: object, enabled: bool = True) -> None:
        self.device = device
        self.used = 0
        grad = torch.is_grad_enabled() and any(
            isinstance(t, Tensor) and t.requires_grad for t in inputs
        )
        self.active = (
            enabled
            and not torch.compiler.is_compiling()  # first: compiled code never reads _ARENA
            and device.type == "cpu"
            and not grad
            and not _ARENA.busy
        )

    def __enter__(self) -> _Scratch:
        if self.active:
            _ARENA.busy = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self.active:
            _ARENA.busy = False
            if _ARENA.buffer.numel() < self.used <= SCRATCH_BYTES_MAX:
                _ARENA.buffer = torch.empty(self.used, dtype=torch.uint8)

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        """An uninitialised contiguous tensor, valid until the call returns."""
        if self.active:
            nbytes = math.prod(shape) * dtype.itemsize
            start = self.used
            self.used += -(-nbytes // _ALIGN) * _ALIGN
            if self.used <= _ARENA.buffer.numel():
                return _ARENA.buffer[start : start + nbytes].view(dtype).view(shape)
        return torch.empty(shape, dtype=dtype, device=self.device)

    def mm(self, a: Tensor, b: Tensor) -> Tensor:
        """a @ b (2-D or batched 3-D), the result a temporary."""
        if not self.active:  # out= does not record autograd
            return a @ b
        out = self.empty((*a.shape[:-1], b.shape[-1]), a.dtype)
        return torch.bmm(a, b, out=out) if a.dim() == 3 else torch.mm(a, b, out=out)


# ----------------------------------------------------------------------------- the scan
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
    float32 are 0. The C powers d^k are computed once and laid out as a Toeplitz matrix.
    """
    k = torch.arange(size, device=d.device, dtype=d.dtype)
    powers = torch.pow(d.reshape(*d.shape, 1), k)  # [..., C]: d^k
    powers = torch.where(powers >= _TINY, powers, torch.zeros((), dtype=d.dtype, device=d.device))
    # padded[j] = d^(j - C + 1) for j >= C - 1, else 0; W[s, t] = padded[s - t + C - 1]
    padded = torch.nn.functional.pad(powers, (size - 1, 0))
    return padded.unfold(-1, size, 1).flip(-1)


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
    scratch = _Scratch(x.device, enabled=False)  # the result is returned: never carved
    return _dense_scan(x, discount, chunk, scratch, overwrite=overwrite, wide=wide)


def _dense_scan(
    x: Tensor,
    discount: Discount,
    chunk: int,
    scratch: _Scratch,
    *,
    overwrite: bool,
    wide: Tensor | None = None,
) -> Tensor:
    """:func:`dense_reverse_scan` with its temporaries (and result) from ``scratch``.

    With a zero float discount the result is x itself when ``overwrite``.
    """
    b, length = x.shape
    d = _as_carry(discount, x.device)
    if length == 0:
        return x.clone()
    if not isinstance(d, Tensor) and d == 0.0:
        return x if overwrite else x.clone(memory_format=torch.contiguous_format)
    size = min(chunk, length)
    n_chunks = -(-length // size)
    padded = n_chunks * size
    if padded != length:
        x = torch.nn.functional.pad(x, (0, padded - length))
        if wide is not None:
            wide = torch.nn.functional.pad(wide, (0, padded - length))
    elif not overwrite or not x.is_contiguous():
        x = scratch.empty((b, padded), x.dtype).copy_(x)
    chunks = x.view(b, n_chunks, size)
    step: Tensor | float  # d for the next chunk's head: [B, 1] or one number
    if isinstance(d, Tensor):
        weights = _power_matrices(d, size)  # [B, C, C] in the carry dtype
        matrix, first, step = weights.to(x.dtype), weights[:, :, :1], d[:, None]
    else:
        matrix, first = _scalar_matrices(d, size, x.device, x.dtype)
        step = d
    if n_chunks > 1:
        # y at the head of chunk k + 1 enters chunk k as d * y_head added to its last x.
        # The chunk sums are recomputed in the carry dtype: float32 sums would add their
        # rounding errors along the whole row.
        carry_dtype = torch.promote_types(x.dtype, accumulate_dtype(x.device))
        if wide is None:
            wide = x
            if x.dtype != carry_dtype:  # contiguous: a strided conversion is several times slower
                wide = scratch.empty(x.shape, carry_dtype).copy_(x)
        sums = _chunk_sums(wide.reshape(b, n_chunks, size), first.to(carry_dtype), scratch)
        heads = _dense_scan(sums[:, 1:], d**size, chunk, scratch, overwrite=True)
        chunks[:, :-1, -1] += (step * heads).to(x.dtype)
    if isinstance(d, Tensor):
        local = scratch.mm(chunks, matrix)
    else:
        local = scratch.mm(x.view(b * n_chunks, size), matrix)
    return local.view(b, padded)[:, :length]


def _chunk_sums(chunks: Tensor, first: Tensor, scratch: _Scratch) -> Tensor:
    """sum_s first[s] * chunks[b, k, s], [B, K]; ``first`` is [C] or per row [B, C, 1]."""
    b, n_chunks, size = chunks.shape
    if first.dim() == 1:
        return torch.mv(chunks.reshape(-1, size), first).view(b, n_chunks)
    # a product and a sum: several times faster than a bmm with one column
    weights = first.view(b, 1, size)
    if not scratch.active:
        return (chunks * weights).sum(dim=-1)
    return torch.mul(chunks, weights, out=scratch.empty(chunks.shape, chunks.dtype)).sum(dim=-1)


class Compaction:
    """Each row's True positions moved to the left, in order: the index built once per mask.

    ``compact(x)`` is a dense [B, W] tensor (W >= T + 1, whole chunks): slot 0 of every row is
    a spare slot holding 0, slots 1..length(b) hold x at the True positions of row b in their
    order, then zeros. ``expand(y)`` puts a dense result back at the True positions. Masked
    positions point at the spare slot: they write there (cleared afterwards) and read 0 there.
    ``scratch`` (internal): the calling scan's temporaries, which the index and compacted
    tensors then live in.
    """

    def __init__(self, mask: Tensor, *, scratch: _Scratch | None = None) -> None:
        self.mask = mask
        self._scratch = scratch or _Scratch(mask.device, enabled=False)
        b, t = mask.shape
        # integer arithmetic only: cumsum and a bitwise and of int64 tensors are several
        # times faster on a CPU than a where() or a product with the bool mask
        ones = self._scratch.empty((b, t), torch.int64).copy_(mask)
        counts = torch.cumsum(ones, dim=1, out=self._scratch.empty((b, t), torch.int64))
        #: True positions per row, long [B]
        self.lengths = counts[:, -1].clone() if t else counts.sum(dim=1)
        #: slot of each position: 1-based rank among its row's True positions, 0 when masked
        self.slots = counts.bitwise_and_(ones.neg_())
        #: width of the compacted rows: T + 1 rounded up to whole chunks (no padding later)
        self.width = -(-(t + 1) // CHUNK) * CHUNK

    def compact(self, x: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
        """x at the True positions, left-aligned after the spare slot, [B, W] in ``dtype``.

        Masked entries of x never matter (they land in the spare slot, which is cleared).
        """
        out = self._scratch.empty((self.mask.shape[0], self.width), dtype).zero_()
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
        mean, scale = _whiten_stats(dense, self.lengths.sum(), eps, self._scratch)
        return (dense - mean.to(dense.dtype)).mul_(scale.to(dense.dtype))

    def _whiten_(self, dense: Tensor, eps: float = 1e-8) -> Tensor:
        """:meth:`whiten` in place (the same values)."""
        dense[:, 0] = 0
        mean, scale = _whiten_stats(dense, self.lengths.sum(), eps, self._scratch)
        return dense.sub_(mean.to(dense.dtype)).mul_(scale.to(dense.dtype))


def _whiten_stats(x: Tensor, n: Tensor, eps: float, scratch: _Scratch) -> tuple[Tensor, Tensor]:
    """mean and 1 / sqrt(var + eps) of n values summing as x does (mean and unbiased var).

    The sum and the sum of squares accumulate in the carry dtype (float64 but on MPS): in
    float32, sum x^2 - n mean^2 loses every digit of a variance that is small against the
    squared mean. Entries outside the n values must be 0.
    """
    carry = accumulate_dtype(x.device)
    flat = x.reshape(-1)
    if flat.dtype != carry:
        flat = scratch.empty(flat.shape, carry).copy_(flat)
    total = flat.sum()
    squares = torch.dot(flat, flat)
    n = n.to(carry)
    mean = total / n.clamp_min(1)
    var = ((squares - total * mean) / (n - 1).clamp_min(1)).clamp_min(0)
    return mean, torch.rsqrt(var + eps)


def _whiten_flat(x: Tensor, n: Tensor, eps: float) -> Tensor:
    """(x - mean) / sqrt(var + eps) with the statistics of :func:`_whiten_stats`, a new tensor.

    Then one pass to centre and one to scale (in place). Entries outside the n values become
    -mean / sqrt(var + eps): the caller masks or never reads them.
    """
    mean, scale = _whiten_stats(x, n, eps, _Scratch(x.device, enabled=False))
    return (x - mean.to(x.dtype)).mul_(scale.to(x.dtype))


def discounted_reverse_cumsum(x: Tensor, mask: Tensor, discount: Discount) -> Tensor:
    """y_t = x_t + d * y_next over the True positions of each row, float32 [B, T].

    y_next is y at the next True position of the row (0 after the last); masked positions
    give 0 and their x never matters. ``discount``: float in [0, 1] or a per-row [B] tensor.
    """
    with _Scratch(mask.device, x, discount) as scratch:
        rows = Compaction(mask, scratch=scratch)
        dense = _dense_scan(rows.compact(x), discount, CHUNK, scratch, overwrite=True)
        return rows.expand(dense)


def next_values(values: Tensor, mask: Tensor, terminal: Tensor) -> Tensor:
    """V(next state) for every True position, float32 [B, T] (0 at masked positions).

    The next state of a True position is the next True position of its row; after the row's
    last True position it is ``terminal`` [B].
    """
    with _Scratch(mask.device, values, terminal) as scratch:
        rows = Compaction(mask, scratch=scratch)
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
    per_row = isinstance(lam, Tensor)
    if not per_row and lam == 1.0:
        # the TD errors telescope: A_t = G_t - V_t, G the bootstrapped return (no TD error
        # is formed, so none of their roundings add up along the row)
        return returns_to_go(
            batch, gamma, bootstrap=True, minus_values=not plus_values, whiten=whiten
        )
    mask, terminal = batch.response_mask, batch.terminal_values
    inputs = (batch.token_rewards, batch.values, terminal, lam)
    with _Scratch(mask.device, *inputs) as scratch:
        rows = Compaction(mask, scratch=scratch)
        discount = gamma * lam
        values = rows.compact(batch.values)
        x = rows.compact(batch.token_rewards)
        if plus_values and not per_row and discount == 0.0:
            # the one-step target r + gamma * V(next) itself, not V + (r + gamma V(next) - V)
            x[:, :-1].add_(values[:, 1:], alpha=gamma)
            rows.add_at_last(x, gamma * terminal)
            return rows.expand(rows._whiten_(x) if whiten else x)
        # Where gamma * lam is near 1 little decays, and float32 roundings of r - V + gamma V'
        # would add up along the whole row: the TD errors are then formed in the carry dtype
        # (compacted in float32, widened exactly); the carry's chunk sums read them.
        deltas = x
        if per_row or discount > WIDE_TD_ERRORS_ABOVE:
            carry = accumulate_dtype(mask.device)
            wide_values = scratch.empty(values.shape, carry).copy_(values)
            deltas = scratch.empty(x.shape, carry).copy_(x).sub_(wide_values)
            values_next = wide_values[:, 1:]
        else:
            deltas.sub_(values)
            values_next = values[:, 1:]
        deltas[:, :-1].add_(values_next, alpha=gamma)
        rows.add_at_last(deltas, gamma * terminal)
        if deltas is not x:
            x.copy_(deltas)
        adv = _dense_scan(
            x, discount, CHUNK, scratch, overwrite=True, wide=None if deltas is x else deltas
        )
        if plus_values:
            adv.add_(values)
        return rows.expand(rows._whiten_(adv) if whiten else adv)


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
    mask = batch.response_mask
    inputs = (batch.token_rewards, values, baseline, batch.bootstrap_values)
    with _Scratch(mask.device, *inputs) as scratch:
        rows = Compaction(mask, scratch=scratch)
        rewards = rows.compact(batch.token_rewards)
        if bootstrap:
            rows.add_at_last(rewards, gamma * batch.terminal_values)
        returns = _dense_scan(rewards, gamma, CHUNK, scratch, overwrite=True)
        if values is not None:
            returns.sub_(rows.compact(values))
        if baseline is not None:
            returns.sub_(baseline.to(returns.dtype)[:, None])
        return rows.expand(rows._whiten_(returns) if whiten else returns)


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
