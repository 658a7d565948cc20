"""What a run shows: on a terminal a live rich progress bar with the round, the phase inside
it, the throughput and the time left; otherwise one plain line per round (under 100
characters, never wrapped); a summary table at the end whose "best" column knows which way
each metric is better."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, ProgressColumn, Task
from rich.table import Column, Table
from rich.text import Text

from ppokit.errors import printable
from ppokit.metrics_table import SHOWN, SUMMARY, best_direction

__all__ = ["Display", "best_direction", "duration", "fmt", "plain_line"]

#: The longest plain progress line (a metric is dropped, from the last, to stay under it).
PLAIN_WIDTH = 100
#: SHOWN: (record key, short name, priority) of the metrics of a plain line, in order; when
#: the line is too long the one of the highest priority number goes first. SUMMARY: rows of
#: the summary table. Both, and best_direction, from the table of metrics.
#: Priority of the throughput (``812 tok/s``), last on the line.
TOKENS_PRIORITY = 1
MISSING = "\u2013"  # an en dash: no value


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def fmt(value: Any, digits: int = 4) -> str:
    """A metric value for display: ``–`` when absent, None, NaN or inf."""
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    number = _number(value)
    return MISSING if number is None else f"{number:.{digits}g}"


def duration(seconds: float | None) -> str:
    """``42s``, ``3m05s``, ``1h02m``; ``?`` when unknown."""
    if seconds is None or not math.isfinite(seconds):
        return "?"
    seconds = max(0, round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


def _metric_parts(record: dict[str, Any]) -> list[tuple[int, str]]:
    """(priority, ``reward 0.41``), ... for the metrics the record has a value of (the
    reward always), then the throughput."""
    parts = []
    for key, short, priority in SHOWN:
        value = _number(record.get(key))
        if value is not None or key == "reward_mean":
            parts.append((priority, f"{short} {fmt(value, 3)}"))
    tps = _number(record.get("tokens_per_s"))
    if tps is not None:
        parts.append((TOKENS_PRIORITY, f"{tps:.0f} tok/s"))
    return parts


def plain_line(record: dict[str, Any], total: int, seconds: float | None, eta: float | None) -> str:
    """``round 3/200  reward 0.41  len 7.5  kl 0.012 ...  2.1s  eta 6m58s`` in at most
    PLAIN_WIDTH characters: the round, the time and the time left always, metrics as many as
    fit (the least important dropped first)."""
    head = f"round {record.get('round', '?')}/{total}"
    took = f"{seconds:.1f}s" if seconds is not None and 0 <= seconds < 60 else duration(seconds)
    tail = f"{took}  eta {duration(eta)}"
    parts = _metric_parts(record)

    def line() -> str:
        return "  ".join([head, *(text for _, text in parts), tail])

    while parts and len(line()) > PLAIN_WIDTH:
        parts.remove(max(parts, key=lambda part: part[0]))
    return line()


class _Clock(ProgressColumn):
    """Elapsed time and the time left, counting down between rounds (never cut)."""

    def __init__(self, display: Display) -> None:
        super().__init__(table_column=Column(no_wrap=True))
        self.display = display

    def render(self, task: Task) -> Text:
        return Text(self.display.clock(), style="progress.elapsed", no_wrap=True)


class _Counter(ProgressColumn):
    """``3/200``: the rounds done (never cut)."""

    def __init__(self) -> None:
        super().__init__(table_column=Column(no_wrap=True))

    def render(self, task: Task) -> Text:
        total = "?" if task.total is None else f"{task.total:.0f}"
        return Text(f"{task.completed:.0f}/{total}", style="progress.download", no_wrap=True)


class _Field(ProgressColumn):
    """A task field (or a fixed text) on one line, the first to shrink (with an ellipsis)
    when the terminal is narrow: its table column may collapse, its text never wraps."""

    def __init__(self, field: str | None, text: str = "", style: str = "") -> None:
        super().__init__(table_column=Column(no_wrap=False, overflow="ellipsis"))
        self.field = field
        self.text = text
        self.style = style

    def render(self, task: Task) -> Text:
        value = self.text if self.field is None else str(task.fields.get(self.field, ""))
        return Text(value, style=self.style, no_wrap=True, overflow="ellipsis")


class Display:
    """Progress of a run: live (``live`` and a terminal) or plain lines; messages and the
    summary either way."""

    def __init__(
        self,
        total: int,
        start: int,
        live: bool = True,
        stream: Any = None,
        console: Console | None = None,
    ) -> None:
        self.total = total
        self.start = start
        self.console = console or Console(file=stream or sys.stderr, highlight=False)
        self.live = live and self.console.is_terminal
        self.began = time.perf_counter()
        self.round_began: float | None = None
        self.last_end: float | None = None
        self.times: list[float] = []
        self.current = start
        self.phase_name = ""
        self.progress: Progress | None = None
        if self.live:
            self.progress = Progress(
                _Field(None, "ppokit", "bold"),
                BarColumn(bar_width=24),
                _Counter(),
                _Clock(self),
                _Field("phase", style="cyan"),
                _Field("info"),
                console=self.console,
                transient=False,
            )
            self.task = self.progress.add_task(
                "train", total=total, completed=start, phase="", info=""
            )
            self.progress.start()

    # ------------------------------------------------------------------ timing
    def eta(self) -> float | None:
        """Seconds left: the mean round time so far times the rounds left (None before the
        first round ends)."""
        if not self.times:
            return None
        return sum(self.times) / len(self.times) * max(0, self.total - self.current)

    def clock(self) -> str:
        now = time.perf_counter()
        left = self.eta()
        if left is not None and self.last_end is not None:
            left = max(0.0, left - (now - self.last_end))
        return f"{duration(now - self.began)}  eta {duration(left)}"

    # ------------------------------------------------------------------ events
    def message(self, text: str) -> None:
        """A line of the run (a warning, an error that a plugin's text may be part of), its
        control characters escaped."""
        self.console.print(printable(text), highlight=False, markup=False, soft_wrap=True)

    def start_round(self, round_no: int) -> None:
        """Round ``round_no`` (1-based) begins."""
        self.round_began = time.perf_counter()
        self.phase(f"round {round_no}")

    def phase(self, name: str) -> None:
        """The Learner's phase inside a round ("generating", "scoring", ...)."""
        self.phase_name = name
        if self.progress is not None:
            self.progress.update(self.task, phase=name)

    def round(self, record: dict[str, Any], total: int) -> None:
        """A round ended (after its checkpoint, if any)."""
        now = time.perf_counter()
        began = self.round_began if self.round_began is not None else self.last_end
        seconds = now - began if began is not None else _number(record.get("time_round"))
        if seconds is not None:
            self.times.append(seconds)
        self.last_end = now
        self.total = total
        self.current = int(record.get("round", self.current + 1))
        if self.progress is not None:
            tps = _number(record.get("tokens_per_s"))
            info = f"reward {fmt(record.get('reward_mean'), 3)}" + (
                f"  {tps:.0f} tok/s" if tps is not None else ""
            )
            self.progress.update(self.task, completed=self.current, info=info, phase="")
        else:
            self.console.print(
                plain_line(record, total, seconds, self.eta()),
                highlight=False,
                markup=False,
                soft_wrap=True,
            )

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None

    # ------------------------------------------------------------------ summary
    def summary(self, history: Sequence[dict[str, Any]], out: str) -> None:
        self.close()
        table = summary_table(history, out)
        if table is not None:
            self.console.print(table)


def _rows(history: Sequence[dict[str, Any]]) -> list[str]:
    present = {k for h in history for k, v in h.items() if _number(v) is not None}
    evals = sorted(k for k in present if k.startswith("eval"))
    keys = ["reward_mean", *evals, *SUMMARY[1:]]
    return [k for k in keys if k in present or k == "reward_mean"]


def summary_row(history: Sequence[dict[str, Any]], key: str) -> tuple[str, str, str]:
    """(first, last, best) of ``key`` over the rounds: first and last are the first and last
    rounds' values (``–`` where missing), best follows :func:`best_direction` (``–`` where the
    metric has no better direction or no value)."""
    values = [v for v in (_number(h.get(key)) for h in history) if v is not None]
    direction = best_direction(key)
    best = MISSING
    if direction is not None and values:
        best = fmt(max(values) if direction == "max" else min(values))
    if key.startswith("eval/"):  # logged every eval.every rounds: first and last logged
        first = fmt(values[0]) if values else MISSING
        last = fmt(values[-1]) if values else MISSING
        return first, last, best
    rounds = [h for h in history if h.get("round") != 0]  # round 0: an evaluation only
    first = fmt(rounds[0].get(key)) if rounds else MISSING
    last = fmt(rounds[-1].get(key)) if rounds else MISSING
    return first, last, best


def summary_table(history: Sequence[dict[str, Any]], out: str) -> Table | None:
    if not history:
        return None
    table = Table(title=f"ppokit run: {out}")
    table.add_column("metric", no_wrap=True)
    for name in ("first", "last", "best"):
        table.add_column(name, justify="right", no_wrap=True)
    for key in _rows(history):
        table.add_row(key, *summary_row(history, key))
    return table
