"""``ppokit compare``: the command, its report mode (runs already there) and the sweep
(run, then summarise). Torch-free."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

import typer
import yaml

from ppokit.compare.progress import LiveView, PlainView, Progress
from ppokit.compare.render import fmt, fmt_stat, write_outputs
from ppokit.compare.runs import (
    ERROR_FILE,
    LOGS_DIR,
    PLOT,
    RUNS_DIR,
    SEED_DIR,
    SUMMARY_JSON,
    SUMMARY_MD,
    WAIT_BUSY,
    SweepRun,
    SweepSpec,
    parse_seeds,
    plan_run,
    prepare_specs,
    read_history,
    read_run_spec,
    spec_rounds,
    sweep_lock,
    train_command,
)
from ppokit.compare.scheduler import execute, last_line
from ppokit.compare.study import STUDY_MD, is_study, run_study
from ppokit.compare.summary import RunRecord, signs_text
from ppokit.errors import UserError, error_lines, fail
from ppokit.metrics_table import ROUND
from ppokit.runfolder import (
    CHECKPOINT,
    METRICS,
    SPEC,
    read_json,
)
from ppokit.spec import SpecError


# ---------------------------------------------------------------------- report mode
def _record_of(run_dir: Path, group: str, seed: int | None) -> RunRecord:
    spec = read_run_spec(run_dir)
    rounds = spec_rounds(spec)
    history = read_history(run_dir)
    last = max((h[ROUND] for h in history), default=0)
    error_file = run_dir / ERROR_FILE
    if spec is not None and isinstance(spec.get("seed"), int):
        seed = spec["seed"]
    if rounds is not None and last >= rounds:
        status, error = "finished", None
    elif error_file.is_file():
        status, error = "failed", last_line(error_file)
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
    records: list[RunRecord] = []
    if not root.is_dir():
        return records
    for group in sorted(p for p in root.iterdir() if p.is_dir()):
        for run_dir in sorted(p for p in group.iterdir() if _is_run_dir(p)):
            m = SEED_DIR.match(run_dir.name)
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
    m = SEED_DIR.match(run_dir.resolve().name)
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
    lock = sweep_lock(target)
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
    lock = sweep_lock(out)
    try:
        runs = [plan_run(s, seed, out) for s in sweep_specs for seed in seeds]
        if live is None:
            live = sys.stdout.isatty()
        view: PlainView = (
            LiveView(Progress(runs, jobs)) if live else PlainView(Progress(runs, jobs), stream)
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
    records = [RunRecord.of(r) for r in runs]
    specs = {s.name: yaml.safe_load(s.spec.to_yaml()) for s in sweep_specs}
    return write_outputs(out, records, threshold, [s.name for s in sweep_specs], specs)


# ---------------------------------------------------------------------- command
def compare_command(
    specs: list[Path] | None = typer.Argument(
        None,
        help="Spec files (YAML), or variant names (on the demo task or --task), to compare.",
        metavar="SPEC...",
    ),
    seeds: str = typer.Option("0-2", "--seeds", help="Seeds: 3, 0-4 or 0,2,5."),
    task: str | None = typer.Option(
        None, "--task", help="Run every spec on this task (as --set task=TASK)."
    ),
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
        if len(specs) == 1 and is_study(specs[0]):  # a study: its seeds, arms and verdict
            summary, result, runs, completed = run_study(
                specs[0],
                out_dir,
                lambda arms, seed_list, out: run_sweep(
                    arms, seed_list, out, overrides, jobs, threshold
                ),
            )
            typer.echo(f"{result['study']}: {result['verdict']} ({result['rule']}; {STUDY_MD})")
        else:
            seed_list = parse_seeds(seeds)
            if task is not None:
                overrides = [*overrides, f"task={task}"]
            summary, runs, completed = run_sweep(
                specs, seed_list, out_dir, overrides, jobs, threshold
            )
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

    from ppokit.trainer.display import console_width

    evals = summary["eval_metrics"]
    table = Table(box=None, pad_edge=False)
    columns = ("spec", "finished", "failed", "final reward", *evals, "rounds to thr", "wall s")
    for col in (*columns, "health signs"):
        table.add_column(col, justify="left" if col == "spec" else "right")
    for g in summary["specs"]:
        rt = g["rounds_to_threshold"]
        table.add_row(
            escape(g["label"]),
            str(g["finished"]),
            str(g["failed"]),
            fmt_stat(g["final_reward"]),
            *(fmt_stat(g["eval"][k]) for k in evals),
            f"{fmt(rt['mean'])} ({rt['reached']}/{rt['of']})",
            fmt_stat(g["wall_time_s"]),
            escape(signs_text(g.get("signs", {}), g["finished"])),
        )
    Console(highlight=False, soft_wrap=True, width=console_width()).print(table)
