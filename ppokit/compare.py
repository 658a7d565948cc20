"""``ppokit compare``: run specs over seeds, then summarise and plot them side by side.

``ppokit compare SPEC... --seeds 0-4 [--set k=v ...] --out DIR [--jobs N]`` runs every spec
with every seed, each run in its own ``ppokit train`` process and its own folder
``DIR/runs/<spec stem>/seed-<s>``, ``N`` at a time; then it writes ``DIR/summary.md``,
``DIR/summary.json`` and ``DIR/compare.png``. ``ppokit compare --report DIR [--add RUN_DIR]``
writes them again from the runs already there, running nothing. See docs/compare.md.

A sweep can be stopped (Ctrl-C, SIGTERM, SIGHUP) and started again with the same command:
its runs are stopped with it (each runs in its own process group, which the sweep signals
on any exit). A run folder whose ``metrics.jsonl`` holds the last round is finished and left
untouched, one with a ``checkpoint/`` is resumed (``--resume``), one with neither is started
again (``--overwrite`` when it holds files of an earlier attempt, and only files a ppokit run
writes); one another process still holds (its lock) is waited for, a bounded time. One sweep
at a time writes into an ``--out`` folder (its lock, ``.ppokit-compare-lock``).

This module imports no torch: the runs train in their own processes.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import typer
import yaml

from ppokit.errors import UserError, error_lines, fail
from ppokit.runfolder import (
    CHECKPOINT,
    COMPARE_LOCK,
    LOCK,
    METRICS,
    RUN_FILES,
    SPEC,
    TEMP_FILES,
    FolderLock,
    ensure_dir,
    io_error,
    link_error,
    open_new,
    read_bytes,
    read_json,
    read_metrics,
    read_spec_data,
    remove,
    write_atomic,
)
from ppokit.slots import SLOTS
from ppokit.spec import Spec, SpecError, load_spec
from ppokit.stats import mean_ci95

__all__ = [
    "RunRecord",
    "SweepRun",
    "compare_command",
    "component_names",
    "differing_components",
    "discover_runs",
    "parse_seeds",
    "plan_run",
    "prepare_specs",
    "report",
    "run_status",
    "run_sweep",
    "spec_labels",
    "summarize",
    "threads_per_job",
    "train_command",
    "write_outputs",
]

RUNS_DIR = "runs"
LOGS_DIR = "logs"
ERROR_FILE = "error.txt"
SUMMARY_MD = "summary.md"
SUMMARY_JSON = "summary.json"
PLOT = "compare.png"
#: Rounds at the end of a run its final values are averaged over.
FINAL_WINDOW = 5
#: At most this many seeds per sweep (a typo such as 0-10000 is refused, not launched).
MAX_SEEDS = 1000
#: Names a ppokit run writes in its output directory (ppokit/runfolder.py: its files, the
#: temporary names of its atomic writes and its lock), plus compare's own error.txt. A run
#: folder holding anything else is not replaced.
RUN_WRITES = frozenset({*RUN_FILES, *TEMP_FILES, LOCK, ERROR_FILE})
#: Sections of the spec whose presence is itself a difference (absent: "critic=none"), and
#: the slot that names the section in a label when it is present (the slot table's).
SECTION_NAME_SLOT = {s.section: s.path for s in SLOTS if s.names_section and s.section}
#: Seconds a restarted sweep waits for a run another process still holds (an interrupted
#: sweep's run finishing) before it reports it.
WAIT_BUSY = 60.0
_SEED_DIR = re.compile(r"^seed-(\d+)$")
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


# ---------------------------------------------------------------------- seeds, specs
def parse_seeds(text: str) -> list[int]:
    """Seeds from ``"3"``, ``"0-4"`` (inclusive), ``"0,2,5"`` or a mix (``"0-2,7"``).

    Order is kept and repeats dropped. Raises :class:`UserError` for anything else, for a
    negative seed and for more than MAX_SEEDS seeds.
    """
    seeds: list[int] = []
    items = [item.strip() for item in str(text).split(",")]
    if not any(items):
        raise UserError(f"--seeds {text!r}: expected seeds such as 3, 0-4 or 0,2,5")
    for item in items:
        m = re.fullmatch(r"(\d+)(?:\s*-\s*(\d+))?", item)
        if m is None:
            raise UserError(
                f"--seeds {text!r}: {item!r} is not a seed (N) or a range (A-B) of seeds >= 0"
            )
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) is not None else lo
        if hi < lo:
            raise UserError(f"--seeds {text!r}: the range {item} is empty ({hi} < {lo})")
        if hi - lo + 1 > MAX_SEEDS or len(seeds) + hi - lo + 1 > MAX_SEEDS:
            raise UserError(f"--seeds {text!r}: more than {MAX_SEEDS} seeds")
        for s in range(lo, hi + 1):
            if s not in seeds:
                seeds.append(s)
    return seeds


@dataclass(frozen=True)
class SweepSpec:
    """One spec of a sweep: its group name (the file's stem), file and validated spec."""

    name: str
    path: Path
    spec: Spec


def prepare_specs(paths: Sequence[Path], overrides: Sequence[str]) -> list[SweepSpec]:
    """Validate every spec with the overrides; every error of every spec at once.

    Raises :class:`SpecError` (one ``file: path: message`` line per error) or
    :class:`UserError` (two specs with the same stem, which would share run folders).
    """
    errors: list[str] = []
    out: list[SweepSpec] = []
    seen: dict[str, Path] = {}
    for path in paths:
        path = Path(path)
        resolved = path.resolve()
        if resolved in seen.values():
            continue  # the same file twice
        try:
            spec = load_spec(path, overrides)
        except SpecError as exc:
            where = exc.source or str(path)
            errors.extend(f"{where}: {line}" for line in exc.errors or ["invalid spec"])
            continue
        name = path.stem
        if name in seen:
            raise UserError(
                f"{seen[name]} and {path} have the same name {name!r}: their runs would share "
                f"{RUNS_DIR}/{name}/; rename one"
            )
        seen[name] = resolved
        out.append(SweepSpec(name, path, spec))
    if errors:
        raise SpecError(errors)
    if not out:
        raise UserError("no spec to run: give at least one SPEC")
    return out


def _sweep_lock(out: Path) -> FolderLock:
    """``out`` created and locked for one sweep (or report): a second one refuses."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise io_error(out, exc, "cannot create the folder") from None
    lock = FolderLock(
        out,
        COMPARE_LOCK,
        busy=f"{out} is in use by another ppokit compare: wait for it to finish or choose "
        "another --out",
    )
    lock.acquire()
    return lock


def threads_per_job(jobs: int, cores: int | None = None) -> int:
    """CPU threads for each of ``jobs`` concurrent runs: ``max(1, cores // jobs)``."""
    if cores is None:
        try:
            cores = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cores = os.cpu_count() or 1
    return max(1, cores // max(1, jobs))


# ---------------------------------------------------------------------- run folders
def read_history(run_dir: Path) -> list[dict[str, Any]]:
    """The records of ``run_dir/metrics.jsonl`` (a torn or foreign line is skipped; an
    unreadable file is none)."""
    try:
        return read_metrics(run_dir)
    except UserError:
        return []


def _last_round(run_dir: Path) -> int:
    return max((r["round"] for r in read_history(run_dir)), default=0)


def read_run_spec(run_dir: Path) -> dict[str, Any] | None:
    """The mapping of ``run_dir/spec.yaml`` (the resolved spec a run writes), or None when
    it is missing or unreadable (the run folder module's bounded reader)."""
    path = Path(run_dir) / "spec.yaml"
    if not path.is_file():
        return None
    try:
        return read_spec_data(path)
    except (UserError, SpecError):
        return None


def _spec_rounds(data: Mapping[str, Any] | None) -> int | None:
    train = data.get("train") if data else None
    rounds = train.get("rounds") if isinstance(train, dict) else None
    return rounds if isinstance(rounds, int) else None


def run_status(run_dir: Path, rounds: int) -> tuple[str, str]:
    """``(status, detail)`` of a run folder for a sweep of ``rounds`` rounds.

    - ``finished``: ``metrics.jsonl`` holds a record of round ``rounds`` (or later);
    - ``resume``: not finished, and a ``checkpoint/`` exists;
    - ``new``: the folder does not exist or is empty (error.txt aside);
    - ``overwrite``: neither, and the folder holds only files a ppokit run writes;
    - ``blocked``: the folder holds other files (named in ``detail``): it is not replaced.
    """
    run_dir = Path(run_dir)
    for folder in (run_dir.parent.parent, run_dir.parent, run_dir):
        if folder.is_symlink():  # a run there would write wherever it points
            return "blocked", str(link_error(folder))
    if not run_dir.exists():
        return "new", ""
    if not run_dir.is_dir():
        return "blocked", f"{run_dir} exists and is not a directory"
    last = _last_round(run_dir)
    if last >= rounds:
        return "finished", f"round {last}"
    if (run_dir / CHECKPOINT).is_dir():
        return "resume", f"from the checkpoint, {last} round(s) logged"
    names = {p.name for p in run_dir.iterdir()}
    foreign = sorted(names - RUN_WRITES)
    if foreign:
        shown = ", ".join(foreign[:3]) + (" ..." if len(foreign) > 3 else "")
        return "blocked", (
            f"{run_dir} holds files a ppokit run does not write ({shown}); move them away"
        )
    if names - {ERROR_FILE}:
        return "overwrite", "an earlier attempt left no checkpoint"
    return "new", ""


def _comparable(data: Mapping[str, Any]) -> dict[str, Any]:
    """A resolved spec without what may differ between attempts of one run."""
    data = json.loads(json.dumps(dict(data), default=str))
    data.pop("output", None)
    if isinstance(data.get("train"), dict):
        data["train"].pop("rounds", None)
    return data


def _first_difference(a: Any, b: Any, path: str = "") -> str | None:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in [*a, *(k for k in b if k not in a)]:
            found = _first_difference(a.get(key), b.get(key), f"{path}.{key}" if path else key)
            if found:
                return found
        return None
    if a != b:
        return f"{path or 'spec'}: {json.dumps(a)} there, {json.dumps(b)} here"
    return None


def spec_mismatch(run_dir: Path, expected: Spec) -> str | None:
    """Why the run in ``run_dir`` is not a run of ``expected`` (its spec.yaml differs in
    anything but ``output`` and ``train.rounds``), or None."""
    found = read_run_spec(run_dir)
    if found is None:
        return None
    mine = yaml.safe_load(expected.to_yaml())
    return _first_difference(_comparable(found), _comparable(mine))


# ---------------------------------------------------------------------- planning
@dataclass(eq=False)
class SweepRun:
    """One (spec, seed) run of a sweep and what happens to it."""

    name: str
    seed: int
    dir: Path
    spec_path: Path
    rounds: int
    #: skip (finished), new, resume, overwrite or blocked
    action: str
    detail: str = ""
    #: pending, running, finished, failed or interrupted
    status: str = "pending"
    error: str | None = None
    started: float | None = None
    wall: float | None = None
    log: Path | None = None

    @property
    def title(self) -> str:
        return f"{self.name} seed {self.seed}"


def plan_run(sweep: SweepSpec, seed: int, out: Path) -> SweepRun:
    """What to do with the run of ``sweep`` and ``seed`` under ``out/runs``."""
    run_dir = out / RUNS_DIR / sweep.name / f"seed-{seed}"
    rounds = sweep.spec.train.rounds
    status, detail = run_status(run_dir, rounds)
    if status in ("finished", "resume"):
        expected = sweep.spec.model_copy(update={"seed": seed})
        why = spec_mismatch(run_dir, expected)
        if why is not None:
            status, detail = (
                "blocked",
                f"{run_dir} holds a run of another spec ({why}); use another --out",
            )
    action = "skip" if status == "finished" else status
    run = SweepRun(sweep.name, seed, run_dir, sweep.path, rounds, action, detail)
    if action == "skip":
        run.status = "finished"
    elif action == "blocked":
        run.status, run.error = "failed", detail
    return run


def train_command(run: SweepRun, overrides: Sequence[str]) -> list[str]:
    """The ``ppokit train`` command line of a run."""
    argv = [sys.executable, "-m", "ppokit.cli", "train", str(run.spec_path)]
    argv += ["--seed", str(run.seed), "--out", str(run.dir)]
    for item in overrides:
        argv += ["--set", item]
    if run.action == "resume":
        argv.append("--resume")
    elif run.action == "overwrite":
        argv.append("--overwrite")
    return argv


# ---------------------------------------------------------------------- progress
def _duration(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "?"
    seconds = max(0, round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


class _Progress:
    """Counts and the estimated time left of a sweep; the views below show it."""

    def __init__(self, runs: Sequence[SweepRun], jobs: int) -> None:
        self.runs = runs
        self.jobs = jobs
        # a run finished before this sweep: its training time, a lower bound of a run's wall
        self.prior = [
            sum(h.get("time_round") or 0.0 for h in read_history(r.dir))
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
            text += f"; about {_duration(eta)} left" if eta is not None else ""
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
            cached = (size, _last_round(run.dir))
            self._rounds[path] = cached
        return cached[1]


class PlainView:
    """One plain line per run event (no terminal)."""

    def __init__(self, progress: _Progress, stream: TextIO | None = None) -> None:
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

    def __init__(self, progress: _Progress, console: Any = None) -> None:
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
                    f"round {p.round_of(r)}/{r.rounds}, {_duration(started)}",
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


# ---------------------------------------------------------------------- running
#: The line of a failed run's log that says why: ppokit's ``error: ...`` line, else the last
#: line of a traceback (``ValueError: ...``).
_ERROR_LINES = (re.compile(r"^error: "), re.compile(r"^[\w.]*(Error|Exception|Interrupt)\b.*"))
#: A line with no word in it: a table border, a rule, a progress bar.
_WORDLESS = re.compile(r"^[^\w]*$")


def _last_line(path: Path) -> str | None:
    """The line of a log that says why its run failed: the last ``error:`` line, else the
    last exception line, else the last line with a word in it (never a table border)."""
    try:
        text = read_bytes(path).decode("utf-8", errors="replace")
    except OSError:
        return None
    lines = [_ANSI.sub("", line).strip() for line in text.splitlines()]
    for pattern in _ERROR_LINES:
        for line in reversed(lines):
            if pattern.match(line):
                return line
    for line in reversed(lines):
        if line and not _WORDLESS.match(line):
            return line
    return None


def _exit_error(rc: int, stderr: Path) -> str:
    line = _last_line(stderr)
    if line:
        return line
    if rc < 0:
        try:
            return f"killed by signal {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exited with status {rc}"


def _write_error(run: SweepRun) -> None:
    try:
        ensure_dir(run.dir.parent.parent.parent, RUNS_DIR, run.name, run.dir.name)
        write_atomic(run.dir / ERROR_FILE, (run.error or "failed") + "\n")
    except UserError:
        pass  # the error is reported anyway


@dataclass
class _Child:
    proc: subprocess.Popen[bytes]
    files: list[Any] = field(default_factory=list)

    def close(self) -> None:
        for fh in self.files:
            fh.close()


def _launch(
    run: SweepRun,
    argv: list[str],
    out: Path,
    env: Mapping[str, str],
) -> _Child:
    try:
        logs = ensure_dir(out, LOGS_DIR, run.name)
        ensure_dir(out, RUNS_DIR, run.name)
    except UserError as exc:
        raise OSError(str(exc)) from None
    remove(run.dir / ERROR_FILE)  # compare's own file, of an earlier failed attempt
    stdout = open_new(logs / f"seed-{run.seed}.out")
    try:
        stderr = open_new(logs / f"seed-{run.seed}.err")
    except OSError:
        stdout.close()
        raise
    run.log = logs / f"seed-{run.seed}.err"
    kwargs: dict[str, Any] = {}
    if os.name == "posix":
        # its own process group: the sweep signals the run and all it started, on any exit
        kwargs["start_new_session"] = True
    try:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, env=dict(env), **kwargs
        )
    except OSError:
        stdout.close()
        stderr.close()
        raise
    return _Child(proc, [stdout, stderr])


def _signal(child: _Child, sig: int) -> None:
    try:
        if os.name == "posix":
            os.killpg(child.proc.pid, sig)
        elif sig == getattr(signal, "SIGKILL", None):
            child.proc.kill()
        else:
            child.proc.terminate()
    except (ProcessLookupError, PermissionError, OSError):
        pass


def _stop_all(running: Mapping[SweepRun, _Child], grace: float, stop: _StopSignals) -> None:
    """SIGINT to every run's process group (SIGTERM where the sweep ignores SIGINT, so do
    its runs), then SIGKILL to any still alive after ``grace`` seconds or at a second stop
    signal. A stopped run leaves nothing half-written that matters: checkpoints are written
    atomically, and resuming drops the metrics lines logged after the last one."""
    for child in running.values():
        _signal(child, signal.SIGTERM if stop.sigint_ignored else signal.SIGINT)
    deadline = time.monotonic() + grace
    asked = stop.count
    while time.monotonic() < deadline and stop.count <= asked:
        if all(child.proc.poll() is not None for child in running.values()):
            break
        time.sleep(0.05)
    for child in running.values():
        if child.proc.poll() is None:
            _signal(child, getattr(signal, "SIGKILL", signal.SIGTERM))
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.proc.wait(timeout=5)
        child.close()


class _StopSignals:
    """While active, SIGINT (Ctrl-C), SIGTERM and SIGHUP to the sweep ask it to stop: they
    count up a flag the loop reads (main thread only), so no signal lands between starting a
    run and recording it. A SIGINT the sweep was started to ignore stays ignored."""

    def __init__(self) -> None:
        self.count = 0
        self.old: dict[int, Any] = {}
        self.sigint_ignored = signal.getsignal(signal.SIGINT) is signal.SIG_IGN

    def __enter__(self) -> _StopSignals:
        for name in ("SIGINT", "SIGTERM", "SIGHUP"):
            sig = getattr(signal, name, None)
            if sig is None or (sig == signal.SIGINT and self.sigint_ignored):
                continue
            with contextlib.suppress(ValueError, OSError):  # not the main thread
                self.old[sig] = signal.signal(sig, self._handler)
        return self

    def _handler(self, signum: int, frame: Any) -> None:
        self.count += 1

    def __exit__(self, *exc: Any) -> None:
        for sig, old in self.old.items():
            signal.signal(sig, old)


def execute(
    runs: Sequence[SweepRun],
    out: Path,
    overrides: Sequence[str],
    jobs: int = 1,
    *,
    view: PlainView | None = None,
    command: Callable[[SweepRun, Sequence[str]], list[str]] = train_command,
    poll: float = 0.2,
    grace: float = 10.0,
    wait_busy: float = WAIT_BUSY,
) -> bool:
    """Run the runs to launch (``action`` new, resume or overwrite), ``jobs`` at a time.

    Each run's stdout and stderr go to ``out/logs/<spec>/seed-<s>.out|.err``; a failed run's
    error (its ``error:`` line, see :func:`_last_line`) to ``run.error`` and
    ``RUN_DIR/error.txt``. A run whose folder another process holds (an interrupted sweep's
    run still finishing) is waited for, up to ``wait_busy`` seconds, then planned again.
    Returns False when interrupted (Ctrl-C, SIGTERM or SIGHUP: every running run is stopped
    and marked ``interrupted``), True otherwise. The runs never outlive the sweep: they are
    stopped on any exit of this function.
    """
    progress = view.progress if view is not None else _Progress(runs, jobs)
    view = view or PlainView(progress)
    threads = str(threads_per_job(jobs))
    env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    pending = deque(r for r in runs if r.status == "pending")
    running: dict[SweepRun, _Child] = {}
    waiting: dict[SweepRun, float] = {}
    view.start()
    for r in runs:
        if r.action == "skip":
            view.event(r, "finished already")
        elif r.action == "blocked":
            view.event(r, "blocked")
    with _StopSignals() as stop:
        try:
            while (pending or running or waiting) and not stop.count:
                for run, deadline in list(waiting.items()):
                    if _waited(run, deadline, wait_busy, pending, view):
                        del waiting[run]
                while pending and len(running) < jobs and not stop.count:
                    run = pending.popleft()
                    if FolderLock(run.dir).held_elsewhere():
                        waiting[run] = time.monotonic() + wait_busy
                        view.event(run, "waiting (in use by another process)")
                        continue
                    run.status, run.started = "running", time.perf_counter()
                    try:
                        running[run] = _launch(run, command(run, overrides), out, env)
                    except OSError as exc:
                        run.status, run.error = "failed", f"could not start: {exc}"
                        _write_error(run)
                        view.event(run, "failed")
                        continue
                    view.event(run, {"resume": "resumed"}.get(run.action, "started"))
                for run, child in list(running.items()):
                    rc = child.proc.poll()
                    if rc is None:
                        continue
                    child.close()
                    del running[run]
                    run.wall = time.perf_counter() - (run.started or time.perf_counter())
                    _finish(run, rc)
                    view.event(run, run.status)
                view.refresh()
                if pending or running or waiting:
                    time.sleep(poll)
        except KeyboardInterrupt:  # not the main thread, where the signals are not ours
            stop.count += 1
        finally:
            if running:  # stopped, or an error of the sweep itself: the runs end with it
                _stop_all(running, grace, stop)
    if not stop.count:
        view.stop()
        return True
    for run in [*running, *pending, *waiting]:
        run.status = "interrupted"
    for run in running:
        run.wall = time.perf_counter() - (run.started or time.perf_counter())
        if _last_round(run.dir) >= run.rounds:
            run.status = "finished"  # it got to its last round before it stopped
    view.stop()
    return False


def _waited(
    run: SweepRun, deadline: float, wait_busy: float, pending: deque[SweepRun], view: PlainView
) -> bool:
    """Whether the wait for ``run``'s folder is over: free (the run is planned again from
    what is there now) or past ``deadline`` (failed, naming the folder's holder)."""
    if FolderLock(run.dir).held_elsewhere():
        if time.monotonic() < deadline:
            return False
        run.status = "failed"
        run.error = (
            f"{run.dir} is still in use by another ppokit run after {wait_busy:.0f} s (an "
            "earlier sweep's run still finishing?); run the command again when it has ended"
        )
        view.event(run, "failed")
        return True
    status, detail = run_status(run.dir, run.rounds)
    if status == "finished":
        run.action, run.status = "skip", "finished"
        view.event(run, "finished already")
    elif status == "blocked":
        run.action, run.status, run.error = "blocked", "failed", detail
        view.event(run, "blocked")
    else:
        run.action = status
        pending.appendleft(run)
    return True


def _finish(run: SweepRun, rc: int) -> None:
    if rc == 0:
        last = _last_round(run.dir)
        if last >= run.rounds:
            run.status = "finished"
            return
        run.status = "failed"
        run.error = f"exited after round {last} of {run.rounds} without an error"
    else:
        run.status = "failed"
        run.error = _exit_error(rc, run.log) if run.log else f"exited with status {rc}"
    _write_error(run)


# ---------------------------------------------------------------------- components, labels
def _name_of(value: Any, default: str) -> str:
    if value is None:
        return default
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        return str(value.get("name", default))
    if isinstance(value, list):
        return "+".join(_name_of(v, default) for v in value) or default
    return str(value)


def component_names(data: Mapping[str, Any]) -> dict[str, str | None]:
    """The component of every slot of a (resolved) spec mapping, by slot path.

    Paths come from :data:`ppokit.slots.SLOTS` (``advantage``, ``critic.loss``, ...), plus one
    key per optional section (``critic``, ``kl``): ``None`` when the section is absent (its
    slots are then ``None`` too), else the section's naming slot (``critic.loss``,
    ``kl.estimator``). Several rewards are joined with ``+``. A slot the mapping leaves out
    holds its default.
    """
    names: dict[str, str | None] = {}
    for s in SLOTS:
        if s.section is None:
            names[s.path] = _name_of(data.get(s.path), s.default)
            continue
        section = data.get(s.section, {} if s.section not in SECTION_NAME_SLOT else None)
        names[s.path] = (
            _name_of(section.get(s.key), s.default) if isinstance(section, dict) else None
        )
    for sec, slot_path in SECTION_NAME_SLOT.items():
        names[sec] = names.get(slot_path)
    return names


def differing_components(
    components: Mapping[str, Mapping[str, str | None]],
) -> dict[str, list[tuple[str, str]]]:
    """Per group, the ``(slot, component)`` pairs in which the groups differ.

    A section present in some groups only (``critic``, ``kl``) shows as ``critic=none`` where
    absent and ``critic=<its loss>`` (``kl=<its estimator>``) where present; the slots inside
    it are compared among the groups that have it. Other slots show where any two groups
    hold different components.
    """
    groups = list(components)
    items: dict[str, list[tuple[str, str]]] = {g: [] for g in groups}
    if len(groups) < 2:
        return items
    shown: set[str] = set()
    for s in SLOTS:
        sec = s.section if s.section in SECTION_NAME_SLOT else None
        if sec is not None:
            present = [g for g in groups if components[g].get(sec) is not None]
            if 0 < len(present) < len(groups):
                if sec not in shown:
                    shown.add(sec)
                    for g in groups:
                        items[g].append((sec, components[g].get(sec) or "none"))
                if s.path == SECTION_NAME_SLOT[sec]:
                    continue
                if len({components[g].get(s.path) for g in present}) > 1:
                    for g in present:
                        items[g].append((s.path, str(components[g].get(s.path))))
                continue
        if len({components[g].get(s.path) for g in groups}) > 1:
            for g in groups:
                items[g].append((s.path, components[g].get(s.path) or "none"))
    return items


def spec_labels(components: Mapping[str, Mapping[str, str | None]]) -> dict[str, str]:
    """``"grpo (advantage=grpo, critic=none)"``: each group's name and what sets it apart.

    With three or more groups, a slot whose component is the one most groups share (a
    single most common value) is left out of the groups that hold it, so that each label
    names what is particular to its spec.
    """
    diff = differing_components(components)
    counts: dict[str, Counter[str]] = {}
    for items in diff.values():
        for key, value in items:
            counts.setdefault(key, Counter())[value] += 1

    def common(key: str, value: str) -> bool:
        ranked = counts[key].most_common(2)
        top, n = ranked[0]
        unique = len(ranked) == 1 or ranked[1][1] < n
        return len(diff) > 2 and n > 1 and unique and value == top

    labels = {}
    for g, items in diff.items():
        own = [(k, v) for k, v in items if not common(k, v)]
        labels[g] = g + (f" ({', '.join(f'{k}={v}' for k, v in own)})" if own else "")
    return labels


# ---------------------------------------------------------------------- summary
@dataclass
class RunRecord:
    """A run as the summary sees it."""

    group: str
    seed: int | None
    dir: Path
    #: finished, failed, interrupted or incomplete
    status: str
    rounds: int | None
    error: str | None = None
    history: list[dict[str, Any]] = field(default_factory=list)
    spec: dict[str, Any] | None = None


def _final(history: Sequence[Mapping[str, Any]], key: str) -> float | None:
    """Mean of ``key`` over the last FINAL_WINDOW rounds; a metric logged in none of them
    (an evaluation every k > FINAL_WINDOW rounds) takes its last logged value."""
    if not history:
        return None
    last = history[-1]["round"]
    window = [h[key] for h in history if h["round"] > last - FINAL_WINDOW and _number(h.get(key))]
    if window:
        return math.fsum(window) / len(window)
    logged = [h[key] for h in history if _number(h.get(key))]
    return logged[-1] if logged else None


def _number(value: Any) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(float(value))
    )


def _eval_keys(records: Sequence[RunRecord]) -> list[str]:
    keys = {
        k
        for r in records
        for h in r.history
        for k, v in h.items()
        if k.startswith("eval/") and _number(v)
    }
    return sorted(keys, key=lambda k: (k != "eval/accuracy", k))


def _stat(values: Sequence[float]) -> dict[str, Any]:
    if not values:
        return {"mean": None, "ci95": None, "n": 0, "values": []}
    mean, half = mean_ci95(values)
    return {
        "mean": mean,
        "ci95": half if math.isfinite(half) else None,
        "n": len(values),
        "values": list(values),
    }


def run_metrics(history: Sequence[Mapping[str, Any]], threshold: float) -> dict[str, Any]:
    """One run's numbers: final reward and eval metrics, rounds to the threshold, wall time
    (Σ time_round), mean tokens/s."""
    hist = sorted(history, key=lambda h: h["round"])
    reached = next(
        (
            h["round"]
            for h in hist
            if _number(h.get("reward_mean")) and h["reward_mean"] >= threshold
        ),
        None,
    )
    tps = [h["tokens_per_s"] for h in hist if _number(h.get("tokens_per_s"))]
    evals = sorted({k for h in hist for k, v in h.items() if k.startswith("eval/") and _number(v)})
    return {
        "rounds": hist[-1]["round"] if hist else 0,
        "final_reward": _final(hist, "reward_mean"),
        "eval": {k: _final(hist, k) for k in evals},
        "rounds_to_threshold": reached,
        "wall_time_s": math.fsum(h["time_round"] for h in hist if _number(h.get("time_round"))),
        "tokens_per_s": math.fsum(tps) / len(tps) if tps else None,
    }


def _trim(history: Sequence[dict[str, Any]], rounds: int | None) -> list[dict[str, Any]]:
    return [h for h in history if rounds is None or h["round"] <= rounds]


def summarize(
    records: Sequence[RunRecord],
    threshold: float = 0.9,
    order: Sequence[str] | None = None,
    specs: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """The content of summary.json: per group (spec) the statistics over its finished runs.

    ``order`` fixes the order of the groups it names (the others follow, first seen first);
    ``specs`` gives a group's
    spec mapping when none of its runs has a spec.yaml.
    """
    present = {r.group for r in records}
    groups: dict[str, list[RunRecord]] = {g: [] for g in order or () if g in present}
    for r in records:
        groups.setdefault(r.group, []).append(r)
    evals = _eval_keys(records)
    components = {}
    for g, runs in groups.items():
        found = next((r.spec for r in runs if r.status == "finished" and r.spec), None)
        found = found or next((r.spec for r in runs if r.spec), None)
        found = found or (specs or {}).get(g)
        if found:  # a group whose spec is unknown (no spec.yaml) is labelled by its name
            components[g] = component_names(found)
    labels = {g: g for g in groups} | spec_labels(components)
    diff: dict[str, list[tuple[str, str]]] = {g: [] for g in groups}
    diff.update(differing_components(components))
    out_groups = []
    for g, runs in groups.items():
        per_run = []
        for r in sorted(runs, key=lambda r: (r.seed is None, r.seed or 0, str(r.dir))):
            m = run_metrics(_trim(r.history, r.rounds), threshold) if r.history else None
            per_run.append(
                {
                    "seed": r.seed,
                    "dir": str(r.dir),
                    "status": r.status,
                    "error": r.error,
                    **(m or {"rounds": 0}),
                }
            )
        done = [p for p in per_run if p["status"] == "finished"]
        reached = [p["rounds_to_threshold"] for p in done if p["rounds_to_threshold"] is not None]
        out_groups.append(
            {
                "name": g,
                "label": labels[g],
                "differs": dict(diff[g]),
                "components": components.get(g),
                "runs_total": len(per_run),
                "finished": len(done),
                "failed": sum(p["status"] == "failed" for p in per_run),
                "other": sum(p["status"] not in ("finished", "failed") for p in per_run),
                "final_reward": _stat(
                    [p["final_reward"] for p in done if p["final_reward"] is not None]
                ),
                "eval": {
                    k: _stat([p["eval"][k] for p in done if p["eval"].get(k) is not None])
                    for k in evals
                },
                "rounds_to_threshold": {
                    "mean": math.fsum(reached) / len(reached) if reached else None,
                    "reached": len(reached),
                    "of": len(done),
                    "values": reached,
                },
                "wall_time_s": _stat([p["wall_time_s"] for p in done]),
                "tokens_per_s": _stat(
                    [p["tokens_per_s"] for p in done if p["tokens_per_s"] is not None]
                ),
                "runs": per_run,
            }
        )
    return {
        "threshold": threshold,
        "final_window": FINAL_WINDOW,
        "eval_metrics": evals,
        "specs": out_groups,
    }


def _fmt(x: float | None, digits: int = 3) -> str:
    if x is None:
        return "-"
    if abs(x) >= 1000:
        return f"{x:.0f}"
    return f"{x:.{digits}g}" if abs(x) >= 1 else f"{x:.{digits}f}"


def _fmt_stat(stat: Mapping[str, Any]) -> str:
    if stat["mean"] is None:
        return "-"
    if stat["ci95"] is None:
        return f"{_fmt(stat['mean'])} (n=1)"
    return f"{_fmt(stat['mean'])} ± {_fmt(stat['ci95'])}"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_markdown(summary: Mapping[str, Any], title: str = "ppokit compare") -> str:
    """summary.md: one row per spec, then one row per run."""
    thr = summary["threshold"]
    evals = summary["eval_metrics"]
    head = [
        "spec",
        "differs in",
        "runs (finished/failed/total)",
        "final reward",
        *evals,
        f"rounds to reward ≥ {thr:g} (reached)",
        "wall time s",
        "tokens/s",
    ]
    lines = [f"# {title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for g in summary["specs"]:
        rt = g["rounds_to_threshold"]
        differs = ", ".join(f"{k}={v}" for k, v in g["differs"].items()) or "-"
        row = [
            g["name"],
            differs,
            f"{g['finished']}/{g['failed']}/{g['runs_total']}",
            _fmt_stat(g["final_reward"]),
            *(_fmt_stat(g["eval"][k]) for k in evals),
            f"{_fmt(rt['mean'])} ({rt['reached']}/{rt['of']})",
            _fmt_stat(g["wall_time_s"]),
            _fmt_stat(g["tokens_per_s"]),
        ]
        lines.append("| " + " | ".join(_cell(c) for c in row) + " |")
    lines += [
        "",
        f"final reward: each run's mean `reward_mean` over its last {summary['final_window']} "
        "rounds; mean over the spec's finished runs (seeds) ± the half-width of the two-sided "
        "95% Student-t confidence interval (n=1: a single run, no interval). `eval/...` "
        "columns likewise (a metric logged in none of the last rounds: its last value). "
        f"rounds to reward ≥ {thr:g}: the first round whose `reward_mean` reaches it, mean over "
        "the runs that reached it (how many of the finished runs did). wall time: Σ "
        "`time_round` of a run; tokens/s: a run's mean `tokens_per_s`; both mean ± 95% CI over "
        "runs.",
        "",
        "## Runs",
        "",
        "| spec | seed | status | rounds | final reward | wall time s | error | folder |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for g in summary["specs"]:
        for r in g["runs"]:
            row = [
                g["name"],
                "-" if r["seed"] is None else str(r["seed"]),
                r["status"],
                str(r.get("rounds", 0)),
                _fmt(r.get("final_reward")),
                _fmt(r.get("wall_time_s")),
                r["error"] or "",
                r["dir"],
            ]
            lines.append("| " + " | ".join(_cell(c) for c in row) + " |")
    return "\n".join(lines) + "\n"


def _curve(runs: Sequence[RunRecord], key: str) -> tuple[list[int], list[float], list[float]]:
    """Per round: mean and 95% CI half-width (0 for one run) of ``key`` over the runs."""
    by_round: dict[int, list[float]] = {}
    for r in runs:
        for h in _trim(r.history, r.rounds):
            if _number(h.get(key)):
                by_round.setdefault(h["round"], []).append(float(h[key]))
    xs = sorted(by_round)
    means, halves = [], []
    for x in xs:
        mean, half = mean_ci95(by_round[x])
        means.append(mean)
        halves.append(half if math.isfinite(half) else 0.0)
    return xs, means, halves


def plot(
    records: Sequence[RunRecord], summary: Mapping[str, Any], path: Path, title: str = ""
) -> bool:
    """compare.png: reward_mean against the round, per spec the mean over its finished runs
    with a shaded 95% CI band, one colour per spec; a second panel for an eval metric when
    any run logs one. Returns False when there is nothing to plot."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    finished = [r for r in records if r.status == "finished" and r.history]
    if not finished:
        return False
    evals = summary["eval_metrics"]
    keys = ["reward_mean", *evals[:1]]
    n_specs = len(summary["specs"])
    fig = Figure(figsize=(7 * len(keys), 4.5 + 0.22 * n_specs))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(keys), squeeze=False)[0]
    colours: list[Any] = [f"C{i}" for i in range(n_specs)]
    if n_specs > 10:  # ten colours repeat: take twenty
        from matplotlib import colormaps

        colours = [colormaps["tab20"](i % 20) for i in range(n_specs)]
    for ax, key in zip(axes, keys, strict=True):
        for colour, g in zip(colours, summary["specs"], strict=True):
            runs = [r for r in finished if r.group == g["name"]]
            xs, means, halves = _curve(runs, key)
            if not xs:
                continue
            n = len(runs)
            ax.plot(
                xs,
                means,
                color=colour,
                linewidth=1.5,
                marker="." if len(xs) <= 30 else None,
                label=f"{g['label']} (n={n})",
            )
            ax.fill_between(
                xs,
                [m - h for m, h in zip(means, halves, strict=True)],
                [m + h for m, h in zip(means, halves, strict=True)],
                color=colour,
                alpha=0.2,
                linewidth=0,
            )
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("round")
        ax.set_ylabel(key)
        ax.set_title(f"{key}: mean over seeds, shaded 95% CI", fontsize=10)
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.suptitle(title or "ppokit compare")
    fig.legend(handles, labels, loc="lower center", fontsize=8, ncol=1, frameon=False)
    fig.tight_layout(rect=(0, 0.22 * n_specs / (4.5 + 0.22 * n_specs) + 0.02, 1, 1))
    write_atomic(path, lambda fh: fig.savefig(fh, format="png", dpi=100))
    return True


def write_outputs(
    out: Path,
    records: Sequence[RunRecord],
    threshold: float,
    order: Sequence[str] | None = None,
    specs: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """Write summary.json, summary.md and compare.png into ``out``; returns the summary."""
    summary = summarize(records, threshold, order, specs)
    text = json.dumps(_json_safe(summary), indent=2) + "\n"
    write_atomic(out / SUMMARY_JSON, text)
    write_atomic(out / SUMMARY_MD, render_markdown(summary))
    n = max((g["runs_total"] for g in summary["specs"]), default=0)
    plot(records, summary, out / PLOT, title=f"ppokit compare: {out.name} (up to {n} seed(s))")
    return summary


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


# ---------------------------------------------------------------------- report mode
def _record_of(run_dir: Path, group: str, seed: int | None) -> RunRecord:
    spec = read_run_spec(run_dir)
    rounds = _spec_rounds(spec)
    history = read_history(run_dir)
    last = max((h["round"] for h in history), default=0)
    error_file = run_dir / ERROR_FILE
    if spec is not None and isinstance(spec.get("seed"), int):
        seed = spec["seed"]
    if rounds is not None and last >= rounds:
        status, error = "finished", None
    elif error_file.is_file():
        status, error = "failed", _last_line(error_file)
    else:
        status, error = "incomplete", None
    return RunRecord(group, seed, run_dir, status, rounds, error, history, spec)


def _is_run_dir(path: Path) -> bool:
    return path.is_dir() and any(
        (path / name).exists() for name in (METRICS, SPEC, CHECKPOINT, ERROR_FILE)
    )


def discover_runs(out: Path) -> list[RunRecord]:
    """Every run folder of a sweep: ``out/runs/<group>/<run>`` (``seed-N`` or any name)."""
    root = out / RUNS_DIR
    records = []
    if not root.is_dir():
        return records
    for group in sorted(p for p in root.iterdir() if p.is_dir()):
        for run_dir in sorted(p for p in group.iterdir() if _is_run_dir(p)):
            m = _SEED_DIR.match(run_dir.name)
            records.append(_record_of(run_dir, group.name, int(m.group(1)) if m else None))
    return records


def _added_run(text: str) -> RunRecord:
    """``[LABEL=]RUN_DIR``: a run folder from elsewhere, grouped under LABEL, else under the
    parent folder's name when the folder is named ``seed-N``, else its own name."""
    label, sep, rest = text.partition("=")
    if sep and label and "/" not in label and os.sep not in label:
        run_dir = Path(rest)
    else:
        label, run_dir = "", Path(text)
    run_dir = run_dir.expanduser()
    if not run_dir.is_dir():
        raise UserError(f"--add {text}: {run_dir} is not a directory")
    if not _is_run_dir(run_dir):
        raise UserError(f"--add {text}: {run_dir} is not a ppokit run folder (no metrics.jsonl)")
    m = _SEED_DIR.match(run_dir.resolve().name)
    group = label or (run_dir.resolve().parent.name if m else run_dir.resolve().name)
    return _record_of(run_dir, group, int(m.group(1)) if m else None)


def report(
    directory: Path, add: Sequence[str] = (), threshold: float = 0.9, out: Path | None = None
) -> dict[str, Any]:
    """Summary and plot of the runs under ``directory/runs`` plus the ``add``-ed run folders,
    written into ``out`` (default: ``directory``). Runs nothing."""
    directory = Path(directory)
    if not directory.is_dir():
        raise UserError(f"--report {directory}: not a directory")
    records = discover_runs(directory) + [_added_run(a) for a in add]
    if not records:
        raise UserError(f"no runs found under {directory / RUNS_DIR} (and none added with --add)")
    target = Path(out) if out is not None else directory
    lock = _sweep_lock(target)
    try:
        return write_outputs(target, records, threshold, _previous_order(directory))
    finally:
        lock.release()


def _previous_order(directory: Path) -> list[str]:
    """The order of the specs in ``directory/summary.json`` (the sweep's order), if any."""
    try:
        data = read_json(directory / SUMMARY_JSON)
        return [str(g["name"]) for g in data["specs"]]
    except (OSError, ValueError, KeyError, TypeError):
        return []


# ---------------------------------------------------------------------- sweep
def run_sweep(
    paths: Sequence[Path],
    seeds: Sequence[int],
    out: Path,
    overrides: Sequence[str] = (),
    jobs: int = 1,
    threshold: float = 0.9,
    *,
    live: bool | None = None,
    command: Callable[[SweepRun, Sequence[str]], list[str]] = train_command,
    stream: TextIO | None = None,
    grace: float = 10.0,
    wait_busy: float = WAIT_BUSY,
) -> tuple[dict[str, Any], list[SweepRun], bool]:
    """Validate, plan and run a sweep, then write its summary and plot.

    Returns ``(summary, runs, completed)``; ``completed`` is False when it was interrupted.
    Raises :class:`UserError`/:class:`SpecError` before launching anything for a spec that does
    not validate, bad seeds, an output folder that cannot be written or that another sweep
    holds (the lock is held until the summary is written).
    """
    if jobs < 1:
        raise UserError(f"--jobs {jobs}: needs at least 1")
    sweep_specs = prepare_specs(paths, overrides)
    out = Path(out).expanduser()
    lock = _sweep_lock(out)
    try:
        runs = [plan_run(s, seed, out) for s in sweep_specs for seed in seeds]
        if live is None:
            live = sys.stdout.isatty()
        view: PlainView = (
            LiveView(_Progress(runs, jobs)) if live else PlainView(_Progress(runs, jobs), stream)
        )
        completed = execute(
            runs, out, overrides, jobs, view=view, command=command, grace=grace, wait_busy=wait_busy
        )
        return _summary(sweep_specs, runs, out, threshold), runs, completed
    finally:
        lock.release()


def _summary(
    sweep_specs: list[SweepSpec], runs: list[SweepRun], out: Path, threshold: float
) -> dict[str, Any]:
    """The sweep's summary.json, summary.md and compare.png, written; the summary."""
    records = [
        RunRecord(
            r.name,
            r.seed,
            r.dir,
            r.status,
            r.rounds,
            r.error,
            read_history(r.dir) if r.status == "finished" else [],
            read_run_spec(r.dir) if r.status == "finished" else None,
        )
        for r in runs
    ]
    specs = {s.name: yaml.safe_load(s.spec.to_yaml()) for s in sweep_specs}
    return write_outputs(out, records, threshold, [s.name for s in sweep_specs], specs)


# ---------------------------------------------------------------------- command
def compare_command(
    specs: list[Path] | None = typer.Argument(
        None, help="Spec files (YAML) to compare.", metavar="SPEC..."
    ),
    seeds: str = typer.Option("0-2", "--seeds", help="Seeds: 3, 0-4 or 0,2,5."),
    overrides: list[str] = typer.Option(
        [], "--set", "-s", help="Override a value of every spec: path=value (repeatable)."
    ),
    out_dir: Path | None = typer.Option(
        None, "--out", help="Sweep folder: runs/, logs/, summary.md, summary.json, compare.png."
    ),
    jobs: int = typer.Option(1, "--jobs", "-j", min=1, help="Runs at a time."),
    threshold: float = typer.Option(
        0.9, "--threshold", help="Reward the 'rounds to threshold' column counts up to."
    ),
    report_dir: Path | None = typer.Option(
        None, "--report", help="Write the summary and plot of the runs in DIR; run nothing."
    ),
    add: list[str] = typer.Option(
        [], "--add", help="With --report: a run folder from elsewhere, [LABEL=]RUN_DIR."
    ),
) -> None:
    """Run specs over seeds and compare them: summary.md, summary.json and compare.png.

    Each spec runs once per seed in its own 'ppokit train' process and folder
    (OUT/runs/<spec>/seed-<s>). Stop it with Ctrl-C and run the same command again to go on:
    finished runs are kept, interrupted ones resume from their checkpoint.
    """
    try:
        if report_dir is not None:
            if specs:
                raise UserError("--report re-renders existing runs: give no SPEC")
            summary = report(report_dir, add, threshold, out_dir)
            target = out_dir or report_dir
            typer.echo(f"wrote {target / SUMMARY_MD}, {target / SUMMARY_JSON}, {target / PLOT}")
            _print_table(summary)
            return
        if add:
            raise UserError("--add adds runs to a --report")
        if not specs:
            raise UserError("give at least one SPEC (or --report DIR)")
        if out_dir is None:
            raise UserError("--out DIR is required: where the runs and the summary go")
        seed_list = parse_seeds(seeds)
        summary, runs, completed = run_sweep(specs, seed_list, out_dir, overrides, jobs, threshold)
    except (UserError, SpecError) as exc:
        raise fail(error_lines(exc)) from None
    _print_table(summary)
    typer.echo(f"wrote {out_dir / SUMMARY_MD}, {out_dir / SUMMARY_JSON}, {out_dir / PLOT}")
    if not completed:
        stopped = sum(r.status == "interrupted" for r in runs)
        raise fail(
            [f"interrupted: {stopped} run(s) stopped; run the same command again to go on"], 130
        )
    failed = [r for r in runs if r.status == "failed"]
    if failed:
        raise fail(
            [f"{r.title}: {r.error}" for r in failed]
            + [f"{len(failed)} of {len(runs)} run(s) failed (logs in {out_dir / LOGS_DIR})"]
        )


def _print_table(summary: Mapping[str, Any]) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    evals = summary["eval_metrics"]
    table = Table(box=None, pad_edge=False)
    for col in ("spec", "finished", "failed", "final reward", *evals, "rounds to thr", "wall s"):
        table.add_column(col, justify="left" if col == "spec" else "right")
    for g in summary["specs"]:
        rt = g["rounds_to_threshold"]
        table.add_row(
            escape(g["label"]),
            str(g["finished"]),
            str(g["failed"]),
            _fmt_stat(g["final_reward"]),
            *(_fmt_stat(g["eval"][k]) for k in evals),
            f"{_fmt(rt['mean'])} ({rt['reached']}/{rt['of']})",
            _fmt_stat(g["wall_time_s"]),
        )
    Console(highlight=False, soft_wrap=True).print(table)
