"""Per-round metrics: one host read per round, ``metrics.jsonl``, ``samples.jsonl`` and the
final ``curves.png``; which metrics, their labels and panels come from the table of metrics
(:mod:`ppokit.metrics_table`)."""

from __future__ import annotations

import json
import math
import resource
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ppokit.metrics_table import (
    ACCURACY,
    CURVES,
    EVAL_CURVES,
    EVAL_PROMPTS,
    REQUIRED,
    ROUND,
    TIMING,
    metric,
)
from ppokit.runfolder import METRICS, SAMPLES, append_line, read_metrics, write_atomic

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = [
    "CURVES",
    "TIMING",
    "Meter",
    "MetricsLog",
    "curves_title",
    "peak_memory_gb",
    "plot_curves",
    "read_metrics",
]


def curve_keys(history: Sequence[dict[str, Any]]) -> list[str]:
    """The panels of curves.png: CURVES, then EVAL_CURVES, those the history has values of."""
    present = {k for h in history for k, v in h.items() if v is not None}
    keys = [k for k in CURVES if k in present]
    for prefix in EVAL_CURVES:
        keys += sorted(
            k for k in present if k == prefix or (prefix.endswith("@") and k.startswith(prefix))
        )
    return keys


class Meter:
    """Sums and counts of metric tensors, averaged at the end without a host read.

    ``add(name, total, count)`` adds a sum and the number of items it sums (a tensor or a
    number); ``mean(name, value)`` adds one item. ``means()`` gives each name's Σ total / Σ
    count as a 0-d float32 tensor: NaN where nothing was counted (e.g. no row had weight),
    which the metrics record as missing (None), never as 0.
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

    def merge(self, other: Meter) -> None:
        """Add ``other``'s sums and counts (an optimizer step's, into the round's)."""
        for name, totals in other.totals.items():
            self.totals.setdefault(name, []).extend(totals)
            self.counts.setdefault(name, []).extend(other.counts[name])

    def means(self, reduce: Callable[[Tensor], Tensor] | None = None) -> dict[str, Tensor]:
        """Σ total / Σ count per name; ``reduce`` (e.g. a sum over processes) is applied to
        the stacked sums and counts first, in one call."""
        if not self.totals:
            return {}
        names = list(self.totals)
        sums = torch.stack(
            [torch.stack(self.totals[n]).sum() for n in names]
            + [torch.stack(self.counts[n]).sum() for n in names]
        )
        if reduce is not None:
            sums = reduce(sums)
        totals, counts = sums[: len(names)], sums[len(names) :]
        means = torch.where(counts > 0, totals / counts, math.nan)
        return dict(zip(names, means.unbind(), strict=True))


def peak_memory_gb(device: torch.device) -> float:
    """Peak memory so far: the CUDA caching allocator's peak, else the process's max RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


def read_once(tensors: dict[str, Tensor]) -> dict[str, float | None]:
    """Every metric tensor in one host transfer; non-finite values become None."""
    if not tensors:
        return {}
    names = list(tensors)
    stacked = torch.stack([tensors[k].detach().float().reshape(()) for k in names]).cpu().tolist()
    return {k: (v if math.isfinite(v) else None) for k, v in zip(names, stacked, strict=True)}


class MetricsLog:
    """Appends one JSON object per round to ``metrics.jsonl``, each line in one write (an OS
    error is a one-line ``UserError`` naming the file, and leaves no partial line);
    ``write`` False (a process other than the first): writes nothing."""

    def __init__(self, out: Path, write: bool = True) -> None:
        self.path = out / METRICS
        self.samples_path = out / SAMPLES
        self.write = write

    def append(self, record: dict[str, Any]) -> None:
        if not self.write:
            return
        full = {k: record.get(k) for k in REQUIRED}
        full.update(record)
        append_line(self.path, json.dumps(full))

    def samples(
        self,
        round_no: int,
        prompts: Sequence[str],
        responses: Sequence[str],
        scores: Sequence[float],
        limit: int = 8,
    ) -> None:
        lines = [
            json.dumps({ROUND: round_no, "prompt": p, "response": r, "reward": s})
            for p, r, s in list(zip(prompts, responses, scores, strict=True))[:limit]
        ]
        if lines and self.write:
            append_line(self.samples_path, "\n".join(lines))


def _accuracy_band(ax: Axes, history: Sequence[dict[str, Any]]) -> None:
    """The 95% Wilson interval of ``eval/accuracy`` over its ``eval/prompts`` prompts."""
    from ppokit.stats import wilson_interval

    band = [
        (h[ROUND], *wilson_interval(h[ACCURACY], int(h[EVAL_PROMPTS])))
        for h in history
        if h.get(ACCURACY) is not None and h.get(EVAL_PROMPTS)
    ]
    if band:
        x, low, high = zip(*band, strict=True)
        ax.fill_between(x, low, high, alpha=0.2, linewidth=0)


def curves_title(name: str, seed: int, when: float | None = None) -> str:
    """``NAME · seed S · YYYY-MM-DD HH:MM``, the title of curves.png."""
    stamp = time.strftime("%Y-%m-%d %H:%M", time.localtime(when))
    return f"{name} \u00b7 seed {seed} \u00b7 {stamp}"


def plot_curves(
    history: Sequence[dict[str, Any]], path: Path, title: str | None = None
) -> Figure | None:
    """Reward and the main diagnostics against the round, one panel each (matplotlib Agg),
    under ``title`` (also the PNG's ``Title`` metadata); every axis labelled. Returns the
    figure (closed), or None when there is nothing to plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = curve_keys(history)
    if not keys:
        return None
    cols = 2 if len(keys) > 1 else 1
    rows = math.ceil(len(keys) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 2.6 * rows + 0.5), squeeze=False)
    for ax, key in zip(axes.flat, keys, strict=False):
        pts = [(h[ROUND], h[key]) for h in history if h.get(key) is not None]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", linewidth=1)
        if key == ACCURACY:
            _accuracy_band(ax, history)
        ax.set_title(key, fontsize=9)
        ax.set_xlabel(metric(ROUND).label, fontsize=8)
        ax.set_ylabel(metric(key).label, fontsize=8)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(keys) :]:
        ax.axis("off")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    metadata = {"Title": title} if title else None
    try:
        write_atomic(path, lambda fh: fig.savefig(fh, format="png", dpi=100, metadata=metadata))
    finally:
        plt.close(fig)
    return fig
