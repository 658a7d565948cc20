"""The names a ppokit run writes in its output folder: the one list the trainer (which
writes and, with ``--overwrite``, removes them) and ``ppokit compare`` (which decides
whether a folder may be replaced) both read. Torch-free."""

from __future__ import annotations

__all__ = ["CHECKPOINT", "LOCK", "MARKER", "RUN_FILES", "SPEC_CHANGES", "TEMP_FILES"]

#: Written first into a run folder: JSON with the ppokit version and the creation time. A
#: folder without it was never a ppokit run and is never emptied.
MARKER = ".ppokit-run"
#: Locked (``flock``) for the life of a run, so a second run on the folder refuses.
LOCK = ".ppokit-lock"
CHECKPOINT = "checkpoint"
#: Deliberate spec changes on resume (``--allow-spec-change``), one JSON line each.
SPEC_CHANGES = "spec_changes.jsonl"

#: Files a run writes into its output folder (``--overwrite`` removes these, and only these
#: and TEMP_FILES; the lock file stays).
RUN_FILES = (
    MARKER,
    "metrics.jsonl",
    "samples.jsonl",
    "curves.png",
    "spec.yaml",
    SPEC_CHANGES,
    CHECKPOINT,
    # output.report_to (ppokit/trainer/trackers.py TRACKER_FILES): the trackers' run ids and
    # the local stores; removed with the run so an --overwrite starts new tracker runs
    "trackers.json",
    "tensorboard",
    "wandb",
    "mlruns",
)
#: Temporary names of the run's atomic writes.
TEMP_FILES = (
    f".{CHECKPOINT}.tmp",
    f".{CHECKPOINT}.old",
    f"{MARKER}.tmp",
    "metrics.jsonl.tmp",
    "samples.jsonl.tmp",
    "spec.yaml.tmp",
    "curves.tmp.png",
    "trackers.json.tmp",
)
