"""Seeds, specs, run folders and the plan of a sweep: what ``ppokit compare`` runs where,
and the status of a run folder. Torch-free."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ppokit.children import python_command
from ppokit.errors import UserError
from ppokit.metrics_table import ROUND
from ppokit.runfolder import (
    CHECKPOINT,
    COMPARE_LOCK,
    LOCK,
    RUN_FILES,
    TEMP_FILES,
    FolderLock,
    io_error,
    link_error,
    read_metrics,
    read_spec_data,
)
from ppokit.slots import SLOTS
from ppokit.spec import Spec, SpecError, load_spec

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
#: Names a ppokit run writes in its output directory (ppokit/runfolder/names.py: its files, the
#: temporary names of its atomic writes and its lock), plus compare's own error.txt. A run
#: folder holding anything else is not replaced.
RUN_WRITES = frozenset({*RUN_FILES, *TEMP_FILES, LOCK, ERROR_FILE})
#: Sections of the spec whose presence is itself a difference (absent: "critic=none"), and
#: the slot that names the section in a label when it is present (the slot table's).
SECTION_NAME_SLOT = {s.section: s.path for s in SLOTS if s.names_section and s.section}
#: Seconds a restarted sweep waits for a run another process still holds (an interrupted
#: sweep's run finishing) before it reports it.
WAIT_BUSY = 60.0
SEED_DIR = re.compile(r"^seed-(\d+)$")
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


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


def sweep_lock(out: Path) -> FolderLock:
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


def last_round(run_dir: Path) -> int:
    """The last round ``run_dir``'s metrics.jsonl records (0: none)."""
    return max((r[ROUND] for r in read_history(run_dir)), default=0)


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


def spec_rounds(data: Mapping[str, Any] | None) -> int | None:
    """``train.rounds`` of a resolved spec's mapping, None when it has none."""
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
    last = last_round(run_dir)
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
    plain: dict[str, Any] = json.loads(json.dumps(dict(data), default=str))
    plain.pop("output", None)
    if isinstance(plain.get("train"), dict):
        plain["train"].pop("rounds", None)
    return plain


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
    argv = python_command(["train", str(run.spec_path)])
    argv += ["--seed", str(run.seed), "--out", str(run.dir)]
    for item in overrides:
        argv += ["--set", item]
    if run.action == "resume":
        argv.append("--resume")
    elif run.action == "overwrite":
        argv.append("--overwrite")
    return argv
