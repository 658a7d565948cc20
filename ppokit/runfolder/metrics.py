"""The run's JSON-lines files: their readable records, cut back to a round, and checked
against a checkpoint before a resume."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ppokit.errors import UserError
from ppokit.metrics_table import ROUND
from ppokit.runfolder.documents import load_json
from ppokit.runfolder.files import read_bytes, write_atomic
from ppokit.runfolder.names import METRICS
from ppokit.runfolder.oserrors import io_error


def _records(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(line, record)`` of each readable line of a JSON-lines file of a run (a line cut
    short by a crash, a foreign or too deeply nested one is skipped). Missing: nothing."""
    try:
        text = read_bytes(path).decode("utf-8", errors="replace")
    except FileNotFoundError:
        return
    except OSError as exc:
        raise io_error(path, exc, "cannot read") from None
    for line in text.splitlines():
        try:
            record = load_json(line)
        except ValueError:
            continue
        round_no = record.get(ROUND) if isinstance(record, dict) else None
        if isinstance(round_no, int) and not isinstance(round_no, bool) and round_no >= 0:
            yield line, record


def read_metrics(out: Path) -> list[dict[str, Any]]:
    """The records of ``out/metrics.jsonl``: JSON objects with an integer ``round`` >= 0
    (anything else is skipped; no file: [])."""
    return [record for _, record in _records(Path(out) / METRICS)]


def logged_rounds(path: Path) -> list[int] | None:
    """The round numbers of ``metrics.jsonl``'s readable lines (None: no such file)."""
    if not path.exists():
        return None
    return [record[ROUND] for _, record in _records(path)]


def truncate_jsonl(path: Path, rounds: int) -> None:
    """Keep only the lines of ``path`` with ``round <= rounds`` (atomically)."""
    if not path.exists():
        return
    kept = [line for line, record in _records(path) if record[ROUND] <= rounds]
    write_atomic(path, "".join(k + "\n" for k in kept))


def _gaps(rounds: set[int], last: int) -> list[tuple[int, int]]:
    """The spans ``(first, last)`` of 1..last missing from ``rounds`` (no range is built)."""
    gaps: list[tuple[int, int]] = []
    expected = 1
    for r in sorted(n for n in rounds if 1 <= n <= last):
        if r > expected:
            gaps.append((expected, r - 1))
        expected = r + 1
    if expected <= last:
        gaps.append((expected, last))
    return gaps


def _spans(gaps: list[tuple[int, int]]) -> str:
    shown = [str(a) if a == b else f"{a}-{b}" for a, b in gaps[:4]]
    return ", ".join(shown) + (" ..." if len(gaps) > 4 else "")


def check_metrics(path: Path, checkpoint_round: int) -> list[int]:
    """Check that ``metrics.jsonl`` agrees with a checkpoint of ``checkpoint_round`` rounds.

    Returns the logged rounds after the checkpoint (what a resumed run redoes: they are
    dropped). A missing file or a missing round up to the checkpoint is a ``UserError`` that
    says what is inconsistent: resuming would leave a gap in the metrics.
    """
    rounds = logged_rounds(path)
    if checkpoint_round <= 0:
        return sorted({r for r in rounds or () if r > 0})
    if rounds is None:
        raise UserError(
            f"cannot resume: the checkpoint is at round {checkpoint_round} but {path} does "
            "not exist (the run's metrics would start with a gap); restore it, or start "
            "again with --overwrite"
        )
    logged = set(rounds)
    missing = _gaps(logged, checkpoint_round)
    if missing:
        last = max((r for r in logged if r <= checkpoint_round), default=0)
        # every round after ``last`` is missing: a cut file when nothing before it is
        what = (
            f"ends at round {last}"
            if missing[0][0] == last + 1
            else f"lacks round(s) {_spans(missing)}"
        )
        raise UserError(
            f"cannot resume: the checkpoint is at round {checkpoint_round} but {path} {what} "
            "(the metrics would have a gap); restore the file, or start again with --overwrite"
        )
    return sorted({r for r in logged if r > checkpoint_round})
