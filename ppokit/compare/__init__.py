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


The package, a module per job: ``runs`` (seeds, specs, run folders, the plan),
``progress`` (the live view or plain lines), ``scheduler`` (the processes), ``summary``
(components, labels, statistics), ``render`` (summary.md, summary.json, compare.png) and
``command`` (the command, report mode, the sweep). This module imports no torch: the runs
train in their own processes.
"""

from __future__ import annotations

from ppokit.compare.command import compare_command, discover_runs, report, run_sweep
from ppokit.compare.render import render_markdown, write_outputs
from ppokit.compare.runs import (
    SweepRun,
    SweepSpec,
    parse_seeds,
    plan_run,
    prepare_specs,
    read_history,
    read_run_spec,
    run_status,
    threads_per_job,
    train_command,
)
from ppokit.compare.scheduler import last_line
from ppokit.compare.summary import (
    RunRecord,
    component_names,
    differing_components,
    spec_labels,
    summarize,
)
from ppokit.runfolder import COMPARE_LOCK

__all__ = [
    "COMPARE_LOCK",
    "RunRecord",
    "SweepRun",
    "SweepSpec",
    "compare_command",
    "component_names",
    "differing_components",
    "discover_runs",
    "last_line",
    "parse_seeds",
    "plan_run",
    "prepare_specs",
    "read_history",
    "read_run_spec",
    "render_markdown",
    "report",
    "run_status",
    "run_sweep",
    "spec_labels",
    "summarize",
    "threads_per_job",
    "train_command",
    "write_outputs",
]
