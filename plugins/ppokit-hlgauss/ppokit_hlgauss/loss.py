"""Tensor code of the HL-Gauss loss (catalogue: ``ppokit_hlgauss.plugin``)."""

from __future__ import annotations

import torch
from torch import Tensor

from ppokit_hlgauss.plugin import HLGAUSS


@HLGAUSS.implementation
class HLGaussLoss:
    """The value support [vmin, vmax] is cut into K = ``bins`` bins with edges z_0 < ... < z_K
    and centres c_k; a target Y is clamped to the support; sigma = sigma_ratio * (vmax - vmin)
    / K; h [B, T, K] are the head's logits.

    The critic asks this component for the width of its value head (``head_size = K``),
    how to read a value from it (``value``) and what the loss takes (``prediction``: the
    logits themselves).
    """

    def __init__(self, *, bins: int, vmin: float, vmax: float, sigma_ratio: float) -> None:
        self.head_size = bins
        self.vmin = vmin
        self.vmax = vmax
        width = (vmax - vmin) / bins
        self.sigma = sigma_ratio * width
        self._edges = torch.linspace(vmin, vmax, bins + 1, dtype=torch.float32)
        self._centers = (self._edges[:-1] + self._edges[1:]) / 2

    def _on(self, t: Tensor, device: torch.device) -> Tensor:
        return t if t.device == device else t.to(device)

    def value(self, head_out: Tensor) -> Tensor:
        """V = sum_k softmax(h)_k c_k, float32 [...]."""
        probs = torch.softmax(head_out.float(), dim=-1)
        return probs @ self._on(self._centers, head_out.device)

    def prediction(self, head_out: Tensor) -> Tensor:
        """The loss takes the logits themselves."""
        return head_out

    def target_distribution(self, target: Tensor) -> Tensor:
        """p_k(Y) for targets [...] -> [..., K] (rows sum to 1)."""
        edges = self._on(self._edges, target.device)
        y = target.float().clamp(self.vmin, self.vmax).unsqueeze(-1)
        cdf = torch.special.ndtr((edges - y) / self.sigma)
        mass = cdf[..., 1:] - cdf[..., :-1]
        total = cdf[..., -1:] - cdf[..., :1]
        return mass / total.clamp_min(1e-12)

    def __call__(self, pred: Tensor, target: Tensor, old: Tensor | None = None) -> Tensor:
        """Elementwise cross-entropy [...] between softmax(pred) and p(target)."""
        logp = torch.log_softmax(pred.float(), dim=-1)
        p = self.target_distribution(target.detach())
        # 0 log 0 = 0: bins far from Y carry no mass, whatever the head says there
        return -torch.where(p > 0, p * logp, torch.zeros_like(logp)).sum(dim=-1)


__all__ = ["HLGaussLoss"]
