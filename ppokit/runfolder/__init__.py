"""The run folder: its file names, its safe writes, its lock, its readers, and the checks a
run makes before it writes into one. Everything that knows the layout of ``output.dir``
(the trainer, the checkpoints, the trackers, ``ppokit compare``, ``eval`` and ``export``)
reads it from here.

A run folder may come from elsewhere (a shared file system, a downloaded run): it is
untrusted input. The rules, written once here:

- **No link is followed when writing.** Files are written through :func:`write_atomic`
  (a fresh temporary file opened with ``O_NOFOLLOW | O_EXCL``, then a rename, which replaces
  a link itself) or :func:`append_line` (``O_NOFOLLOW``): a symbolic link where ppokit
  writes is an error, never a write into its target. A temporary name or the lock file that
  is a link is removed (the link, not its target) before the fresh file is made;
  :class:`RunFolder` refuses to resume a folder in which any of the names a run writes, or
  anything inside them, is a link, naming it; ``--overwrite`` removes links themselves
  (:func:`remove` never deletes through a link, and never outside the folder).
- **Nothing a folder says runs code.** :func:`read_run_spec` refuses a run's spec that sets
  ``model.trust_remote_code`` or names a ``python`` reward function unless the command line
  says so (``--trust-remote-code``).
- **What is read is bounded.** JSON and YAML read from a run folder are at most
  ``MAX_DEPTH`` levels deep (a deeper one is a one-line error, never a RecursionError).

Torch-free: the checks run before any model is loaded, and the CLI's light paths import it.
"""

from __future__ import annotations

from ppokit.runfolder.documents import (
    load_json,
    read_json,
    read_run_spec,
    read_spec_data,
)
from ppokit.runfolder.files import (
    append_line,
    ensure_dir,
    is_link,
    link_error,
    open_new,
    read_bytes,
    remove,
    write_atomic,
)
from ppokit.runfolder.folder import (
    RunFolder,
    has_checkpoint,
    how_to_continue,
    links_in,
    timestamp,
)
from ppokit.runfolder.lock import (
    FolderLock,
)
from ppokit.runfolder.metrics import (
    check_metrics,
    logged_rounds,
    read_metrics,
    truncate_jsonl,
)
from ppokit.runfolder.names import (
    CHECKPOINT,
    CHECKPOINT_OLD,
    CHECKPOINT_TMP,
    COMPARE_LOCK,
    CURVES_PNG,
    LIBRARY_LOG,
    LOCK,
    MARKER,
    MAX_DEPTH,
    METRICS,
    RUN_FILES,
    SAMPLES,
    SPEC,
    SPEC_CHANGES,
    TEMP_FILES,
    TRACKER_FILES,
    TRACKERS_JSON,
    temp_name,
)
from ppokit.runfolder.oserrors import (
    io_error,
    io_errors,
    is_os_error,
)

__all__ = [
    "CHECKPOINT",
    "CHECKPOINT_OLD",
    "CHECKPOINT_TMP",
    "COMPARE_LOCK",
    "CURVES_PNG",
    "LIBRARY_LOG",
    "LOCK",
    "MARKER",
    "MAX_DEPTH",
    "METRICS",
    "RUN_FILES",
    "SAMPLES",
    "SPEC",
    "SPEC_CHANGES",
    "TEMP_FILES",
    "TRACKERS_JSON",
    "TRACKER_FILES",
    "FolderLock",
    "RunFolder",
    "append_line",
    "check_metrics",
    "ensure_dir",
    "has_checkpoint",
    "how_to_continue",
    "io_error",
    "io_errors",
    "is_link",
    "is_os_error",
    "link_error",
    "links_in",
    "load_json",
    "logged_rounds",
    "open_new",
    "read_bytes",
    "read_json",
    "read_metrics",
    "read_run_spec",
    "read_spec_data",
    "remove",
    "temp_name",
    "timestamp",
    "truncate_jsonl",
    "write_atomic",
]
