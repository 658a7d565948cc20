"""Per-round metrics: one host read per round, ``metrics.jsonl``, ``samples.jsonl`` and the
final ``curves.png``."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

__all__ = ["CURVES", "Meter", "MetricsLog", "plot_curves", "read_metrics"]

#: Keys every metrics line carries (None when a run has no such quantity).
REQUIRED = (
    "round",
    "reward_mean",
    "reward_std",
    "response_length_mean",
    "truncated_frac",
    "kl",
    "entropy",
    "policy_loss",
    "clipfrac",
    "approx_kl",
    "value_loss",
    "vf_clipfrac",
    "explained_variance",
    "value_error",
    "grad_norm_actor",
    "grad_norm_critic",
    "tokens_per_s",
    "kl_coef",
    "time_generate",
    "time_score",
    "time_logprob",
    "time_update",
    "time_round",
)
#: Timing and memory measurements (excluded when comparing runs).
TIMING = (
    "peak_memory_gb",
    "tokens_per_s",
    "time_generate",
    "time_score",
    "time_logprob",
    "time_update",
    "time_round",
)
#: Panels of curves.png.
CURVES = (
    "reward_mean",
    "response_length_mean",
    "kl",
    "entropy",
    "value_loss",
    "value_error",
    "clipfrac",
    "grad_norm_actor",
)


class Meter:
    """Sums and counts of metric tensors, averaged at the end without a host read.

    ``add(name, total, count)`` adds a sum and the number of items it sums (a tensor or a
    number); ``mean(name, value)`` adds one item. ``means()`` gives each name's Σ total / Σ
    count as a 0-d float32 tensor (0 where nothing was counted).
    """

    def __init__(self) -> None:
        self.totals: dict[str, list[Tensor]] = {}
        self.counts: dict[str, list[Tensor]] = {}

    def add(self, name: str, total: Tensor, count: Tensor | float) -> None:
        total = total.detach().float()
        if not isinstance(count, Tensor):
            count = total.new_full((), count)  # a fill on the device, no host-to-device copy
        self.totals.setdefault(name, []).append(total)
        self.counts.setdefault(name, []).append(count.detach().float())

    def mean(self, name: str, value: Tensor) -> None:
        self.add(name, value, 1.0)

    def means(self) -> dict[str, Tensor]:
        out = {}
        for name, totals in self.totals.items():
            total = torch.stack(totals).sum()
            count = torch.stack(self.counts[name]).sum()
            out[name] = torch.where(count > 0, total / count, 0.0)
        return out


def read_once(tensors: dict[str, Tensor]) -> dict[str, float | None]:
    """Every metric tensor in one host transfer; non-finite values become None."""
    if not tensors:
        return {}
    names = list(tensors)
    stacked = torch.stack([tensors[k].detach().float().reshape(()) for k in names]).cpu().tolist()
    return {k: (v if math.isfinite(v) else None) for k, v in zip(names, stacked, strict=True)}


class MetricsLog:
    """Appends one JSON object per round to ``metrics.jsonl`` (flushed line by line)."""

    def __init__(self, out: Path) -> None:
        self.path = out / "metrics.jsonl"
        self.samples_path = out / "samples.jsonl"

    def append(self, record: dict[str, Any]) -> None:
        full = {k: record.get(k) for k in REQUIRED}
        full.update(record)
        with self.path.open("a") as fh:
            fh.write(json.dumps(full) + "\n")

    def samples(
        self,
        round_no: int,
        prompts: Sequence[str],
        responses: Sequence[str],
        scores: Sequence[float],
        limit: int = 8,
    ) -> None:
        with self.samples_path.open("a") as fh:
            for p, r, s in list(zip(prompts, responses, scores, strict=True))[:limit]:
                fh.write(
                    json.dumps({"round": round_no, "prompt": p, "response": r, "reward": s}) + "\n"
                )


def read_metrics(out: Path) -> list[dict[str, Any]]:
    path = Path(out) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_curves(history: Sequence[dict[str, Any]], path: Path) -> None:
    """Reward and the main diagnostics against the round, one panel each (matplotlib Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k in CURVES if any(h.get(k) is not None for h in history)]
    if not keys:
        return
    cols = 2 if len(keys) > 1 else 1
    rows = math.ceil(len(keys) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 2.6 * rows), squeeze=False)
    for ax, key in zip(axes.flat, keys, strict=False):
        pts = [(h["round"], h[key]) for h in history if h.get(key) is not None]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", linewidth=1)
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("round", fontsize=8)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(keys) :]:
        ax.axis("off")
    fig.tight_layout()
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(path)
