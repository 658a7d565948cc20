"""What a run shows: a live rich progress bar on a terminal, one plain line per round
otherwise, and a summary table at the end."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

__all__ = ["Display"]

SHOWN = ("reward_mean", "response_length_mean", "kl", "entropy", "value_loss", "clipfrac")


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


class Display:
    """Progress of a run (silent when ``enabled`` is False)."""

    def __init__(self, total: int, start: int, enabled: bool, stream: Any = None) -> None:
        self.enabled = enabled
        self.console = Console(file=stream or sys.stderr)
        self.live = enabled and self.console.is_terminal
        self.progress: Progress | None = None
        if self.live:
            self.progress = Progress(
                TextColumn("[bold]ppokit[/]"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("{task.fields[info]}"),
                console=self.console,
            )
            self.task = self.progress.add_task("train", total=total, completed=start, info="")
            self.progress.start()

    def message(self, text: str) -> None:
        if self.enabled:
            self.console.print(text, highlight=False)

    def round(self, record: dict[str, Any], total: int) -> None:
        if not self.enabled:
            return
        info = "  ".join(f"{k}={_fmt(record.get(k))}" for k in SHOWN if record.get(k) is not None)
        if self.progress is not None:
            self.progress.update(self.task, completed=record["round"], info=info)
        else:
            self.console.print(f"round {record['round']}/{total}  {info}", highlight=False)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None

    def summary(self, history: Sequence[dict[str, Any]], out: str) -> None:
        self.close()
        if not self.enabled or not history:
            return
        table = Table(title=f"ppokit run: {out}")
        table.add_column("metric")
        table.add_column("first", justify="right")
        table.add_column("last", justify="right")
        table.add_column("best", justify="right")
        for key in (*SHOWN, "explained_variance", "grad_norm_actor", "tokens_per_s"):
            values = [h.get(key) for h in history if h.get(key) is not None]
            if not values:
                continue
            best = (
                max(values)
                if key in ("reward_mean", "explained_variance", "tokens_per_s")
                else min(values)
            )
            table.add_row(key, _fmt(values[0]), _fmt(values[-1]), _fmt(best))
        self.console.print(table)
