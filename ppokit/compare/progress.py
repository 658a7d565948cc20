"""The progress of a sweep: counts, the time left, a live view on a terminal or one line
per event. Torch-free."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from ppokit.compare.runs import SweepRun, last_round, read_history
from ppokit.metrics_table import ROUND_TIME
from ppokit.runfolder import (
    METRICS,
)
from ppokit.trainer.display import duration


# ---------------------------------------------------------------------- progress
class Progress:
    """Counts and the estimated time left of a sweep; the views below show it."""

    def __init__(self, runs: Sequence[SweepRun], jobs: int) -> None:
        self.runs = runs
        self.jobs = jobs
        # a run finished before this sweep: its training time, a lower bound of a run's wall
        self.prior = [
            sum(h.get(ROUND_TIME) or 0.0 for h in read_history(r.dir))
            for r in runs
            if r.action == "skip"
        ]
        self._rounds: dict[Path, tuple[int, int]] = {}

    def counts(self) -> dict[str, int]:
        out = {"finished": 0, "running": 0, "failed": 0, "pending": 0, "interrupted": 0}
        for r in self.runs:
            out[r.status] += 1
        return out

    def eta(self, now: float | None = None) -> float | None:
        now = time.perf_counter() if now is None else now
        walls = [r.wall for r in self.runs if r.wall is not None and r.status == "finished"]
        if not walls:
            walls = [w for w in self.prior if w > 0]
        if not walls:
            return None
        avg = sum(walls) / len(walls)
        left = sum(avg for r in self.runs if r.status == "pending")
        left += sum(
            max(0.0, avg - (now - r.started))
            for r in self.runs
            if r.status == "running" and r.started is not None
        )
        return left / self.jobs

    def line(self) -> str:
        c = self.counts()
        done = c["finished"] + c["failed"]
        text = (
            f"{done}/{len(self.runs)} done: {c['finished']} finished, {c['failed']} failed, "
            f"{c['running']} running, {c['pending']} pending"
        )
        if c["interrupted"]:
            text += f", {c['interrupted']} interrupted"
        eta = self.eta()
        if c["running"] or c["pending"]:
            text += f"; about {duration(eta)} left" if eta is not None else ""
        return text

    def round_of(self, run: SweepRun) -> int:
        """The last round logged by a running run (cached on the file's size)."""
        path = run.dir / METRICS
        try:
            size = path.stat().st_size
        except OSError:
            return 0
        cached = self._rounds.get(path)
        if cached is None or cached[0] != size:
            cached = (size, last_round(run.dir))
            self._rounds[path] = cached
        return cached[1]


class PlainView:
    """One plain line per run event (no terminal)."""

    def __init__(self, progress: Progress, stream: TextIO | None = None) -> None:
        self.progress = progress
        self.stream = stream

    def _print(self, text: str) -> None:
        stream = self.stream or sys.stdout
        stream.write(text + "\n")
        stream.flush()

    def start(self) -> None:
        self._print(f"ppokit compare: {len(self.progress.runs)} run(s)")

    def event(self, run: SweepRun, what: str) -> None:
        self._print(f"{what}: {run.title} ({run.dir}); {self.progress.line()}")

    def refresh(self) -> None:
        pass

    def stop(self) -> None:
        pass


class LiveView(PlainView):
    """A live rich view of the whole sweep (on a terminal)."""

    def __init__(self, progress: Progress, console: Any = None) -> None:
        from rich.console import Console

        super().__init__(progress)
        self.console = console or Console(highlight=False)
        self.live: Any = None

    def _render(self) -> Any:
        from rich.console import Group
        from rich.markup import escape
        from rich.progress_bar import ProgressBar
        from rich.table import Table
        from rich.text import Text

        p = self.progress
        c = p.counts()
        bar = ProgressBar(total=len(p.runs), completed=c["finished"] + c["failed"], width=40)
        table = Table(box=None, pad_edge=False, show_header=False)
        table.add_column("state")
        table.add_column("run")
        table.add_column("progress", justify="right")
        now = time.perf_counter()
        for r in p.runs:
            if r.status == "running":
                started = now - r.started if r.started is not None else None
                table.add_row(
                    "[cyan]running[/]",
                    escape(r.title),
                    f"round {p.round_of(r)}/{r.rounds}, {duration(started)}",
                )
        for r in p.runs:
            if r.status == "failed":
                table.add_row("[red]failed[/]", escape(r.title), escape(r.error or ""))
        head = Text.from_markup(f"[bold]ppokit compare[/]  {escape(p.line())}")
        return Group(head, bar, table)

    def start(self) -> None:
        from rich.live import Live

        self.live = Live(
            self._render(), console=self.console, refresh_per_second=4, transient=False
        )
        self.live.start()

    def event(self, run: SweepRun, what: str) -> None:
        if what in ("failed", "blocked") and self.live is not None:
            from rich.markup import escape

            self.console.print(
                f"[red]failed: {escape(run.title)}: {escape(run.error or '')}[/]", highlight=False
            )
        self.refresh()

    def refresh(self) -> None:
        if self.live is not None:
            self.live.update(self._render())

    def stop(self) -> None:
        if self.live is not None:
            self.refresh()
            self.live.stop()
            self.live = None
