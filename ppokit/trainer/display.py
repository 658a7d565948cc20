"""What a run shows, from its first second: on a terminal a live rich progress bar with the
round, the step under way (loading the model, converting a GGUF file, adding LoRA adapters,
evaluating, generating, scoring, updating), the decoding steps of a generation with its
tokens per second and the time it has left, and the time left of the run; otherwise one
plain line per round (under 100 characters, never wrapped), a line as each step before the
rounds begins, and while a step lasts a status line every ``PLAIN_EVERY`` seconds (so that a
log shows a long first round as it goes). A summary table at the end whose "best" column
knows which way each metric is better, then the signs of an unhealthy run that fired
(docs/health.md; each one's warning is a message of the round it starts firing on). Without
a terminal nothing is wider than ``CONSOLE_WIDTH`` columns (or ``COLUMNS``) but a run's own
messages, which are never cut."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any

from rich.console import Console
from rich.progress import BarColumn, Progress, ProgressColumn, Task
from rich.table import Column, Table
from rich.text import Text

from ppokit.errors import UserError, clipped, printable
from ppokit.metrics_table import (
    EVAL_PREFIX,
    MFU,
    REWARD,
    ROUND,
    ROUND_TIME,
    SHOWN,
    SUMMARY,
    THROUGHPUT,
    best_direction,
)
from ppokit.trainer.health import fired_signs
from ppokit.trainer.report import Reporter

__all__ = ["Display", "best_direction", "console_width", "duration", "fmt", "health_line"]
__all__ += ["folded_logs", "plain_line"]

#: The longest plain progress line (a metric is dropped, from the last, to stay under it).
PLAIN_WIDTH = 100
#: The width of a console that is not a terminal (``COLUMNS`` overrides it): status lines
#: and tables are laid out for it.
CONSOLE_WIDTH = 160
#: Seconds between two plain status lines of a step that lasts (no terminal).
PLAIN_EVERY = 15.0
#: SHOWN: (record key, short name, priority) of the metrics of a plain line, in order; when
#: the line is too long the one of the highest priority number goes first. SUMMARY: rows of
#: the summary table. Both, and best_direction, from the table of metrics.
#: Priority of the throughput (``812 tok/s``) and of the update's model FLOP utilisation
#: (``mfu 17%``), last on the line.
TOKENS_PRIORITY = 1
MFU_PRIORITY = 9
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
        if value is not None or key == REWARD:
            parts.append((priority, f"{short} {fmt(value, 3)}"))
    tps = _number(record.get(THROUGHPUT))
    if tps is not None:
        parts.append((TOKENS_PRIORITY, f"{tps:.0f} tok/s"))
    mfu = _number(record.get(MFU["update"]))
    if mfu is not None:
        parts.append((MFU_PRIORITY, f"mfu {mfu:.0%}"))
    return parts


def plain_line(record: dict[str, Any], total: int, seconds: float | None, eta: float | None) -> str:
    """``round 3/200  reward 0.41  len 7.5  kl 0.012 ...  2.1s  eta 6m58s`` in at most
    PLAIN_WIDTH characters: the round, the time and the time left always, metrics as many as
    fit (the least important dropped first)."""
    head = f"round {record.get(ROUND, '?')}/{total}"
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


def console_width(stream: IO[str] | None = None) -> int | None:
    """The width to lay out for on ``stream`` (default stdout): None on a terminal (rich
    asks it), else ``COLUMNS`` when set, else :data:`CONSOLE_WIDTH`."""
    stream = stream if stream is not None else sys.stdout
    isatty = getattr(stream, "isatty", None)
    if callable(isatty) and isatty():
        return None
    columns = os.environ.get("COLUMNS", "")
    return int(columns) if columns.isdigit() and int(columns) > 0 else CONSOLE_WIDTH


def _per_second(count: float, seconds: float) -> str:
    return f"{count / seconds:.3g}" if seconds > 0 else "?"


class _Generation:
    """The decoding steps of the engine's current ``generate`` call (host-side counts),
    timed from the first decoding step reported (the prompts' forward pass before it, step
    0, is not: it would make the first rates look slow)."""

    def __init__(self, step: int, steps: int, rows: int, now: float) -> None:
        self.steps = steps
        self.rows = rows
        self.first = step
        self.began = now
        self.step = step
        self.at = now

    def text(self, now: float) -> str:
        """``step 12/48 x 32 responses, 41 tok/s, at most 25s left`` (a response may end
        before the last step: the time left is an upper bound)."""
        took = self.at - self.began
        done = self.step - self.first
        head = f"step {self.step}/{self.steps} x {self.rows} responses"
        if self.step == 0:
            return f"{head}: the prompts' forward pass"
        if done < 1 or took <= 0:
            return head
        left = max(0.0, (self.steps - self.step) * took / done - (now - self.at))
        tokens = _per_second(done * self.rows, took)
        return f"{head}, {tokens} tok/s, at most {duration(left)} left"


class Display:
    """Progress of a run: live (``live`` and a terminal) or plain lines; messages and the
    summary either way.

    The run reports what it is doing: :meth:`step` before the rounds (each one a line
    without a terminal), :meth:`start_round` and :meth:`phase` inside them,
    :meth:`status` for a step's own progress (a GGUF file's tensors converted) and
    :meth:`generation` for an engine's decoding steps. Without a terminal a status line
    (``round 1/30  generating 1m15s: step 12/48 x 32 responses, ...``) is printed every
    ``every`` seconds in which nothing else was (0: never)."""

    def __init__(
        self,
        total: int,
        start: int,
        live: bool = True,
        stream: IO[str] | None = None,
        console: Console | None = None,
        every: float = PLAIN_EVERY,
    ) -> None:
        self.total = total
        self.start = start
        stream = stream or sys.stderr
        self.console = console or Console(file=stream, highlight=False, width=console_width(stream))
        self.live = live and self.console.is_terminal
        self.began = time.perf_counter()
        self.round_began: float | None = None
        self.last_end: float | None = None
        self.times: list[float] = []
        self.current = start
        self.phase_name = ""
        self.phase_began = self.began
        self.in_round = False
        self.detail = ""
        self.gen: _Generation | None = None
        self.passes = 0  # generate calls since the step or phase began
        self.expected_passes: int | None = None
        self.every = every
        self.last_line = self.began
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None
        self.progress: Progress | None = None
        if self.live:
            self.progress = Progress(
                _Field(None, "ppokit", "bold"),
                BarColumn(bar_width=24),
                _Counter(),
                _Clock(self),
                _Field("phase", style="cyan"),
                _Field("detail"),
                _Field("info"),
                console=self.console,
                transient=False,
            )
            self.task = self.progress.add_task(
                "train", total=total, completed=start, phase="", detail="", info=""
            )
            self.progress.start()

    # ------------------------------------------------------------------ timing
    def eta(self) -> float | None:
        """Seconds left: the mean round time so far times the rounds left (None before the
        first round ends)."""
        if not self.times:
            return None
        return sum(self.times) / len(self.times) * max(0, self.total - self.current)

    def left(self, now: float) -> float | None:
        """:meth:`eta` less the time since the last round ended; None (shown ``?``) before the
        first round ends and once a round outlasts the estimate (an evaluation, a slower
        round): ``eta 0s`` would say the run is about to end."""
        left = self.eta()
        if left is None or self.last_end is None:
            return left
        left -= now - self.last_end
        return left if left > 0 else None

    def clock(self) -> str:
        now = time.perf_counter()
        return f"{duration(now - self.began)}  eta {duration(self.left(now))}"

    # ------------------------------------------------------------------ output
    def _print(self, text: str) -> None:
        with self._lock:
            self.console.print(text, highlight=False, markup=False, soft_wrap=True)
            self.last_line = time.perf_counter()

    def _show(self) -> None:
        """The live display's phase and detail fields."""
        if self.progress is not None:
            self.progress.update(self.task, phase=self.phase_name, detail=self.detail)

    def status_line(self, now: float | None = None) -> str:
        """``round 3/30  generating 45s: step 12/48 x 32 responses, 41 tok/s, at most 25s
        left  eta 24m10s`` (inside a round) or ``ppokit: loading the model 20s: ...``
        (before the rounds), at most the console's width."""
        now = time.perf_counter() if now is None else now
        with self._lock:
            detail = self._gen_text(now) if self.gen is not None else self.detail
            what = f"{self.phase_name} {duration(now - self.phase_began)}"
            what += f": {printable(detail)}" if detail else ""
            if self.in_round:
                line = f"round {self.current + 1}/{self.total}  {what}"
                if self.times:
                    line += f"  eta {duration(self.left(now))}"
            else:
                line = f"ppokit: {what}"
        width = self.console.width
        return clipped(line, width)

    def _gen_text(self, now: float) -> str:
        assert self.gen is not None
        text = self.gen.text(now)
        if self.expected_passes is not None and self.expected_passes > 1:
            return f"pass {self.passes}/{self.expected_passes}, {text}"
        return f"pass {self.passes}, {text}" if self.passes > 1 else text

    def _start_ticker(self) -> None:
        """The plain status lines' thread, from the first step or phase on (a display that
        only prints messages and a summary starts none)."""
        wanted = self.progress is None and self.every > 0 and not self._stop.is_set()
        if wanted and self._ticker is None:
            self._ticker = threading.Thread(target=self._tick, name="ppokit-status", daemon=True)
            self._ticker.start()

    def _tick(self) -> None:
        """The plain status lines: one whenever ``every`` seconds went by without a line."""
        while not self._stop.wait(min(1.0, self.every)):
            with self._lock:
                quiet = time.perf_counter() - self.last_line
                if self.phase_name and quiet >= self.every and self.progress is None:
                    self._print(self.status_line())

    # ------------------------------------------------------------------ events
    def message(self, text: str) -> None:
        """A line of the run (a warning, an error that a plugin's text may be part of), its
        control characters escaped."""
        self._print(printable(text))

    def step(self, name: str, passes: int | None = None) -> None:
        """A step before the rounds begins (``loading the model smollm2-135m-instruct``,
        ``evaluating 200 held-out prompts``): shown at once, a line without a terminal.
        ``passes``: the engine's ``generate`` calls the step makes, when known."""
        with self._lock:
            self.in_round = False
            self.phase_name = name
            self.phase_began = time.perf_counter()
            self.detail = ""
            self.gen = None
            self.passes = 0
            self.expected_passes = passes
            self._show()
            self._start_ticker()
            if self.progress is None:
                self._print(f"ppokit: {printable(name)}")

    def status(self, text: str) -> None:
        """The current step's own progress (``tensor 120/272``)."""
        with self._lock:
            self.detail = text
            self.gen = None
            self._show()

    def generation(self, step: int, steps: int, rows: int) -> None:
        """The engine decoded ``step`` of at most ``steps`` tokens for ``rows`` responses
        (a new ``generate`` call at step 0, or when ``step`` goes back)."""
        now = time.perf_counter()
        with self._lock:
            gen = self.gen
            again = gen is None or step == 0 or step < gen.step
            if gen is None or again or (steps, rows) != (gen.steps, gen.rows):
                gen = self.gen = _Generation(step, steps, rows, now)
                self.passes += 1
            elif gen.step == 0 and gen.first == 0:  # the rate counts from step 1:
                gen.first, gen.began = step, now  # not the prompts' forward pass
            gen.step = step
            gen.at = now
            if self.progress is not None:
                self.detail = self._gen_text(now)
                self._show()

    def start_round(self, round_no: int) -> None:
        """Round ``round_no`` (1-based) begins."""
        self.round_began = time.perf_counter()
        self.in_round = True
        self.phase(f"round {round_no}")

    def phase(self, name: str) -> None:
        """A phase inside a round ("generating", "scoring", ...)."""
        with self._lock:
            self.phase_name = name
            self.phase_began = time.perf_counter()
            self.detail = ""
            self.gen = None
            self.passes = 0
            self.expected_passes = None
            self._show()
            self._start_ticker()

    def resumed(self, start: int) -> None:
        """The run continues after round ``start`` (a resumed run's checkpoint)."""
        self.start = self.current = start
        if self.progress is not None:
            self.progress.update(self.task, completed=start)

    def round(self, record: dict[str, Any], total: int) -> None:
        """A round ended (after its checkpoint, if any)."""
        now = time.perf_counter()
        began = self.round_began if self.round_began is not None else self.last_end
        seconds = now - began if began is not None else _number(record.get(ROUND_TIME))
        if seconds is not None:
            self.times.append(seconds)
        self.last_end = now
        self.total = total
        self.current = int(record.get(ROUND, self.current + 1))
        if self.progress is not None:
            tps = _number(record.get(THROUGHPUT))
            mfu = _number(record.get(MFU["update"]))
            info = (
                f"reward {fmt(record.get(REWARD), 3)}"
                + (f"  {tps:.0f} tok/s" if tps is not None else "")
                + (f"  mfu {mfu:.0%}" if mfu is not None else "")
            )
            self.progress.update(self.task, completed=self.current, info=info, phase="", detail="")
        else:
            self._print(plain_line(record, total, seconds, self.eta()))
        with self._lock:  # between rounds: no step under way
            self.phase_name = self.detail = ""
            self.gen = None
            self.in_round = False

    def close(self) -> None:
        self._stop.set()
        if self._ticker is not None and self._ticker is not threading.current_thread():
            self._ticker.join(timeout=5)
            self._ticker = None
        if self.progress is not None:
            self.progress.stop()
            self.progress = None
        self.phase_name = ""

    # ------------------------------------------------------------------ summary
    def summary(self, history: Sequence[dict[str, Any]], out: str) -> None:
        """The summary table, then the signs of docs/health.md that fired, if any."""
        self.close()
        table = summary_table(history, out)
        if table is not None:
            self.console.print(table)
        line = health_line(history)
        if line:
            self._print(line)


#: The loggers of the libraries a run drives whose lines :func:`folded_logs` takes in: vLLM's
#: (the ``vllm`` engine; vLLM leaves them to the application, VLLM_CONFIGURE_LOGGING=0).
FOLDED_LOGGERS = ("vllm",)


class _Folded(logging.Handler):
    """Each record as a line of ``path`` (None: no file); a warning or an error also as a
    message of the display, each distinct one once (its first line)."""

    def __init__(self, display: Reporter, path: Path | None) -> None:
        super().__init__(logging.INFO)
        self.display = display
        self.path = path
        self.seen: set[str] = set()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
        except Exception:  # a record whose arguments do not format
            self.handleError(record)
            return
        if self.path is not None:
            from ppokit.runfolder import append_line

            with contextlib.suppress(UserError):  # the log is best effort, never the run's end
                append_line(self.path, f"{record.levelname} {record.name}: {printable(text)}")
        if record.levelno >= logging.WARNING and text not in self.seen:
            self.seen.add(text)
            first = text.strip().splitlines()[0] if text.strip() else ""
            self.display.message(f"{record.name.split('.')[0]}: {first}")


@contextlib.contextmanager
def folded_logs(display: Reporter, path: Path | None) -> Iterator[None]:
    """While the block runs, the lines of :data:`FOLDED_LOGGERS` (INFO and above) go to
    ``path`` and not to the terminal, where they would write over the live display; each
    distinct warning is also a message of ``display``, once. The loggers' levels, handlers
    and propagation are restored after."""
    handler = _Folded(display, path)
    saved = []
    for name in FOLDED_LOGGERS:
        logger = logging.getLogger(name)
        saved.append((logger, logger.level, logger.propagate))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    try:
        yield
    finally:
        for logger, level, propagate in saved:
            logger.removeHandler(handler)
            logger.setLevel(level)
            logger.propagate = propagate


def health_line(history: Sequence[dict[str, Any]]) -> str:
    """``health: entropy from round 40 (12 rounds), clipfrac from round 3 (1 round): see
    docs/health.md`` for the signs that fired in ``history``; "" when none did."""
    fired = fired_signs(history)
    parts = [
        f"{name} from round {first} ({rounds} round{'s' if rounds != 1 else ''})"
        for name, (first, rounds) in fired.items()
    ]
    return f"health: {', '.join(parts)}: see docs/health.md" if parts else ""


def _rows(history: Sequence[dict[str, Any]]) -> list[str]:
    present = {k for h in history for k, v in h.items() if _number(v) is not None}
    evals = sorted(k for k in present if k.startswith(EVAL_PREFIX))
    keys = [REWARD, *evals, *SUMMARY[1:]]
    return [k for k in keys if k in present or k == REWARD]


def summary_row(history: Sequence[dict[str, Any]], key: str) -> tuple[str, str, str]:
    """(first, last, best) of ``key`` over the rounds: first and last are the first and last
    rounds' values (``–`` where missing), best follows :func:`best_direction` (``–`` where the
    metric has no better direction or no value)."""
    values = [v for v in (_number(h.get(key)) for h in history) if v is not None]
    direction = best_direction(key)
    best = MISSING
    if direction is not None and values:
        best = fmt(max(values) if direction == "max" else min(values))
    if key.startswith(EVAL_PREFIX):  # logged every eval.every rounds: first and last logged
        first = fmt(values[0]) if values else MISSING
        last = fmt(values[-1]) if values else MISSING
        return first, last, best
    rounds = [h for h in history if h.get(ROUND) != 0]  # round 0: an evaluation only
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
