"""The names a run writes in its folder, and the depth bound of what is read from it."""

from __future__ import annotations

from pathlib import Path

#: Written first into a run folder: JSON with the ppokit version and the creation time. A
#: folder without it was never a ppokit run and is never emptied.
MARKER = ".ppokit-run"
#: Locked for the life of a run (``filelock``), so a second run on the folder refuses.
LOCK = ".ppokit-lock"
#: Locked for the life of a sweep in its ``--out`` folder (``ppokit compare``).
COMPARE_LOCK = ".ppokit-compare-lock"
CHECKPOINT = "checkpoint"
#: A checkpoint being written, and the previous one during the swap.
CHECKPOINT_TMP = f".{CHECKPOINT}.tmp"
CHECKPOINT_OLD = f".{CHECKPOINT}.old"
SPEC = "spec.yaml"
METRICS = "metrics.jsonl"
SAMPLES = "samples.jsonl"
CURVES_PNG = "curves.png"
#: Deliberate spec changes on resume (``--allow-spec-change``), one JSON line each.
SPEC_CHANGES = "spec_changes.jsonl"
#: The log lines of the libraries a run drives (vLLM's), one a line, appended.
LIBRARY_LOG = "library.log"
#: What ``output.report_to`` writes (ppokit/trainer/trackers.py): the trackers' run ids and
#: their local stores; removed with the run so an --overwrite starts new tracker runs.
TRACKERS_JSON = "trackers.json"
TRACKER_FILES = (TRACKERS_JSON, "tensorboard", "wandb", "mlruns")

#: Files a run writes into its output folder (``--overwrite`` removes these, and only these
#: and TEMP_FILES; the lock file stays).
RUN_FILES = (
    MARKER,
    METRICS,
    SAMPLES,
    CURVES_PNG,
    SPEC,
    SPEC_CHANGES,
    LIBRARY_LOG,
    CHECKPOINT,
    *TRACKER_FILES,
)
#: Files written whole (through :func:`write_atomic`, under :func:`temp_name`).
_ATOMIC = (MARKER, METRICS, SAMPLES, CURVES_PNG, SPEC, TRACKERS_JSON)


def temp_name(path: Path) -> Path:
    """The temporary file :func:`write_atomic` writes ``path`` through: ``NAME.tmp``."""
    return path.with_name(path.name + ".tmp")


#: Temporary names of the run's atomic writes.
TEMP_FILES = (CHECKPOINT_TMP, CHECKPOINT_OLD, *(f"{name}.tmp" for name in _ATOMIC))

#: JSON and YAML read from a run folder nest at most this deep.
MAX_DEPTH = 64
