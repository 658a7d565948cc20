"""Per-step float64 loop implementations of the estimator formulas, the tests' ground truth.

Each walks every row from its last position to its first, skipping masked positions, exactly
as the formulas are written; slow but obviously correct.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ppokit.batch import RolloutBatch


def _discounts(discount: float | Tensor, b: int) -> Tensor:
    if isinstance(discount, Tensor):
        return discount.double().cpu()
    return torch.full((b,), float(discount), dtype=torch.float64)


def reverse_scan(x: Tensor, mask: Tensor, discount: float | Tensor) -> Tensor:
    """y_t = x_t + d * y_next over True positions (next True position of the row), float64."""
    x = x.double().cpu()
    mask = mask.cpu()
    b, t = x.shape
    d = _discounts(discount, b)
    y = torch.zeros(b, t, dtype=torch.float64)
    for i in range(b):
        acc = 0.0
        di = float(d[i])
        for s in range(t - 1, -1, -1):
            if mask[i, s]:
                acc = float(x[i, s]) + di * acc
                y[i, s] = acc
    return y


def next_values(values: Tensor, mask: Tensor, terminal: Tensor) -> Tensor:
    """Value at the next True position of the row, terminal after the last, float64."""
    v = values.double().cpu()
    mask = mask.cpu()
    b, t = v.shape
    out = torch.zeros(b, t, dtype=torch.float64)
    for i in range(b):
        nxt = float(terminal[i])
        for s in range(t - 1, -1, -1):
            if mask[i, s]:
                out[i, s] = nxt
                nxt = float(v[i, s])
    return out


def _masked(batch: RolloutBatch, x: Tensor | None) -> Tensor:
    assert x is not None
    return torch.where(batch.response_mask, x.double(), torch.zeros((), dtype=torch.float64))


def gae(batch: RolloutBatch, gamma: float, lam: float | Tensor) -> Tensor:
    """Unwhitened GAE with a loop over time: A_t = delta_t + gamma * lam * A_next."""
    mask = batch.response_mask
    r, v = _masked(batch, batch.token_rewards), _masked(batch, batch.values)
    b, t = mask.shape
    lams = _discounts(lam, b)
    term = batch.terminal_values.double()
    out = torch.zeros(b, t, dtype=torch.float64)
    for i in range(b):
        v_next, a_next = float(term[i]), 0.0
        for s in range(t - 1, -1, -1):
            if mask[i, s]:
                delta = float(r[i, s]) + gamma * v_next - float(v[i, s])
                a_next = delta + gamma * float(lams[i]) * a_next
                out[i, s] = a_next
                v_next = float(v[i, s])
    return out


def returns(batch: RolloutBatch, gamma: float, bootstrap: bool) -> Tensor:
    """Discounted return-to-go, optionally bootstrapped with terminal_values, float64."""
    mask = batch.response_mask
    r = _masked(batch, batch.token_rewards)
    b, t = mask.shape
    term = batch.terminal_values.double() if bootstrap else torch.zeros(b, dtype=torch.float64)
    out = torch.zeros(b, t, dtype=torch.float64)
    for i in range(b):
        acc = float(term[i])
        for s in range(t - 1, -1, -1):
            if mask[i, s]:
                acc = float(r[i, s]) + gamma * acc
                out[i, s] = acc
    return out


def whiten(x: Tensor, mask: Tensor) -> Tensor:
    """Batch whitening over True positions with Bessel's correction, float64."""
    vals = [float(x[i, s]) for i in range(x.shape[0]) for s in range(x.shape[1]) if mask[i, s]]
    n = len(vals)
    if n == 0:
        return torch.zeros_like(x, dtype=torch.float64)
    mean = sum(vals) / n
    var = sum((v - mean) ** 2 for v in vals) / max(n - 1, 1)
    out = (x.double() - mean) / (var + 1e-8) ** 0.5
    return torch.where(mask, out, torch.zeros((), dtype=torch.float64))


def group_rows(batch: RolloutBatch) -> list[list[int]]:
    """Row indices of each group (each row alone without group_ids)."""
    ids = batch.group_ids
    if ids is None:
        return [[i] for i in range(batch.batch_size)]
    groups: dict[int, list[int]] = {}
    for i, g in enumerate(ids.tolist()):
        groups.setdefault(g, []).append(i)
    return list(groups.values())


def broadcast(batch: RolloutBatch, per_row: list[float]) -> Tensor:
    """A per-row value broadcast over the row's True positions, float64."""
    col = torch.tensor(per_row, dtype=torch.float64)[:, None]
    return torch.where(batch.response_mask, col, torch.zeros((), dtype=torch.float64))
