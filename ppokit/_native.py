"""Fused CPU kernels for the reverse scans, used when they apply; the chunked scan otherwise.

On a CPU the chunked scan of ``_scan.py`` costs several passes over the batch (compaction,
chunk sums, matmuls, expansion), each a separate PyTorch kernel. The C kernels in
``_kernels.c`` do the same recurrences in one pass: rows are split between threads, blocks of
four or eight positions are solved in AVX2 or AVX-512 registers (a scalar loop on other CPUs),
and the recurrence is accumulated in float64 (exact to float32 rounding at any T). Whitening
statistics are gathered in the same pass.

They apply to CPU tensors outside autograd. The extension is built at install time where a C
compiler is available (``setup.py``, optional); without it, with ``PPOKIT_NATIVE=0``, inside
``disabled()``, on other devices and when a gradient is needed, ``_scan.py`` runs its chunked
PyTorch scan. Both are checked against the same per-step reference in the tests.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import torch
from torch import Tensor

try:
    from ppokit import _kernels
except ImportError:  # installed without a C compiler
    _kernels = None

__all__ = [
    "applies",
    "at_most",
    "available",
    "broadcast_rows",
    "disabled",
    "gae",
    "level",
    "next_values",
    "row_sums",
    "scan",
    "whiten_",
]

#: Threads get whole multiples of this many rows.
ROWS_PER_BLOCK = 8
#: Positions per thread below which another thread costs more (waking it) than it saves: the
#: scan does about 20 operations per position, the other kernels (whitening, row sums, fill)
#: a few, so their threshold is higher.
MIN_PER_THREAD = 1 << 16
MIN_PER_THREAD_LIGHT = 1 << 22

_state = {"enabled": os.environ.get("PPOKIT_NATIVE", "1") != "0"}
_pool: dict[int, ThreadPoolExecutor] = {}
if hasattr(os, "register_at_fork"):  # a forked child has none of the parent's threads
    os.register_at_fork(after_in_child=_pool.clear)

Discount = float | Tensor


def available() -> bool:
    """Whether the C kernels were built with this install."""
    return _kernels is not None


@contextmanager
def disabled() -> Iterator[None]:
    """Use the chunked PyTorch scan inside the block (tests, comparisons)."""
    before = _state["enabled"]
    _state["enabled"] = False
    try:
        yield
    finally:
        _state["enabled"] = before


#: The kernels' paths, widest last: what ``level()`` returns and ``at_most`` caps.
LEVELS = ("scalar", "avx2", "avx512")


def level() -> str:
    """The path the kernels take on this CPU: "avx512", "avx2" or "scalar"."""
    return LEVELS[_kernels.level()] if _kernels is not None else "none"


@contextmanager
def at_most(path: str) -> Iterator[None]:
    """Cap the kernels' path inside the block (tests: what other CPUs run)."""
    assert _kernels is not None
    before = _kernels.set_level(LEVELS.index(path))
    try:
        yield
    finally:
        _kernels.set_level(before)


def applies(*tensors: Tensor | float | None) -> bool:
    """True when the kernels compute the result: built, enabled, CPU tensors, no autograd."""
    if _kernels is None or not _state["enabled"]:
        return False
    grad = torch.is_grad_enabled()
    for t in tensors:
        if isinstance(t, Tensor) and (t.device.type != "cpu" or (grad and t.requires_grad)):
            return False
    return True


def _f32(x: Tensor) -> Tensor:
    return x.detach().to(torch.float32).contiguous()


def _per_row(value: Discount | None, rows: int) -> Tensor:
    """A float or a [B] tensor as a contiguous float64 [B] tensor."""
    if isinstance(value, Tensor):
        return value.detach().to(torch.float64).expand(rows).contiguous()
    return torch.full((rows,), 0.0 if value is None else float(value), dtype=torch.float64)


def _mask(mask: Tensor, *tensors: Tensor) -> Tensor:
    """The mask as contiguous bool bytes, after checking that the kernels may read the tensors
    as [B, T] rows of it (they read raw memory: a mismatch must not reach them)."""
    if mask.dim() != 2:
        raise ValueError(f"mask must be [B, T], got shape {tuple(mask.shape)}")
    for x in tensors:
        if x.shape != mask.shape:
            raise ValueError(f"expected shape {tuple(mask.shape)}, got {tuple(x.shape)}")
    return (mask if mask.dtype == torch.bool else mask != 0).contiguous()


def _parallel(
    work: Callable[[int, int], object], rows: int, positions: int, light: bool = False
) -> None:
    """``work(r0, r1)`` over blocks of rows, on up to ``torch.get_num_threads()`` threads."""
    per_thread = MIN_PER_THREAD_LIGHT if light else MIN_PER_THREAD
    threads = max(1, min(torch.get_num_threads(), positions // per_thread, rows // ROWS_PER_BLOCK))
    if threads == 1:
        work(0, rows)
        return
    step = -(-rows // threads)
    step = -(-step // ROWS_PER_BLOCK) * ROWS_PER_BLOCK
    pool = _pool.get(threads)
    if pool is None:
        pool = _pool[threads] = ThreadPoolExecutor(threads, thread_name_prefix="ppokit-scan")
    futures = [pool.submit(work, r0, min(r0 + step, rows)) for r0 in range(0, rows, step)]
    for future in futures:
        future.result()


def _run(
    x: Tensor,
    values: Tensor,
    mask: Tensor,
    p: Discount,
    q: Discount,
    d: Discount,
    head: Tensor | None,
    base: Tensor | None = None,
    *,
    alpha: float = 0.0,
    beta: float = 0.0,
    g: float = 1.0,
    shift: bool = False,
) -> tuple[Tensor, Tensor]:
    """The carry-through recurrence of ``_kernels.c`` with per-row p, q, d, head, base."""
    assert _kernels is not None
    mask = _mask(mask, x, values)
    b, t = mask.shape
    row = torch.stack(
        [_per_row(p, b), _per_row(q, b), _per_row(d, b), _per_row(head, b), _per_row(base, b)],
        dim=1,
    )
    out = torch.empty(b, t, dtype=torch.float32)
    stats = torch.zeros(b, 3, dtype=torch.float64)
    args = (
        x.data_ptr(),
        values.data_ptr(),
        mask.data_ptr(),
        row.data_ptr(),
        float(alpha),
        float(beta),
        float(g),
        shift,
        out.data_ptr(),
        stats.data_ptr(),
        t,
    )
    # the tensors above stay referenced until every block is done
    _parallel(lambda r0, r1: _kernels.scan(*args, r0, r1), b, b * t)
    return out, stats


def scan(
    x: Tensor,
    mask: Tensor,
    discount: Discount,
    init: Tensor | None = None,
    *,
    values: Tensor | None = None,
    baseline: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """y_t = x_t + d * y_next over True positions, y after the last = ``init`` [B] (or 0).

    Returns ``y - values - baseline`` (each when given), 0 at masked positions, float32 [B, T],
    and the per-row [B, 3] float64 sum, sum of squares and count of the result.
    """
    x = _f32(x)
    v = x if values is None else _f32(values)
    beta = 0.0 if values is None else -1.0
    return _run(x, v, mask, 0.0, 1.0, discount, init, baseline, beta=beta)


def gae(
    rewards: Tensor,
    values: Tensor,
    mask: Tensor,
    terminal: Tensor,
    gamma: float,
    lam: Discount,
    *,
    plus_values: bool = False,
) -> tuple[Tensor, Tensor]:
    """A_t = r_t + gamma V_next - V_t + gamma lam A_next over True positions (``_scan.gae``).

    Computed as r_t - V_t + gamma Z_{t+1} with Z the lambda-return recursion
    Z_t = (1 - lam) V_t + lam r_t + gamma lam Z_next, Z after the last = ``terminal``.
    ``lam``: float or [B]. Returns A (or V + A), float32 [B, T], and its [B, 3] statistics.
    """
    if isinstance(lam, Tensor):
        lam = lam.detach().to(torch.float64)
    return _run(
        _f32(rewards),
        _f32(values),
        mask,
        1.0 - lam,
        lam,
        gamma * lam,
        terminal,
        alpha=1.0,
        beta=0.0 if plus_values else -1.0,
        g=gamma,
        shift=True,
    )


def next_values(values: Tensor, mask: Tensor, terminal: Tensor) -> Tensor:
    """V at the next True position of the row (``terminal`` after the last), float32 [B, T]."""
    v = _f32(values)
    return _run(v, v, mask, 1.0, 0.0, 0.0, terminal, shift=True)[0]


def whiten_(y: Tensor, mask: Tensor, stats: Tensor, eps: float = 1e-8) -> Tensor:
    """Batch-whiten ``y`` in place from its per-row statistics: (y - mean) / sqrt(var + eps) at
    True positions, 0 elsewhere; var with Bessel's correction (``_scan.batch_whiten``)."""
    assert _kernels is not None
    mask = _mask(mask, y)
    rows, width = y.shape
    if y.dtype != torch.float32 or not y.is_contiguous() or stats.shape != (rows, 3):
        raise ValueError("whiten_ takes a scan's contiguous float32 result and its statistics")
    stats = stats.to(torch.float64).contiguous()
    addresses = (y.data_ptr(), mask.data_ptr(), stats.data_ptr(), rows, float(eps))
    _parallel(
        lambda r0, r1: _kernels.whiten(*addresses, r0 * width, r1 * width),
        rows,
        y.numel(),
        light=True,
    )
    return y


def row_sums(x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Per row, the sum of ``x`` over True positions (float32 [B], accumulated in float64) and
    the number of True positions (long [B]). Masked entries never matter."""
    assert _kernels is not None
    x, mask = _f32(x), _mask(mask, x)
    b, t = mask.shape
    sums = torch.empty(b, dtype=torch.float64)
    counts = torch.empty(b, dtype=torch.long)
    addresses = (x.data_ptr(), mask.data_ptr(), sums.data_ptr(), counts.data_ptr(), t)
    _parallel(lambda r0, r1: _kernels.rowsum(*addresses, r0, r1), b, b * t, light=True)
    return sums.float(), counts


def broadcast_rows(per_row: Tensor, mask: Tensor) -> Tensor:
    """``per_row`` [B] on every True position of its row, 0 elsewhere, float32 [B, T]."""
    assert _kernels is not None
    mask = _mask(mask)
    b, t = mask.shape
    values = _f32(per_row).expand(b).contiguous()
    out = torch.empty(b, t, dtype=torch.float32)
    addresses = (values.data_ptr(), mask.data_ptr(), out.data_ptr(), t)
    _parallel(lambda r0, r1: _kernels.fill(*addresses, r0, r1), b, b * t, light=True)
    return out
